"""Held-out evaluation: greedy accuracy with a 95% interval, and optionally mean@G (the
share of G samples at a temperature that are right), on a fixed set of problems the job
never trains on. `grpo-specdec eval` runs it on a model or checkpoint; the job runs it
before training and every `eval.every` iterations (on its own engines).

The arithmetic held-out split is the task's problems at another seed, less any question
that also stands among the first `TRAIN_QUESTIONS_CHECKED` training problems (the task's
small levels repeat questions by chance); a JSONL split is the user's file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from grpo_specdec.checkpoint_pointer import latest_checkpoint
from grpo_specdec.tasks.datasets import (
    NO_TEMPLATE,
    ArithmeticSource,
    Example,
    FileSource,
    PromptTemplate,
    file_kind,
)
from grpo_specdec.tasks.rewards import GRADERS, RewardKind, has_answer_format

EVAL_SEED_OFFSET = 1_000_003  # the held-out split's seed, from the training data's
TRAIN_QUESTIONS_CHECKED = 10_000  # ~40x what 60 minutes of the shipped recipe trains on


def arithmetic_eval_set(
    seed: int, levels: list[int], n: int, template: PromptTemplate = NO_TEMPLATE
) -> list[Example]:
    """`n` held-out arithmetic problems, the levels in turn; the same for the same args."""
    train = ArithmeticSource(seed, levels, template)
    seen = {train.get(i).question for i in range(TRAIN_QUESTIONS_CHECKED)}
    held_out = ArithmeticSource(seed + EVAL_SEED_OFFSET, levels, template)
    examples, index = [], 0
    while len(examples) < n:
        example = held_out.get(index)
        if example.question not in seen:
            examples.append(example)
        index += 1
    return examples


def file_eval_set(path: str | Path, kind: RewardKind, n: int | None = None) -> list[Example]:
    """The first `n` (all: None) problems of a data file in its format's default fields
    (`tasks/datasets.py`); errors name the file, row and field."""
    examples = FileSource(path, file_kind(path), reward_kind=kind).examples
    return examples if n is None else examples[:n]


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (sound at 0 and n, unlike p +- z*se)."""
    if n <= 0:
        raise ValueError("an interval needs at least one example")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def score(
    examples: list[Example],
    greedy: list[str],
    sampled: list[list[str]] | None,
    kind: RewardKind = "number",
) -> dict:
    """The report of one evaluation, graded by `kind` (`tasks/rewards.py`): greedy accuracy
    with its interval, the share of answers stated in the answer format, and mean@G when
    samples were drawn."""
    if len(greedy) != len(examples):
        raise ValueError(f"{len(greedy)} answers for {len(examples)} examples")
    is_correct = GRADERS[kind]
    right = [is_correct(t, e.answer) for t, e in zip(greedy, examples, strict=True)]
    low, high = wilson_interval(sum(right), len(right))
    report = {
        "examples": len(examples),
        "correct": sum(right),
        "accuracy": sum(right) / len(right),
        "interval": [low, high],
        "answer_format": sum(map(has_answer_format, greedy)) / len(greedy),
    }
    if sampled is not None:
        per_prompt = [
            sum(is_correct(t, e.answer) for t in texts) / len(texts)
            for texts, e in zip(sampled, examples, strict=True)
        ]
        report["mean_at_g"] = sum(per_prompt) / len(per_prompt)
        report["samples"] = len(sampled[0])
    return report


# generate(prompts, sampling settings as a dict) -> [prompt][sample] texts
Generate = Callable[[list[str], dict], list[list[str]]]


def evaluate(
    generate: Generate,
    examples: list[Example],
    max_tokens: int,
    samples: int = 0,
    temperature: float = 1.0,
    kind: RewardKind = "number",
) -> dict:
    """Greedy answers to every example (and `samples` more at `temperature` each), scored
    by `kind`."""
    prompts = [e.question for e in examples]
    greedy = generate(prompts, {"n": 1, "temperature": 0.0, "max_tokens": max_tokens})
    sampled = None
    if samples:
        sampled = generate(
            prompts, {"n": samples, "temperature": temperature, "max_tokens": max_tokens}
        )
    report = score(examples, [texts[0] for texts in greedy], sampled, kind)
    report["max_tokens"] = max_tokens
    return report


def policy_folder(path: str) -> str:
    """The policy weights a path names: a model folder, a checkpoint (its policy/), or a
    run (its latest checkpoint's policy/); a folder without weights is an error."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"--model {path}: no such folder")
    if (folder / "checkpoints").is_dir():
        ckpt = latest_checkpoint(folder / "checkpoints")
        if ckpt is None:
            raise FileNotFoundError(f"--model {path}: a run folder with no checkpoint yet")
        folder = ckpt
    if (folder / "policy").is_dir():
        folder = folder / "policy"
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(
            f"--model {path}: {folder} holds no weights (*.safetensors); expected a model "
            "folder, a checkpoint (with policy/) or a run folder (with checkpoints/)"
        )
    return str(folder)


def report_line(report: dict, label: str = "held-out") -> str:
    low, high = report["interval"]
    line = (
        f"{label} greedy accuracy {report['accuracy']:.3f} [{low:.3f}, {high:.3f}] "
        f"({report['correct']}/{report['examples']})"
    )
    if "mean_at_g" in report:
        line += f", mean@{report['samples']} {report['mean_at_g']:.3f}"
    return line
