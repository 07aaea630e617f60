"""What `grpo-specdec train` prints: the progress, the tables and real errors; vLLM's
warnings (per layer on every weight swap) go to the run's vllm.log, which it names."""

from __future__ import annotations

import re

import pytest

from tests.conftest import TINY_JOB_CONFIG, job_overrides, run_cli

# a job, several engines or processes: `make test` runs it, `make test-fast` does not
pytestmark = pytest.mark.slow

# A line vLLM's logger wrote, in its own format or in the job's log file's.
_VLLM_RECORD = re.compile(r"(WARNING|INFO) (\d\d-\d\d [\d:]+ \[\w+\.py:\d+\]|\[vllm\.)")


# What Python prints for an exception nobody caught, or one raised in a finaliser (the
# oneDNN handle release once recursed to the stack limit during torch.compile's tracing).
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|Exception ignored in|RecursionError")


def test_console_carries_no_vllm_warnings_and_the_log_file_all_of_them(
    tiny_target, tiny_draft, job_profile, tmp_path
):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--config",
        TINY_JOB_CONFIG,
        *job_overrides(tiny_target, tiny_draft, job_profile, out, 1),
        "compare_at_end=true",
        # compiled, as `make demo` starts its engines: the tiny job is otherwise eager
        "rollout.enforce_eager=false",
        timeout=900,
    )
    console = proc.stdout + proc.stderr
    assert not _TRACEBACK.search(console), console[-4000:]
    log = out / "vllm.log"
    assert proc.stdout.splitlines()[0] == f"vLLM's messages go to {log} (errors also here)"
    # The draft swap reloads layer by layer: vLLM warns once per layer without weights.
    layer_lines = [
        line for line in log.read_text().splitlines() if "Failed to load weights" in line
    ]
    assert layer_lines, log.read_text()[-2000:]
    assert "Failed to load weights" not in console
    assert not [line for line in console.splitlines() if _VLLM_RECORD.search(line)], console
    # The tables a user came for, and the count of what went to the file.
    assert "| reward mean |" in proc.stdout and "| no speculation |" in proc.stdout
    # per iteration, and the held-out accuracy before training and after the last iteration
    assert "| iteration | reward mean | accuracy | token entropy |" in proc.stdout
    assert "held-out greedy accuracy (16 problems): iteration 0 " in proc.stdout
    assert " -> iteration 1 " in proc.stdout
    warnings = sum(" WARNING [vllm" in line for line in log.read_text().splitlines())
    assert f"vLLM: {warnings} warnings, 0 errors in {log}" in proc.stdout.splitlines()
