"""What a rollout's finish times say about its tail. Seer (arXiv 2511.14617) measured the
last 10% of requests to finish taking 26-58% of real rollouts' time; `tail_share` is that
figure. The shape itself (prompts, length budgets, seeds) is `tasks/length_budgets.py`.
"""

from __future__ import annotations

import math

import numpy as np


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


def tokens_after_eos(token_ids: list[list[int]], eos: int) -> int:
    """Tokens past each answer's first EOS: what a rollout with EOS ignored (to make equal
    work) makes that a real rollout never would."""
    return sum(len(ids) - ids.index(eos) - 1 for ids in token_ids if eos in ids)
