"""The prepared GPU check (`benchmarks/gpu.py check`) runs end to end, here on the tiny shape
on CPU: both learners' steps, the draft step on the policy's hidden states."""

from __future__ import annotations

import json

from benchmarks import gpu


def test_the_gpu_check_runs_both_learners_on_the_tiny_shape(tmp_path):
    out = tmp_path / "check.json"
    gpu.main(
        [
            "check",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--samples",
            "4",
            "--micro-batch",
            "2",
            "--prompt-tokens",
            "8",
            "--response-tokens",
            "16",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert len(data["steps"]) == 2
    for step in data["steps"]:
        assert step["draft_steps"] == 2  # 4 sequences in micro-batches of 2
        assert step["hidden_gib"] > 0 and step["forward_s"] > 0
    assert "| 1 |" in gpu.check_report(data)
