"""The lossless check where speculation's bookkeeping is hardest, on the free k = 0 engine
under its step cycle (tests/step_cycle.py): contexts near the model's length limit,
skipped draft passes beyond what the patch keeps (the draft then attends to stale KV),
and requests preempted and recomputed mid-generation. T = 1 outputs must still follow
the target's exact next-token distributions (tests/conftest.py: target_fit)."""

from __future__ import annotations

import pytest

from tests.conftest import assert_same_distribution, lossless_sampling
from tests.step_cycle import generate_under_the_step_cycle, step_cycle_engine
from vllm_plugin.patches.features import free_k0_v0_32 as free_k0

# a job, several engines or processes: `make test` runs it, `make test-fast` does not
pytestmark = pytest.mark.slow


def long_prompts(engine, questions, tokens: int) -> list[list[int]]:
    """Three prompts of `tokens` token ids each, made of the questions' text."""
    tokenizer = engine.llm.get_tokenizer()
    text = " ".join(questions * 40)
    return [tokenizer.encode(text[i * 7 :])[:tokens] for i in range(3)]


def test_long_contexts_keep_the_target_s_distribution(free_k0_engine, plain_engine, questions):
    engine = free_k0_engine
    max_len = engine.llm.llm_engine.model_config.max_model_len
    prompts = long_prompts(engine, questions, max_len - 2 * lossless_sampling().max_tokens)
    lazy, (skipped, caught_up) = generate_under_the_step_cycle(
        engine, True, prompts, lossless_sampling()
    )
    assert skipped > 0 and caught_up > 0
    assert min(len(p) for p in lazy.prompt_token_ids) > 0.9 * max_len - 30
    assert_same_distribution(lazy, plain_engine)


@pytest.fixture
def kept_one_step(free_k0_engine):
    """The free-k0 patch keeps at most about one skipped step's draft inputs: older ones
    are dropped, and the draft has holes in its KV cache where they were."""

    def bound(max_bytes):
        def set_bound(worker):
            kept = free_k0.kept_inputs(worker.model_runner.drafter)
            kept.max_bytes, kept.dropped_steps = max_bytes, 0

        free_k0_engine.llm.collective_rpc(set_bound)

    bound(1 << 14)
    yield lambda: free_k0_engine.llm.collective_rpc(
        lambda worker: free_k0.kept_inputs(worker.model_runner.drafter).dropped_steps
    )[0]
    bound(free_k0.MAX_KEPT_BYTES)


def test_steps_dropped_past_the_catch_up_bound_keep_the_target_s_distribution(
    free_k0_engine,
    plain_engine,
    questions,
    kept_one_step,
):
    lazy, (skipped, caught_up) = generate_under_the_step_cycle(
        free_k0_engine, True, questions[:3], lossless_sampling()
    )
    assert kept_one_step() > 0 and skipped > 0
    assert_same_distribution(lazy, plain_engine)


@pytest.fixture(scope="module")
def cramped_engine(tiny_target, tiny_draft, tmp_path_factory):
    """The free-k0 engine with a KV cache of 10 blocks of 128 tokens (on CPU): requests
    whose prompts nearly fill a block are admitted one block each, then each needs a second
    as it generates, and the scheduler preempts some to recompute them later."""
    cramped = step_cycle_engine(
        tiny_target,
        tiny_draft,
        tmp_path_factory.mktemp("cramped"),
        "greedy",
        max_model_len=256,
        kv_cache_gib=2 / 1024,
    )
    yield cramped
    free_k0.ENABLED = True
    cramped.shutdown()


def test_preempted_requests_keep_the_target_s_distribution(cramped_engine, plain_engine, questions):
    scheduler = cramped_engine.scheduler()
    preempt = scheduler._preempt_request
    preempted = []

    def counting(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counting
    try:
        # 122 prompt tokens: the first block fills within the first few generated.
        prompts = long_prompts(cramped_engine, questions, 122)
        result, (skipped, _) = generate_under_the_step_cycle(
            cramped_engine, True, prompts, lossless_sampling()
        )
    finally:
        del scheduler._preempt_request
    assert len(preempted) > 10 and skipped > 0, (len(preempted), skipped)
    assert_same_distribution(result, plain_engine)
