"""The engine wrapper on a real vLLM engine with the tiny models."""

from __future__ import annotations

import json

import pytest

from grpo_specdec.engine import SamplingSettings
from tests.conftest import run_cli, tiny_engine_config

GREEDY = SamplingSettings(temperature=0.0, max_tokens=48)


@pytest.mark.parametrize("batch", [1, 4, 18])
def test_eagle_greedy_outputs_equal_plain(plain_engine, eagle_engine, questions, batch):
    prompts = questions[:batch]
    plain = plain_engine.generate(prompts, GREEDY)
    spec = eagle_engine.generate(prompts, GREEDY)
    assert [g[0].token_ids for g in spec.outputs] == [g[0].token_ids for g in plain.outputs]
    assert spec.spec["drafts"] > 0 and spec.spec["accepted_tokens"] > 0
    assert plain.spec["drafts"] == 0


def test_outputs_are_varied_text(plain_engine, questions):
    out = plain_engine.generate(questions, GREEDY)
    texts = {g[0].text for g in out.outputs}
    assert len(texts) >= len(questions) // 2
    assert all(len(set(g[0].token_ids)) > 3 for g in out.outputs)


def test_n_samples_per_prompt_and_finish_reasons(eagle_engine, questions):
    out = eagle_engine.generate(
        questions[:3], SamplingSettings(n=4, temperature=1.0, max_tokens=8, seed=1)
    )
    assert [len(g) for g in out.outputs] == [4, 4, 4]
    assert all(s.finish_reason in ("stop", "length") for g in out.outputs for s in g)
    assert all(len(s.token_ids) <= 8 for g in out.outputs for s in g)
    assert len({tuple(s.token_ids) for s in out.outputs[0]}) > 1


