"""Policies beyond Llama: tiny Qwen2 (bias on q/k/v) and Qwen3 (q/k norms, an untied
lm_head) targets built by `grpo-specdec models tiny --architecture`, each through what a
user runs: `draft train`, concurrency-aware generation (greedy equal to the plain engine,
drafts accepted), and the GRPO job with a new head learning online."""

from __future__ import annotations

import json

import pytest

from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import TINY_JOB_CONFIG, job_records, run_cli, tiny_assets, tiny_engine_config

pytestmark = pytest.mark.slow  # builds two tiny models and runs a job

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def qwen(request):
    root = tiny_assets(request.param)
    config = json.loads((root / "target" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[request.param]]
    if request.param == "qwen3":
        assert config["tie_word_embeddings"] is False and "layer_types" in config
    return request.param, root


def test_draft_train_makes_a_head_for_a_qwen_target(qwen, questions, tmp_path):
    arch, root = qwen
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(questions[:16]) + "\n")
    out = tmp_path / "head"
    run_cli(
        "draft", "train", "--target", str(root / "target"), "--prompts", str(prompts),
        "--out", str(out), "--steps", "20", "--max-tokens", "32", "--eager",
    )  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and "layer_types" not in config
    assert (
        config["hidden_size"]
        == json.loads((root / "target" / "config.json").read_text())["hidden_size"]
    )


def test_concurrency_aware_generation_on_a_qwen_target_is_the_plain_engine_s(
    qwen, questions, job_profile
):
    arch, root = qwen
    sampling = SamplingSettings(max_tokens=40)
    plain = Engine(tiny_engine_config(str(root / "target")))
    try:
        expected = [g[0].token_ids for g in plain.generate(questions[:8], sampling).outputs]
    finally:
        plain.shutdown()
    speculative = {
        "draft": str(root / "draft"),
        "k": 3,
        "concurrency_aware": True,
        "controller": {"profile": job_profile},
    }
    engine = Engine(tiny_engine_config(str(root / "target"), speculative=speculative))
    try:
        result = engine.generate(questions[:8], sampling)
    finally:
        engine.shutdown()
    assert [g[0].token_ids for g in result.outputs] == expected, arch
    assert result.spec["draft_tokens"] > 0 and result.spec["accepted_tokens"] > 0, arch


def test_the_grpo_job_trains_a_new_online_head_for_a_qwen3_policy(job_profile, tmp_path):
    root = tiny_assets("qwen3")
    out = tmp_path / "run"
    run_cli(
        "train", "--config", TINY_JOB_CONFIG, f"model.policy={root / 'target'}",
        "model.draft=null", f"rollout.controller.profile={job_profile}", f"out={out}",
        "iterations=2", "eval.every=0", "data.levels=[1]",
    )  # fmt: skip
    records = job_records(out)
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["draft_steps"] > 0 for r in records)  # the head learnt every iteration
    assert records[-1]["engine_draft_version"] == 2  # and was swapped into the engine
    head = out / "checkpoints" / "iter_000002" / "draft" / "config.json"
    assert json.loads(head.read_text())["num_hidden_layers"] == 1
