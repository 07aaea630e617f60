"""Prompt sources for GRPO: the procedural arithmetic task, or the user's problems from a
JSONL file (GSM8K's layout by default), a parquet file (verl's layout by default) or a
Hugging Face `datasets` dataset on local disk.

Every row becomes an `Example`: a prompt (a plain question, or chat turns) and the ground
truth as the data wrote it. A bad row fails at load time with its file, row and field named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from grpo_specdec.tasks.arithmetic import make_problem
from grpo_specdec.tasks.rewards import RewardKind, check_ground_truth

FileKind = Literal["jsonl", "parquet", "datasets"]
# Where the question and the ground truth stand in a row, per source (dotted for nesting):
# GSM8K's JSONL, verl's parquet (`prompt` as chat turns, `reward_model.ground_truth`), and a
# `datasets` folder in GSM8K's layout (as its hub copy is).
DEFAULT_FIELDS: dict[str, tuple[str, str]] = {
    "jsonl": ("question", "answer"),
    "parquet": ("prompt", "reward_model.ground_truth"),
    "datasets": ("question", "answer"),
}
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatPrompt:
    """A prompt given as chat turns, (role, content) each, for the model's chat template."""

    turns: tuple[tuple[str, str], ...]

    def messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.turns]

    def __str__(self) -> str:  # logs, and models without a chat template
        return "\n\n".join(c for _, c in self.turns)


Prompt = str | ChatPrompt


@dataclass(frozen=True)
class Example:
    question: Prompt
    answer: str  # the ground truth, as the data wrote it (graded by tasks/rewards.py)


@dataclass(frozen=True)
class PromptTemplate:
    """A system prompt and an instruction appended to the (last) user turn, applied to every
    example of a source; a row's own system turn wins over `system`."""

    system: str | None = None
    instruction: str | None = None

    def apply(self, question: Prompt) -> Prompt:
        if not self.system and not self.instruction:
            return question
        turns = list(question.turns if isinstance(question, ChatPrompt) else [("user", question)])
        if self.instruction:
            last = max(i for i, (role, _) in enumerate(turns) if role == "user")
            turns[last] = ("user", f"{turns[last][1]}{self.instruction}")
        if self.system and turns[0][0] != "system":
            turns.insert(0, ("system", self.system))
        return ChatPrompt(tuple(turns))


NO_TEMPLATE = PromptTemplate()


class ArithmeticSource:
    """Endless seeded problems; the data cursor is the problem index."""

    def __init__(self, seed: int, levels: list[int], template: PromptTemplate = NO_TEMPLATE):
        self.seed, self.levels, self.template = seed, levels, template

    def get(self, index: int) -> Example:
        p = make_problem(self.seed, index, self.levels[index % len(self.levels)])
        return Example(self.template.apply(p.question), str(p.answer))


class FileSource:
    """The examples of a data file, in order; cycles."""

    def __init__(
        self,
        path: str | Path,
        source: FileKind = "jsonl",
        question_field: str | None = None,
        answer_field: str | None = None,
        reward_kind: RewardKind = "math_verify",
        template: PromptTemplate = NO_TEMPLATE,
    ):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"dataset file {self.path} does not exist")
        fields = DEFAULT_FIELDS[source]
        self.question_field = question_field or fields[0]
        self.answer_field = answer_field or fields[1]
        self.reward_kind, self.template = reward_kind, template
        rows = _jsonl_rows(self.path) if source == "jsonl" else _table_rows(self.path, source)
        self.examples = [self._example(row, where) for where, row in rows]
        if not self.examples:
            raise ValueError(f"dataset file {self.path} holds no examples")

    def _example(self, row: Any, where: str) -> Example:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        question = _prompt(_field(row, self.question_field, where), where, self.question_field)
        answer = _field(row, self.answer_field, where)
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(
                f"{where}: field '{self.answer_field}' must be a string or a number, got "
                f"{type(answer).__name__}"
            )
        answer = str(answer)
        if "####" in answer:  # GSM8K: the worked solution, then '#### N'
            answer = answer.rsplit("####", 1)[1].strip()
        why = check_ground_truth(answer, self.reward_kind)
        if why:
            raise ValueError(f"{where}: field '{self.answer_field}': {why}")
        return Example(self.template.apply(question), answer)

    def get(self, index: int) -> Example:
        return self.examples[index % len(self.examples)]


def file_kind(path: str | Path) -> FileKind:
    """A data file's format by its name: a folder is a `datasets` one (save_to_disk)."""
    path = Path(path)
    if path.is_dir():
        return "datasets"
    return "parquet" if path.suffix == ".parquet" else "jsonl"


def _jsonl_rows(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{path} line {line}: not UTF-8 (byte {err.object[err.start]:#04x} at offset "
            f"{err.start}); JSON Lines files are UTF-8"
        ) from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg})") from None


def _table_rows(path: Path, source: FileKind):
    """Rows through Hugging Face `datasets`: a parquet file, or a dataset folder saved with
    `save_to_disk` (its one split, or its 'train' split)."""
    import datasets

    if source == "parquet":
        table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    else:
        table = datasets.load_from_disk(str(path))
        if isinstance(table, datasets.DatasetDict):
            if "train" not in table and len(table) != 1:
                raise ValueError(f"{path}: splits {sorted(table)}; expected 'train' or one split")
            table = table["train"] if "train" in table else next(iter(table.values()))
    for i, row in enumerate(table):
        yield f"{path} row {i}", row


def _field(row: dict, dotted: str, where: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{where}: no field '{dotted}'")
        value = value[part]
    return value


def _prompt(value: Any, where: str, field: str) -> Prompt:
    """A question string, or chat turns ([{role, content}, ...], verl's `prompt`)."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value:
        turns = []
        for i, turn in enumerate(value):
            role = turn.get("role") if isinstance(turn, dict) else None
            content = turn.get("content") if isinstance(turn, dict) else None
            if role not in ROLES or not isinstance(content, str):
                raise ValueError(
                    f"{where}: field '{field}' turn {i}: expected {{'role': one of {ROLES}, "
                    "'content': a string}"
                )
            turns.append((role, content))
        if not any(role == "user" for role, _ in turns):
            raise ValueError(f"{where}: field '{field}' has no user turn")
        return ChatPrompt(tuple(turns))
    raise ValueError(f"{where}: field '{field}' must be a non-empty string or a list of chat turns")
