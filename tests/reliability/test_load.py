"""Many concurrent requests through the concurrency-aware plugin on the tiny models."""

from __future__ import annotations

import resource

import pytest

from grpo_specdec.engine import Engine, SamplingSettings
from grpo_specdec.tasks.arithmetic import make_problems
from tests.conftest import tiny_engine_config

pytestmark = pytest.mark.slow


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_2048_requests_complete_losslessly_with_bounded_memory(
    tiny_target, tiny_draft, job_profile, plain_engine
):
    prompts = [
        p.question for lvl in (1, 2) for p in make_problems(128, seed=99, level=lvl)
    ]  # 256 prompts
    requests = [p for p in prompts for _ in range(8)]  # x 8 samples = 2048 requests
    sampling = SamplingSettings(max_tokens=24)
    engine = Engine(
        tiny_engine_config(
            tiny_target,
            max_num_seqs=256,
            kv_cache_gib=0.5,
            speculative={
                "draft": tiny_draft,
                "k": 4,
                "concurrency_aware": True,
                "controller": {"profile": job_profile},
            },
        )
    )
    try:
        before = _peak_rss_mb()
        got = engine.generate(requests, sampling)
        trace = list(engine.scheduler().step_trace)
        peak = _peak_rss_mb()
    finally:
        engine.shutdown()
    want = plain_engine.generate(requests, sampling)
    assert len(got.outputs) == 2048 and all(
        g[0].finish_reason in ("stop", "length") for g in got.outputs
    )
    assert [g[0].token_ids for g in got.outputs] == [g[0].token_ids for g in want.outputs]
    assert max(b for _, b, _, _ in trace) == 256  # the engine really ran at full concurrency
    print(f"peak RSS {peak:.0f} MB (was {before:.0f} MB before the 2048 requests)")
    assert peak - before < 1024  # bounded: the KV cache is preallocated, requests queue
