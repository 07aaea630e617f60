"""What a step costs, learnt from the engine's own steps. Plain Python, testable without vLLM.

A profile (`grpo-specdec profile`) is timed once, greedy, on one machine state; the engine
then samples at T = 0.7-1, shares the machine, and runs checkpoints the profile never saw.
So the scheduler times each decode step (from its scheduling, or from the previous
step's output if later, to its own output) and `StepCosts` corrects the profile's latency
model where the engine runs, in log space, per k and per range of B (b = floor(log2 B)):

    log ms(B, k, c) = log base(B, k, c) + correction[k, b]

A cell's correction is the mean log-ratio of its recent steps (about `memory` of them),
shrunk with `shrink` steps' weight toward what its neighbours say: k = 0 toward k = 0's
mean over every range of B (what the machine does to every step: it is busier, the model
another), and that toward the profile; a k > 0 toward the correction of k - 1 at the same
B plus what one more draft token adds to it over every B, and that toward nothing (one
more token costs as the profile says, or, with no profile, as much as each token before
it). So a k timed at a few B is priced at every B, an untimed k like the one below it,
and a cell with one noisy step moves little; once a cell holds `settled` steps, one more moves it by at most a factor
e^`clip` from what it holds: a step timed while something else ran on the machine, or
around a weight swap, is one bounded nudge, not a new price. Prices never fall with k (a
step that drafts more does not cost less).

With no profile the base is `UNPROFILED`, one unit per token, and an untimed k at B is
priced as the k = 0 steps of B (k + 1) sequences were timed (the target's forward over
as many tokens; the nearest B timed where that one was not): the k = 0 steps a rollout
makes as its batch drains chart the roofline, and the controller's probes add what
drafting itself costs. Before any step is timed no draft short of certain acceptance
pays, so the engine starts at k = 0.

The machine itself changes between waves of requests (rollouts): an engine's first rollout
runs every step 1.7-1.9x slower than its later ones (measured on the EPYC without
bfloat16, k = 0 at every B; caches and memory cold). A cell the controller stopped timing
there (k = 0 at the B where it then drafted) kept that price, and drafting looked cheap
against it for good. So each wave (`new_wave`) measures its `shift`: how much its steps
cost over what the same cells cost before it (the mean log-change over the cells timed
both before and in this wave, weighted by this wave's steps and shrunk with
`shrink_shift` steps' weight toward none), and a cell not yet timed in this wave is priced
as it was plus that shift (and keeps it when it is).
"""

from __future__ import annotations

import math

import numpy as np

from vllm_plugin.controller import NO_COST, HingeLatency, LatencyModel

UNPROFILED = LatencyModel(HingeLatency(flat=0.0, slope=1.0, knee=0.0), NO_COST)


def bucket(batch: int) -> int:
    return int(math.log2(max(int(batch), 1)))


