"""The scheduler class every GPU user gets: vLLM turns async scheduling on for EAGLE on
CUDA (it is forced off on CPU), and `ConcurrencyAwareScheduler` then builds
`AsyncConcurrencyAwareScheduler`. Driven here as vLLM's own scheduler tests drive theirs
(tests/v1/core/test_async_scheduler.py upstream): the real scheduler over a KV cache spec,
fake model-runner outputs, step N + 1 scheduled before step N's output arrives; while k
changes between steps."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.conftest import engine_kwargs, tiny_engine_config
from vllm_plugin.goodput_controller import GoodputController
from vllm_plugin.scheduler import AsyncConcurrencyAwareScheduler, ConcurrencyAwareScheduler

K_MAX = 3
BLOCKS = 512
REQUESTS = 4
MAX_TOKENS = 24


@pytest.fixture
def scheduler(monkeypatch, tiny_target, tiny_draft):
    speculative = {
        "draft": tiny_draft,
        "k": K_MAX,
        "concurrency_aware": True,  # the goodput controller, with no profile
    }
    cfg = tiny_engine_config(tiny_target, tiny_draft, speculative=speculative, max_num_seqs=8)
    config = EngineArgs(**engine_kwargs(monkeypatch, cfg)).create_engine_config()
    config.scheduler_config.async_scheduling = True  # vLLM's default for EAGLE on CUDA
    block = config.cache_config.block_size
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    config.cache_config.num_gpu_blocks = BLOCKS
    return ConcurrencyAwareScheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block,
        log_stats=True,
    )


def requests(block_size: int) -> list[Request]:
    init_none_hash(sha256)  # bytes, as vLLM's own hashes are (0.33 appends bytes to them)
    hasher = get_request_block_hasher(block_size, sha256)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        Request(f"r{i}", [i + 1] * (5 + i), params, None, block_hasher=hasher)
        for i in range(REQUESTS)
    ]


def output(out: SchedulerOutput, accept: dict[str, int]) -> ModelRunnerOutput:
    """What a runner returns for `out`: per request its bonus token after `accept[req]` of
    the drafts it verified (all of them when not named)."""
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for req in ids:
        verified = len(out.scheduled_spec_decode_tokens.get(req, ()))
        sampled.append([7] * (1 + min(accept.get(req, verified), verified)))
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


class Scripted(GoodputController):
    """The goodput controller, fed by the scheduler as ever, drafting the k it is told."""

    k = 0

    def choose(self, batch_size, context=None, requests=()):
        return self.k


def test_async_scheduling_builds_the_async_variant_with_its_controller(scheduler):
    assert isinstance(scheduler, AsyncConcurrencyAwareScheduler)
    assert scheduler.num_spec_tokens == K_MAX
    assert scheduler.acceptance.k_max == K_MAX


# vLLM 0.33's scheduler skips drafting after a step whose every request ends in it
# (`can_skip_drafts`, on by default with Model Runner V2, which a CPU engine does not run):
# on 0.33 the test runs with it on as well.
DRAFT_SKIPPING = [False] + ([True] if hasattr(Scheduler, "_drafts_unused") else [])


@pytest.mark.parametrize("skipping", DRAFT_SKIPPING)
def test_k_changes_between_steps_and_acceptance_feeds_back(scheduler, skipping):
    """Each step's k (the lookup at its batch) sizes the placeholders the next step
    verifies; every verified draft reaches the estimator with the tokens accepted; the
    requests end with exactly their tokens."""
    if skipping:
        scheduler.can_skip_drafts = True
    skipped = 0
    reqs = requests(scheduler.block_size)
    for r in reqs:
        scheduler.add_request(r)
    ks = iter([2, 0, 3, 1, 3, 3, 0, 2] * 20)  # r0 accepts one draft at most, the others all
    scripted = Scripted(None, scheduler.new_acceptance(), scheduler.max_num_running_reqs)
    scheduler.set_policy(scripted)

    def next_step() -> SchedulerOutput:
        scripted.k = k = next(ks)
        out = scheduler.schedule()
        assert out.num_spec_tokens_to_schedule == (k if out.num_scheduled_tokens else K_MAX)
        return out

    in_flight: deque[SchedulerOutput] = deque([next_step(), next_step()])
    previous_k = None
    vllm_drafts = vllm_accepted = 0
    while in_flight:
        out = in_flight.popleft()
        new = {n.req_id for n in out.scheduled_new_reqs}
        for req in set(out.num_scheduled_tokens) - new:
            verified = out.scheduled_spec_decode_tokens.get(req, [])
            # the placeholders of the k chosen the step before, as many as it chose
            assert verified == [-1] * previous_k, (req, verified, previous_k)
            assert out.num_scheduled_tokens[req] == 1 + len(verified)
        previous_k = out.num_spec_tokens_to_schedule
        skipped += bool(getattr(out, "skip_drafts", False))
        for engine_out in scheduler.update_from_output(out, output(out, {"r0": 1})).values():
            spec = engine_out.scheduler_stats and engine_out.scheduler_stats.spec_decoding_stats
            if spec:
                vllm_drafts += spec.num_drafts
                vllm_accepted += spec.num_accepted_tokens
        nxt = next_step()
        if nxt.num_scheduled_tokens:
            in_flight.append(nxt)
    assert scheduler.get_num_unfinished_requests() == 0
    assert [r.num_output_tokens for r in reqs] == [MAX_TOKENS] * REQUESTS
    assert (skipped > 0) == skipping
    assert scheduler.k_check.seen is None  # vLLM ran every k the scheduler chose
    # what the controller learnt from is what vLLM's own statistics counted
    assert vllm_drafts > 0
    assert scheduler.verified_before_eos["drafts"] == vllm_drafts
    assert scheduler.verified_before_eos["accepted"] == vllm_accepted
    # r0 accepts one draft at most: the second position's acceptance falls below the first's
    conditional = scripted.acceptance.conditional()
    assert 0 < conditional[1] < conditional[0] <= 1
