"""Prompt sources for GRPO: the procedural arithmetic task, or a GSM8K-format JSONL file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grpo_specdec.tasks.arithmetic import make_problem
from grpo_specdec.tasks.rewards import to_number


@dataclass(frozen=True)
class Example:
    question: str
    answer: float


class ArithmeticSource:
    """Endless seeded problems; the data cursor is the problem index."""

    def __init__(self, seed: int, levels: list[int]):
        self.seed, self.levels = seed, levels

    def get(self, index: int) -> Example:
        p = make_problem(self.seed, index, self.levels[index % len(self.levels)])
        return Example(p.question, float(p.answer))


class JsonlSource:
    """GSM8K format: one {"question": ..., "answer": "... #### N"} object per line. Cycles."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"dataset file {self.path} does not exist")
        self.examples = []
        for lineno, line in enumerate(self.path.read_text().splitlines(), 1):
            if line.strip():
                self.examples.append(self._parse(line, lineno))
        if not self.examples:
            raise ValueError(f"dataset file {self.path} holds no examples")

    def _parse(self, line: str, lineno: int) -> Example:
        where = f"{self.path} line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("question"), str)
            or not isinstance(row.get("answer"), str)
        ):
            raise ValueError(
                f"{where}: expected an object with string fields 'question' and 'answer'"
            )
        if "####" not in row["answer"]:
            raise ValueError(f"{where}: answer has no '#### N' final answer")
        value = to_number(row["answer"].rsplit("####", 1)[1])
        if value is None:
            raise ValueError(
                f"{where}: final answer {row['answer'].rsplit('####', 1)[1].strip()!r} is not a number"
            )
        return Example(row["question"], value)

    def get(self, index: int) -> Example:
        return self.examples[index % len(self.examples)]
