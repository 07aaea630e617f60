"""A GRPO rollout shape with the tail real rollouts have, and what finish times say about it.

The shape: P arithmetic word problems of mixed difficulty (levels 1..4 in turn) x G samples,
T = 1, one global token cap well above the typical answer, each sample its own request. A
policy that has not learnt to stop (SmolLM2-135M-Instruct as shipped: about a quarter of its
T = 1 answers never reach EOS) would fill the cap, so each request also gets its own length
budget, a seeded log-normal draw, as its max_tokens: a stand-in for a policy trained to stop
(e.g. with DAPO's overlong penalty, `tasks.rewards.overlong_penalty`). An answer ends at EOS,
at its budget, or at the global cap. Seer (arXiv 2511.14617) measured the last 10% of
requests to finish taking 26-58% of real rollouts' time; `tail_share` is that figure.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from grpo_specdec.tasks.arithmetic import MAX_LEVEL
from grpo_specdec.tasks.datasets import ArithmeticSource


@dataclass(frozen=True)
class TailShape:
    """One rollout: request i answers prompts[i // group] within max_tokens[i] tokens,
    sampling from seeds[i]."""

    questions: list[str]
    group: int
    cap: int
    max_tokens: list[int]
    seeds: list[int]

    @property
    def prompts(self) -> list[str]:
        return [q for q in self.questions for _ in range(self.group)]


def tail_shape(
    num_prompts: int = 8,
    group: int = 8,
    cap: int = 1024,
    budget_median: int = 256,
    budget_sigma: float = 0.7,
    seed: int = 0,
) -> TailShape:
    """The shape: the same (arguments) always give the same prompts, budgets and seeds."""
    source = ArithmeticSource(seed, list(range(1, MAX_LEVEL + 1)))
    questions = [source.get(i).question for i in range(num_prompts)]
    return with_budgets(questions, group, cap, budget_median, budget_sigma, seed)


def with_budgets(
    questions: list[str],
    group: int,
    cap: int,
    budget_median: int,
    budget_sigma: float,
    seed: int = 0,
) -> TailShape:
    """`questions` x `group` requests, each with its own seeded log-normal length budget
    (at least 16 tokens, at most `cap`) and sampling seed."""
    if budget_median < 1 or budget_median > cap:
        raise ValueError(f"budget_median must lie in 1..cap={cap}, got {budget_median}")
    if budget_sigma < 0:
        raise ValueError(f"budget_sigma must be non-negative, got {budget_sigma}")
    rng = random.Random(f"tail-shape:{seed}")
    n = len(questions) * group
    budgets = [
        min(cap, max(16, round(budget_median * math.exp(rng.gauss(0.0, budget_sigma)))))
        for _ in range(n)
    ]
    seeds = [rng.randrange(1 << 31) for _ in range(n)]
    return TailShape(list(questions), group, cap, budgets, seeds)


def tail_phase_s(ends: list[float], fraction: float = 0.1) -> float:
    """Seconds from the moment all but the last `fraction` of requests had finished to
    the last finish."""
    if not ends:
        raise ValueError("needs at least one finish time")
    done = sorted(ends)
    return done[-1] - done[math.ceil((1 - fraction) * len(done)) - 1]


def tail_share(ends: list[float], fraction: float = 0.1) -> float:
    """Share of the makespan after all but the last `fraction` of requests had finished:
    (makespan - time at which 1 - fraction of them had) / makespan."""
    makespan = max(ends, default=0.0)
    return tail_phase_s(ends, fraction) / makespan if makespan > 0 else 0.0


def in_flight(starts: list[float], ends: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """B over time as a step function: B = counts[i] from times[i] to times[i + 1] (the
    last count, 0, holds after the last request finished)."""
    events = sorted([(t, 1) for t in starts] + [(t, -1) for t in ends])
    times = np.array([t for t, _ in events])
    counts = np.cumsum([d for _, d in events])
    last = np.r_[times[1:] != times[:-1], True]  # several events at one instant: the last
    return times[last], counts[last]


def share_of_time_at_most(times: np.ndarray, counts: np.ndarray, b: int) -> float:
    """Share of the time from the first start to the last finish spent with 1..b in flight."""
    dt = np.diff(times)
    held = counts[:-1]
    return float(dt[(held >= 1) & (held <= b)].sum() / dt.sum())


def tokens_after_eos(token_ids: list[list[int]], eos: int) -> int:
    """Tokens past each answer's first EOS: what a rollout with EOS ignored (to make equal
    work) makes that a real rollout never would."""
    return sum(len(ids) - ids.index(eos) - 1 for ids in token_ids if eos in ids)
