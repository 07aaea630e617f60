"""Per-request seeds on a CPU engine (vllm_plugin/patches/fixes/cpu_seed_rewind_v0_32.py):
a prompt whose prefill is split over several steps samples a token at each chunk that vLLM
throws away and then rewinds that request's generator to before it. vLLM rewinds a CUDA
generator's offset, which a CPU generator does not have ("CPU Generator does not use
offset"): without the fix the engine dies on the first split prefill of a seeded request."""

from __future__ import annotations

from grpo_specdec.engine import SamplingSettings

# More prompt tokens than one step schedules (vLLM's CPU budget is a few thousand tokens),
# so that some prefills are split.
PROMPTS = 24
PROMPT_TOKENS = 400


def _prompts(offset: int = 0) -> list[list[int]]:
    return [[5 + (i * 7 + j + offset) % 200 for j in range(PROMPT_TOKENS)] for i in range(PROMPTS)]


def test_seeded_requests_survive_split_prefills_and_follow_their_seeds(plain_engine):
    sampling = SamplingSettings(temperature=1.0, max_tokens=8)
    seeds = list(range(100, 100 + PROMPTS))
    first = plain_engine.generate(_prompts(), sampling, seeds=seeds)
    # The same requests, scheduled beside others this time, so their prefills are cut at
    # other places: each request's tokens follow its own seed, however its prefill ran.
    crowd = plain_engine.generate(
        _prompts(offset=3)[:5] + _prompts(), sampling, seeds=list(range(5)) + seeds
    )
    again = [s[0].token_ids for s in crowd.outputs[5:]]
    assert again == [s[0].token_ids for s in first.outputs]
    other = plain_engine.generate(_prompts(), sampling, seeds=[s + 1 for s in seeds])
    assert [s[0].token_ids for s in other.outputs] != again


def test_a_speculative_engine_follows_per_request_seeds(eagle_engine):
    """Drafts are verified by rejection sampling on each request's own generator: a seeded
    request's answer is the same whichever requests run beside it."""
    sampling = SamplingSettings(temperature=1.0, max_tokens=16)
    seeds = list(range(PROMPTS))
    alone = eagle_engine.generate(_prompts(), sampling, seeds=seeds)
    crowd = eagle_engine.generate(
        _prompts(offset=3)[:5] + _prompts(), sampling, seeds=[90 + s for s in range(5)] + seeds
    )
    assert [s[0].token_ids for s in crowd.outputs[5:]] == [s[0].token_ids for s in alone.outputs]
    assert alone.spec["draft_tokens"] > 0
