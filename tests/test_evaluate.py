"""Held-out evaluation (grpo_specdec/evaluate.py) and `grpo-specdec eval`."""

from __future__ import annotations

import json

import pytest

from grpo_specdec.evaluate import (
    TRAIN_QUESTIONS_CHECKED,
    arithmetic_eval_set,
    policy_folder,
    score,
    wilson_interval,
)
from grpo_specdec.tasks.datasets import ArithmeticSource, Example
from tests.conftest import run_cli


def test_wilson_interval_matches_known_values_and_stays_inside_0_1():
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson_interval(200, 200)
    assert high == 1.0 and low == pytest.approx(0.9812, abs=1e-4)
    with pytest.raises(ValueError):
        wilson_interval(0, 0)


def test_the_arithmetic_held_out_split_is_fixed_and_never_trained_on():
    held_out = arithmetic_eval_set(0, [1, 2], 300)
    assert held_out == arithmetic_eval_set(0, [1, 2], 300)
    train = ArithmeticSource(0, [1, 2])
    seen = {train.get(i).question for i in range(TRAIN_QUESTIONS_CHECKED)}
    assert not {e.question for e in held_out} & seen
    # Level 1's question space is small: the plain other-seed stream does repeat training
    # questions, which is why the split filters them out.
    other_seed = ArithmeticSource(1_000_003, [1, 2])
    assert {other_seed.get(i).question for i in range(600)} & seen


def test_score_reads_greedy_accuracy_format_and_mean_at_g():
    examples = [Example("q1", "7"), Example("q2", "12"), Example("q3", "3"), Example("q4", "1")]
    greedy = ["7", "The answer is 12.", "so 4", "none"]
    sampled = [["7", "8"], ["12", "12"], ["3", "3"], ["0", "2"]]
    report = score(examples, greedy, sampled)
    assert report["correct"] == 2 and report["accuracy"] == 0.5
    assert report["interval"] == list(wilson_interval(2, 4))
    assert report["answer_format"] == 0.25
    assert report["mean_at_g"] == pytest.approx((0.5 + 1 + 1 + 0) / 4) and report["samples"] == 2
    with pytest.raises(ValueError, match="3 answers for 4"):
        score(examples, greedy[:3], None)


def test_policy_folder_finds_the_weights_or_names_what_is_missing(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"holds no weights \(\*\.safetensors\)"):
        policy_folder(str(model))
    (model / "model.safetensors").write_bytes(b"")
    assert policy_folder(str(model)) == str(model)
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000004"
    (ckpt / "policy").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="iter_000004/policy holds no weights"):
        policy_folder(str(ckpt))
    (ckpt / "policy" / "model.safetensors").write_bytes(b"")
    assert policy_folder(str(ckpt)) == str(ckpt / "policy")
    with pytest.raises(FileNotFoundError, match="a run folder with no checkpoint yet"):
        policy_folder(str(tmp_path / "run"))
    (ckpt / "state.json").write_text("{}")
    (ckpt.parent / "latest").write_text("iter_000004")
    assert policy_folder(str(tmp_path / "run")) == str(ckpt / "policy")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        policy_folder(str(tmp_path / "absent"))


def test_eval_command_reports_greedy_accuracy_mean_at_g_and_refuses_bad_input(
    tiny_target, tmp_path
):
    report_path = tmp_path / "report.json"
    proc = run_cli(
        "eval",
        "--model",
        tiny_target,
        "--num",
        "12",
        "--max-tokens",
        "8",
        "--samples",
        "2",
        "--json",
        str(report_path),
        "--eager",
    )
    report = json.loads(report_path.read_text())
    assert report["examples"] == 12 and report["samples"] == 2 and report["max_tokens"] == 8
    low, high = report["interval"]
    assert low <= report["accuracy"] <= high
    assert report["correct"] == round(report["accuracy"] * 12)
    assert (
        proc.stdout.strip()
        .splitlines()[-1]
        .startswith(
            f"held-out greedy accuracy {report['accuracy']:.3f} [{low:.3f}, {high:.3f}] "
            f"({report['correct']}/12), mean@2"
        )
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"question": "1+1?", "answer": "2 #### 2"}\n{"question": "2+2?", "answer": "x/"}\n'
    )
    proc = run_cli(
        "eval", "--model", tiny_target, "--data", str(bad), "--reward", "number", check=False
    )
    assert proc.returncode == 2
    assert f"{bad} line 2: field 'answer': ground truth 'x/' is not a plain number" in proc.stderr
    proc = run_cli("eval", "--model", str(tmp_path), check=False)
    assert proc.returncode == 2 and "holds no weights" in proc.stderr
