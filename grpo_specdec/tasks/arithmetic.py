"""Seeded arithmetic word problems with integer answers and worked solutions.

Level 1 is one addition or subtraction with small numbers; each level adds a step and
widens the numbers, and level 3 up brings in multiplication. The same (seed, index)
always gives the same problem, so a data cursor is just an integer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = [
    "Ana",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Goro",
    "Hana",
    "Ivan",
    "Jade",
    "Kofi",
    "Lena",
]
ITEMS = [
    "apples",
    "books",
    "coins",
    "marbles",
    "stickers",
    "pencils",
    "shells",
    "cards",
    "eggs",
    "stamps",
]
MAX_LEVEL = 4


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    solution: str  # worked steps ending in "The answer is N."


def _step(rng: random.Random, total: int, level: int, name: str, item: str) -> tuple[str, str, int]:
    """One operation on the running total: (sentence, worked equation, new total)."""
    # Subtract only while the total can stay positive; when it cannot, levels 1-2 add
    # (multiplication is for level 3 up).
    ops = ["add"] + (["sub"] if total > 1 else []) + (["mul"] if level >= 3 else [])
    op = rng.choice(ops)
    hi = 10 * level
    if op == "add":
        k = rng.randint(1, hi)
        return (
            rng.choice(
                [f"Then {name} gets {k} more {item}.", f"A friend gives {name} {k} {item}."]
            ),
            f"{total} + {k} = {total + k}",
            total + k,
        )
    if op == "sub":
        k = rng.randint(1, total - 1)
        return (
            rng.choice([f"Then {name} gives away {k} {item}.", f"{name} loses {k} {item}."]),
            f"{total} - {k} = {total - k}",
            total - k,
        )
    k = rng.randint(2, 4)
    return (
        f"Then the number of {item} is multiplied by {k}.",
        f"{total} * {k} = {total * k}",
        total * k,
    )


def make_problem(seed: int, index: int, level: int) -> Problem:
    if not 1 <= level <= MAX_LEVEL:
        raise ValueError(f"level must be between 1 and {MAX_LEVEL}, got {level}")
    rng = random.Random(f"{seed}:{index}:{level}")
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(2, 10 * level)
    sentences = [f"{name} has {total} {item}."]
    steps = []
    for _ in range(level):
        sentence, equation, total = _step(rng, total, level, name, item)
        sentences.append(sentence)
        steps.append(equation)
    sentences.append(f"How many {item} does {name} have now?")
    solution = ". ".join(steps) + f". The answer is {total}."
    return Problem(" ".join(sentences), total, solution)


def make_problems(n: int, seed: int = 0, level: int = 1, start: int = 0) -> list[Problem]:
    return [make_problem(seed, i, level) for i in range(start, start + n)]