def test_spec_metrics_are_consistent(eagle_engine, questions):
    m = eagle_engine.generate(questions, GREEDY).spec
    assert 0 < m["accepted_tokens"] <= m["draft_tokens"] == 3 * m["drafts"]
    per_pos = m["accepted_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == m["accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert m["acceptance_rate"] == pytest.approx(m["accepted_tokens"] / m["draft_tokens"])
    assert m["mean_acceptance_length"] == pytest.approx(m["accepted_tokens"] / m["drafts"] + 1)


def test_each_prompt_gets_its_own_token_budget_and_finish_time(eagle_engine, questions):
    budgets = [3, 40, 12]
    out = eagle_engine.generate(
        questions[:3], SamplingSettings(max_tokens=64, ignore_eos=True), max_tokens=budgets
    )
    assert [len(g[0].token_ids) for g in out.outputs] == budgets
    assert min(out.scheduled_s) == 0.0
    # A step makes at most 1 + k tokens of each: the longest budget finishes last.
    order = sorted(range(3), key=lambda i: out.finished_s[i])
    assert order == [0, 2, 1]
    assert all(f > s for s, f in zip(out.scheduled_s, out.finished_s, strict=True))
    assert max(out.finished_s) <= out.wall_s


def test_each_sample_gets_its_own_budget_and_stays_with_its_prompt(eagle_engine, questions):
    budgets = [[5, 30, 9], [17, 2, 11]]
    # top_p this small keeps only the likeliest token: each sample is the greedy answer.
    sampling = SamplingSettings(n=3, temperature=1.0, top_p=1e-3, max_tokens=64, ignore_eos=True)
    out = eagle_engine.generate(questions[:2], sampling, max_tokens=budgets)
    assert [[len(s.token_ids) for s in g] for g in out.outputs] == budgets
    assert len(out.finished_s) == 6  # a request per sample
    # So every sample of a prompt is its greedy continuation, cut at its own budget.
    whole = eagle_engine.generate(questions[:2], SamplingSettings(max_tokens=30, ignore_eos=True))
    for group, (ref,) in zip(out.outputs, whole.outputs, strict=True):
        for s in group:
            assert s.token_ids == ref.token_ids[: len(s.token_ids)]


def test_per_prompt_budgets_are_checked(plain_engine, questions):
    with pytest.raises(ValueError, match="2 max_tokens for 3 prompts"):
        plain_engine.generate(questions[:3], GREEDY, max_tokens=[4, 4])
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        plain_engine.generate(questions[:2], GREEDY, max_tokens=[4, 0])
    with pytest.raises(ValueError, match="max_tokens of prompt 1: 1 budgets for n=2"):
        plain_engine.generate(
            questions[:2],
            SamplingSettings(n=2, temperature=1.0, max_tokens=8),
            max_tokens=[[4, 4], [4]],
        )


def test_chat_template_and_raw_prompts_differ(plain_engine):
    chat = plain_engine.encode("Ana has 3 apples.")
    raw = plain_engine.encode("Ana has 3 apples.", chat=False)
    assert len(chat) > len(raw)
    assert plain_engine.tokenizer.decode(chat).startswith("<|user|>")


def test_prompt_longer_than_context_is_rejected(plain_engine):
    with pytest.raises(ValueError, match="prompt 1 has .* max_model_len=512"):
        plain_engine.generate(["short", "word " * 600], GREEDY, chat=False)


def test_generate_cli_writes_outputs_and_metrics(tiny_target, tiny_draft, questions, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(questions[:4]) + "\n")
    out = tmp_path / "out.json"
    run_cli(
        "generate",
        "--model",
        tiny_target,
        "--draft",
        tiny_draft,
        "--k",
        "2",
        "--prompts",
        str(prompts),
        "--n",
        "2",
        "--temperature",
        "1.0",
        "--seed",
        "3",
        "--max-tokens",
        "16",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-gib",
        "0.25",
        "--eager",
        "--json",
        str(out),
    )
    payload = json.loads(out.read_text())
    assert len(payload["outputs"]) == 4 and all(len(g) == 2 for g in payload["outputs"])
    sample = payload["outputs"][0][0]
    assert set(sample) == {"text", "token_ids", "finish_reason"} and sample["token_ids"]
    assert payload["spec"]["draft_tokens"] == 2 * payload["spec"]["drafts"] > 0
    assert payload["wall_s"] > 0


def test_generate_cli_takes_the_context_length_from_the_model(tiny_target, tmp_path):
    # The README's plain generate line (--eager only to skip compilation here).
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "Ana has 3 apples. Ana gets 4 more apples. How many apples does Ana have now?\n"
    )
    out = tmp_path / "out.json"
    run_cli(
        "generate", "--model", tiny_target, "--prompts", str(prompts), "--json", str(out), "--eager"
    )
    assert json.loads(out.read_text())["outputs"][0][0]["token_ids"]


def test_default_context_length_fits_a_small_kv_cache(tiny_target, tiny_draft, questions):
    from grpo_specdec.engine import Engine

    cfg = tiny_engine_config(
        tiny_target, tiny_draft, max_model_len=None, kv_cache_gib=0.001, max_num_seqs=4
    )
    assert cfg.max_model_len < 1024  # the cache, not the position limit, decides here
    engine = Engine(cfg)  # vLLM refuses to start when one full-length sequence does not fit
    try:
        assert engine.llm.llm_engine.vllm_config.model_config.max_model_len == cfg.max_model_len
        out = engine.generate(questions[:2], GREEDY)
    finally:
        engine.shutdown()
    assert all(g[0].token_ids for g in out.outputs)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    proc = run_cli("models", "prepare", "smollm2")
    return proc.stdout.strip().splitlines()[-1]


def test_smollm2_prepared_answers_a_chat_prompt(smollm2_dir):
    from grpo_specdec.engine import Engine, EngineConfig

    again = run_cli("models", "prepare", "smollm2").stdout.strip().splitlines()[-1]
    assert again == smollm2_dir  # idempotent: the second call reuses the folder
    engine = Engine(
        EngineConfig(
            model=smollm2_dir,
            dtype="bfloat16",
            max_model_len=512,
            kv_cache_gib=0.25,
            enforce_eager=True,
        )
    )
    try:
        out = engine.generate(
            ["What is 2 + 3? Answer with a number."], SamplingSettings(max_tokens=24)
        )
    finally:
        engine.shutdown()
    assert out.outputs[0][0].text.strip()
    assert engine.tokenizer.decode(out.prompt_token_ids[0]).startswith("<|im_start|>")
