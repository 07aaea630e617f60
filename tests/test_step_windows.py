"""Runs measured from the scheduler's step trace stay right once that bounded trace is
full, and each benchmarked configuration runs from its own state (no vLLM engine)."""

from __future__ import annotations

from collections import Counter, deque
from types import SimpleNamespace

from benchmarks.rollout_throughput import Config, run_config
from grpo_specdec.profile import _time_steps
from vllm_plugin.acceptance import AcceptanceEstimator
from vllm_plugin.controller import FixedPolicy
from vllm_plugin.goodput_controller import GoodputController
from vllm_plugin.scheduler import ConcurrencyAwareMixin


class FakeScheduler(ConcurrencyAwareMixin):
    """The plugin's bookkeeping over a trace that is already full."""

    def __init__(self, trace_steps: int = 8):
        self.step_trace = deque([(0.0, 0, 0, False)] * trace_steps, maxlen=trace_steps)
        self.steps_scheduled = 1000
        self.running = []  # vLLM's running requests: none here
        self.verified_before_eos = Counter()
        self.sampling_fix_missing = False  # as on a CPU engine with the plugin's fixes
        self.set_policy(FixedPolicy(0))


class FakeEngine:
    """Generates in decode-only steps of 2 ms, one record per step, drafting k from the
    scheduler's policy; one accepted draft token per step feeds the scheduler's controller."""

    def __init__(self):
        self.sched = FakeScheduler()
        self.prefix_cache_resets = 0
        self.llm = SimpleNamespace(reset_prefix_cache=self._reset)
        self.tokenizer = SimpleNamespace(eos_token_id=2)
        self.clock = 0.0

    def _reset(self):
        self.prefix_cache_resets += 1

    def scheduler(self):
        return self.sched

    def generate(self, prompts, sampling, **per_request):
        batch, k = len(prompts), self.sched.dynamic_sd_lookup[len(prompts)]
        for _ in range(5):
            self.clock += 0.002
            self.sched.step_trace.append((self.clock, batch, k, True))
            self.sched.steps_scheduled += 1
            if k and self.sched.controller is not None:
                self.sched.controller.drafts_verified(None, k, 1)
        return SimpleNamespace(
            wall_s=0.01,
            num_generated_tokens=5,
            spec={"mean_acceptance_length": 2.0},
            scheduled_s=[0.0] * batch,
            finished_s=[0.01] * batch,
            outputs=[[SimpleNamespace(token_ids=[1] * 5)] for _ in prompts],
        )


def test_profile_times_the_steps_of_its_run_in_a_full_trace():
    engine = FakeEngine()
    ms, prefill_ms = _time_steps(engine, ["q"] * 3, batch=3, k=2, steps=16)
    assert len(ms) == 4 and all(abs(m - 2.0) < 1e-6 for m in ms)
    assert prefill_ms == 0.0  # its first step already decodes: no prefill step
    assert engine.prefix_cache_resets == 1  # the next run prefills in full again
    engine.sched.step_trace = deque(maxlen=3)  # a trace too short to hold the run's start
    assert _time_steps(engine, ["q"] * 3, batch=3, k=2, steps=16)[1] is None


def test_benchmark_configurations_keep_their_own_state():
    engine = FakeEngine()
    made = []

    def fresh():
        made.append(GoodputController(None, AcceptanceEstimator(4), 8))
        return made[-1]

    out = run_config(Config(engine, FixedPolicy(3)), ["q"] * 2, None)
    assert [(b, k) for _, b, k in out["trace"]] == [(2, 3)] * 5  # this run's steps only
    run_config(Config(engine, fresh), ["q"] * 2, None)
    run_config(Config(engine, fresh), ["q"] * 2, None)
    # each run of ours starts from a controller of its own, fed only by that run
    assert len(made) == 2 and made[0] is not made[1]
    assert engine.sched.policy is made[1] and made[0].steps == made[1].steps == 1
    run_config(Config(engine), ["q"], None)  # the plain engine's runs start clean as well
    assert engine.prefix_cache_resets == 4
