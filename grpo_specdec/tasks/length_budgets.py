"""A GRPO rollout shape with the tail real rollouts have.

The shape: P arithmetic word problems of mixed difficulty (levels 1..4 in turn) x G samples,
T = 1, one global token cap well above the typical answer, each sample its own request. A
policy that has not learnt to stop (SmolLM2-135M-Instruct as shipped: about a quarter of its
T = 1 answers never reach EOS) would fill the cap, so each request also gets its own length
budget, a seeded log-normal draw, as its max_tokens: a stand-in for a policy trained to stop
(e.g. with DAPO's overlong penalty, `tasks.rewards.overlong_penalty`). An answer ends at EOS,
at its budget, or at the global cap.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

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
