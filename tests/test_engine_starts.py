"""Engine start-up on vLLM 0.32 CPU: the compile cache loads, starts never abort, and
engines start one after another in one process whatever that process imported."""

from __future__ import annotations

import json

import pytest

from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import run_cli, tiny_engine_config

# a job, several engines or processes: `make test` runs it, `make test-fast` does not
pytestmark = pytest.mark.slow

GREEDY = SamplingSettings(temperature=0.0, max_tokens=24)
CACHE_LOADED = "Directly load AOT compilation"
CACHE_MISSED = "Compiling model again due to a load failure"


@pytest.fixture(autouse=True)
def plugin_loaded():
    """The plugin as vLLM loads it in every process it starts an engine in."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def test_kernel_overrides_register_after_numba_is_imported():
    """vLLM's ngram proposer imports numba; the next engine start in that process
    re-registers the CPU kernel overrides, whose module scan met llvmlite's wrapper."""
    import llvmlite.binding.ffi  # noqa: F401  (what numba loads)
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def test_engines_start_one_after_another_after_an_ngram_engine(
    tiny_target, tiny_draft, plain_engine, questions
):
    prompts = questions[:4]
    want = [g[0].token_ids for g in plain_engine.generate(prompts, GREEDY).outputs]
    ngram = Engine(
        tiny_engine_config(tiny_target),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    try:
        assert [g[0].token_ids for g in ngram.generate(prompts, GREEDY).outputs] == want
    finally:
        ngram.shutdown()
    for _ in range(2):
        eagle = Engine(tiny_engine_config(tiny_target, tiny_draft))
        try:
            got = eagle.generate(prompts, GREEDY)
        finally:
            eagle.shutdown()
        assert [g[0].token_ids for g in got.outputs] == want
        assert got.spec["drafts"] > 0


def test_compiled_eagle_engine_starts_from_the_cache_in_fresh_processes(
    tiny_target, tiny_draft, questions, tmp_path
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(questions[:3]) + "\n")
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}  # cold at the first start
    args = ["generate", "--model", tiny_target, "--draft", tiny_draft, "--k", "3"]
    args += ["--prompts", str(prompts), "--max-tokens", "24", "--kv-cache-gib", "0.25"]
    outputs, logs = [], []
    for start in range(3):
        out = tmp_path / f"out{start}.json"
        proc = run_cli(*args, "--json", str(out), env=env)
        logs.append(proc.stdout + proc.stderr)
        outputs.append(json.loads(out.read_text())["outputs"])
    assert logs[0].count(CACHE_LOADED) == 0
    for log in logs[1:]:
        assert CACHE_MISSED not in log
        assert log.count(CACHE_LOADED) == 2  # the target backbone and the EAGLE head
    assert outputs[1] == outputs[2] == outputs[0]
