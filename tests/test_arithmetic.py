"""The arithmetic task's levels: step count, operations per level, and worked solutions."""

from __future__ import annotations

import re

import pytest

from grpo_specdec.tasks.arithmetic import MAX_LEVEL, make_problems

EQUATION = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


def _equations(solution: str) -> list[tuple[int, str, int, int]]:
    return [(int(a), op, int(b), int(c)) for a, op, b, c in EQUATION.findall(solution)]


@pytest.mark.parametrize("level", range(1, MAX_LEVEL + 1))
def test_levels_take_one_step_per_level_with_the_operations_they_allow(level):
    ops_seen = set()
    for seed in range(40):
        for p in make_problems(100, seed=seed, level=level):
            steps = _equations(p.solution)
            assert len(steps) == level, p.solution
            for a, op, b, c in steps:
                assert c == {"+": a + b, "-": a - b, "*": a * b}[op], p.solution
                assert c > 0, p.solution
            assert steps[-1][3] == p.answer
            assert p.solution.endswith(f"The answer is {p.answer}.")
            ops_seen |= {op for _, op, _, _ in steps}
    assert ops_seen == ({"+", "-", "*"} if level >= 3 else {"+", "-"})
