"""The free k = 0 patch's engines under a fixed cycle of k per step
(`vllm_plugin/patches/features/free_k0_v0_32.py`): runs of k = 0 between drafting steps of several
lengths, whatever the batch. The shared engine is conftest's `free_k0_engine`."""

from __future__ import annotations

import json

import numpy as np

from grpo_specdec.engine import Engine
from tests.conftest import tiny_engine_config
from vllm_plugin.controller import HingeLatency, LatencyModel, LinearCost
from vllm_plugin.patches.features import free_k0_v0_32 as free_k0

# k per engine step, repeated: runs of k = 0 between drafting steps of several lengths.
K_CYCLE = [0, 0, 0, 3, 0, 0, 0, 0, 2, 4, 0]


class StepCycle:
    """A policy that ignores the batch and walks through K_CYCLE, one entry per step."""

    def __init__(self):
        self.step = 0

    def choose(self, batch_size: int, context: float | None = None, requests=()) -> int:
        self.step += 1
        return K_CYCLE[(self.step - 1) % len(K_CYCLE)]


def step_cycle_engine(target, draft, folder, draft_sampling, **overrides) -> Engine:
    latency = LatencyModel(HingeLatency(40.0, 4.0, 8.0), LinearCost(0.2, 0.01))
    profile = folder / "profile.json"
    profile.write_text(json.dumps({"latency": latency.to_dict()}))
    speculative = {
        "draft": draft,
        "k": 4,
        "draft_sampling": draft_sampling,
        "concurrency_aware": True,
        "controller": {"profile": str(profile)},
    }
    return Engine(tiny_engine_config(target, speculative=speculative, **overrides))


def kept_counts(engine) -> tuple[int, int]:
    def read(worker):
        kept = free_k0.kept_inputs(worker.model_runner.drafter)
        return kept.skipped_passes, kept.caught_up_positions

    return engine.llm.collective_rpc(read)[0]


def generate_under_the_step_cycle(engine, enabled: bool, prompts, sampling):
    """Generate with the patch on or off, under the step cycle; also the draft passes
    skipped and positions caught up during the call."""
    free_k0.ENABLED = enabled
    scheduler = engine.scheduler()
    scheduler.set_policy(StepCycle())
    engine.llm.reset_prefix_cache()
    before = np.array(kept_counts(engine))
    try:
        result = engine.generate(prompts, sampling)
    finally:
        free_k0.ENABLED = True
    return result, tuple(np.array(kept_counts(engine)) - before)