class StepCosts:
    def __init__(
        self,
        base: LatencyModel | None,
        k_max: int,
        max_batch: int,
        memory: float = 32.0,
        shrink: float | None = None,
        clip: float = 0.5,
        settled: float = 2.0,
        shrink_shift: float = 8.0,
    ):
        self.base = base or UNPROFILED
        self.profiled = base is not None
        # A profile is a prior worth 8 steps a cell; the compute-bound guess, one.
        self.shrink = shrink if shrink is not None else (8.0 if self.profiled else 1.0)
        self.k_max, self.memory = k_max, memory
        self.clip, self.settled, self.shrink_shift = clip, settled, shrink_shift
        buckets = bucket(max_batch) + 1
        # [k, b] faded sums of log-ratios (measured over base) and their weights.
        self.sums = np.zeros((k_max + 1, buckets))
        self.weights = np.zeros((k_max + 1, buckets))
        self._ks = np.arange(k_max + 1, dtype=float)
        # This wave's own steps per cell (log-ratio sums, counts) and each cell's mean
        # before the wave began (nan: not timed before it, or not yet in it).
        self.wave_sums = np.zeros_like(self.sums)
        self.wave_weights = np.zeros_like(self.sums)
        self.before_wave = np.full_like(self.sums, np.nan)

    def new_wave(self) -> None:
        """A new wave of requests (or weights) begins: its steps say anew what the machine does."""
        self.wave_sums[:] = 0.0
        self.wave_weights[:] = 0.0
        self.before_wave[:] = np.nan

    def shift(self) -> float:
        """What this wave's steps cost over what the same cells cost before it (log)."""
        both = (self.wave_weights > 0) & ~np.isnan(self.before_wave)
        if not both.any():
            return 0.0
        change = self.wave_sums[both] / self.wave_weights[both] - self.before_wave[both]
        weights = self.wave_weights[both]
        return float((change * weights).sum() / (weights.sum() + self.shrink_shift))

    def _bucket(self, batch: int) -> int:
        return min(bucket(batch), self.sums.shape[1] - 1)

    def measured(self, k: int, batch: int | None = None) -> float:
        """Steps' weight behind the price of k at `batch` (None: at every B)."""
        if batch is None:
            return float(self.weights[k].sum())
        return float(self.weights[k, self._bucket(batch)])

    def corrections(self, batch: int) -> np.ndarray:
        """correction[k, b] for every k at `batch`."""
        shrink, weights = self.shrink, self.weights
        # A cell not timed this wave moves as the cells timed both before and in it did.
        sums = self.sums + self.shift() * weights * (self.wave_weights == 0)
        b = self._bucket(batch)
        per_k = np.zeros(self.k_max + 1)  # k's mean over every range of B
        cell = np.zeros(self.k_max + 1)
        for k in range(self.k_max + 1):
            below = per_k[k - 1] if k else 0.0
            per_k[k] = (sums[k].sum() + shrink * below) / (weights[k].sum() + shrink)
            if self.profiled:
                toward = per_k[0] if k == 0 else cell[k - 1] + per_k[k] - per_k[k - 1]
            else:
                toward = self._k0_at(sums, batch * (k + 1), per_k[0])
            cell[k] = (sums[k, b] + shrink * toward) / (weights[k, b] + shrink)
        return cell

    def _k0_at(self, sums: np.ndarray, tokens: int, default: float) -> float:
        """With no profile (a base of one unit per token), what a token costs in a k = 0
        step of `tokens` sequences: as timed in that range of B, else interpolated in
        log2 B between the nearest ranges timed below and above it (beyond them, the
        nearest one's). A step that verifies B (k + 1) tokens costs about what one of
        B (k + 1) sequences does. What a unit costs falls steeply with B where steps are
        memory-bound, so one range's price is no guide to another's far from it: their
        mean over every B (the profiled prior) priced the k = 0 steps of B = 64, never
        timed again once drafting paid, at five times what they cost."""
        timed = np.flatnonzero(self.weights[0] > 0)
        if not len(timed):
            return default
        at = min(math.log2(max(tokens, 1)), float(self.sums.shape[1] - 1))
        means = sums[0, timed] / self.weights[0, timed]
        return float(np.interp(at, timed.astype(float), means))

    def step_ms(self, batch: int, context: float | None = None) -> np.ndarray:
        """The predicted ms of a step at `batch` for every k = 0..k_max."""
        base = np.asarray(self.base.step_ms(batch, self._ks, context), dtype=float)
        return np.maximum.accumulate(base * np.exp(self.corrections(batch)))

    def observe(self, batch: int, k: int, context: float | None, ms: float) -> None:
        """One decode step that ran `batch` sequences at `k`, timed at `ms`."""
        if ms <= 0 or not 0 <= k <= self.k_max:
            return
        b = self._bucket(batch)
        held = float(self.corrections(batch)[k])
        ratio = math.log(ms / float(self.base.step_ms(batch, k, context)))
        if self.weights[k, b] >= self.settled:
            ratio = min(max(ratio, held - self.clip), held + self.clip)
        if self.wave_weights[k, b] == 0 and self.weights[k, b] > 0:
            self.before_wave[k, b] = self.sums[k, b] / self.weights[k, b]
            self.sums[k, b] += self.shift() * self.weights[k, b]  # as priced until now
        self.wave_sums[k, b] += ratio
        self.wave_weights[k, b] += 1.0
        fade = 1.0 - 1.0 / self.memory
        self.sums[k, b] = fade * self.sums[k, b] + ratio
        self.weights[k, b] = fade * self.weights[k, b] + 1.0
