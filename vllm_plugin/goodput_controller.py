"""The goodput controller: each step, the k with the most tokens per millisecond for the
requests running now, priced on what this engine has measured; plain Python, driven by
the scheduler (vllm_plugin/scheduler.py) and by the simulator's regime suite alike.

    k* = argmax_k  E_running[tokens | k] / step_ms(B, k, c)

E_running is the running requests' own acceptance shrunk toward the pool's, the pool's
first position at an upper confidence bound (`AcceptanceEstimator.running_tokens`,
`optimistic_conditional`); step_ms the profile corrected by the engine's timed steps
(`StepCosts`).

Evidence only comes from what is drafted, and nothing fades with time alone, so a k one
token deeper than k* is probed when the controller has not run it for `probe_interval`
steps (or, with no profile, has not timed it near this B), on a budget: each step earns
`explore_share` of its own predicted time, and the probe runs when the earned credit
covers what it is predicted to lose (its time beyond k*'s for the same tokens, at the
point estimate). So probing costs at most `explore_share` of modelled throughput, and
where drafting never pays (an untrained head at T = 1) the controller loses no more than
that. A restart (a weight swap, a new wave) makes every k due for a probe. With no
profile, until a k has been timed `LEARNING_STEPS` times its probes may spend
`LEARNING_SHARE` (10%): the first rollout is where such an engine learns its prices.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_plugin.acceptance import AcceptanceEstimator
from vllm_plugin.controller import LatencyModel
from vllm_plugin.step_costs import StepCosts


class GoodputController:
    LEARNING_SHARE, LEARNING_STEPS = 0.1, 8.0

    def __init__(
        self,
        latency: LatencyModel | None,
        acceptance: AcceptanceEstimator,
        max_batch: int,
        explore_share: float = 0.01,
        probe_interval: int = 32,
        credit_steps: float = 200.0,
        learn_costs: bool = True,
    ):
        self.acceptance, self.max_batch = acceptance, max_batch
        self.k_max = acceptance.k_max
        self.costs = StepCosts(latency, self.k_max, max_batch)
        self.learn_costs = learn_costs
        self.explore_share, self.probe_interval = explore_share, probe_interval
        self.credit_steps = credit_steps
        self.credit_ms = 0.0
        self.probes = 0
        self.steps = 0
        # The step at which each k (or a deeper one) last ran: position k - 1 was tried.
        self.drafted_at = np.full(self.k_max + 1, -probe_interval)

    def best(
        self, batch_size: int, context: float | None = None, requests: Sequence[str] = ()
    ) -> tuple[int, np.ndarray]:
        """(k*, the predicted ms of a step at each k) for the requests running now."""
        ms = self.costs.step_ms(min(max(batch_size, 1), self.max_batch), context)
        return int(np.argmax(self.acceptance.running_tokens(requests) / ms)), ms

    def choose(
        self, batch_size: int, context: float | None = None, requests: Sequence[str] = ()
    ) -> int:
        batch = min(max(batch_size, 1), self.max_batch)
        best, ms = self.best(batch, context, requests)
        share = self.explore_share
        if not self.costs.profiled and best < self.k_max:
            # With no profile the first steps at each k are how its price is learnt.
            if self.costs.measured(best + 1) < self.LEARNING_STEPS:
                share = max(share, self.LEARNING_SHARE)
        self.credit_ms = min(
            self.credit_ms + share * ms[best], share * self.credit_steps * ms[best]
        )
        self.steps += 1
        k = best
        probe = best + 1
        if probe <= self.k_max and self._due(probe, batch):
            point = self.acceptance.running_tokens(requests, optimistic=False)
            loss = max(ms[probe] - ms[best] * point[probe] / point[best], 0.0)
            if loss <= self.credit_ms:
                self.credit_ms -= loss
                self.probes += 1
                k = probe
        self.drafted_at[: k + 1] = self.steps
        return k

    def _due(self, k: int, batch: int) -> bool:
        stale = self.steps - self.drafted_at[k] >= self.probe_interval
        return stale or (not self.costs.profiled and self.costs.measured(k, batch) < 2.0)

    # What the engine reports back.
    def drafts_verified(
        self, request_id: str | None, drafted: int, accepted: int, before_eos: bool = True
    ) -> None:
        self.acceptance.observe(drafted, accepted, request_id, before_eos)

    def step_timed(self, batch: int, k: int, context: float | None, ms: float) -> None:
        if self.learn_costs:
            self.costs.observe(batch, k, context, ms)

    def restart(self) -> None:
        """The weights changed or a new wave of requests began: the pool's evidence becomes
        a prior; the costs are the machine's and stay, moved by what this wave's steps show
        (`StepCosts.new_wave`)."""
        self.acceptance.restart()
        self.costs.new_wave()
        self.drafted_at[:] = self.steps - self.probe_interval

    def forget(self, running: Sequence[str]) -> None:
        """Drop the evidence of requests no longer running."""
        self.acceptance.forget(running)
