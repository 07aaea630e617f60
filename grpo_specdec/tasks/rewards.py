"""Rule rewards: is the final answer right, plus a small bonus for the answer format; and
DAPO's soft overlong punishment, a length term added to it.

Two graders, `reward.kind` in the job's config:
- "math_verify": Hugging Face's `math-verify` (LaTeX, `\\boxed{}`, fractions, sets, units,
  intervals, symbolic equality), what math RL recipes check answers with;
- "number": the final number of the response against a numeric ground truth, exact where
  both are plain numbers; a boxed answer that is not a plain number (`\\boxed{\\frac{1}{2}}`)
  is no number, never the digits inside it.
A ground truth is kept as the string the data gave, so either grader reads it as written.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Literal

RewardKind = Literal["math_verify", "number"]

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_IS = re.compile(r"answer is\s*:?\s*\$?\\?\(?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?|(?<![\w.])-?\.\d+")
_PLAIN_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def to_number(text: str) -> float | None:
    """A plain number (sign, thousands separators, decimals, a `$` around it), else None."""
    text = text.replace("$", "").strip()
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    return float(text.replace(",", ""))


def boxed(text: str) -> list[str]:
    """The contents of every \\boxed{...} in `text`, braces balanced (an unclosed one is
    left out)."""
    contents = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                contents.append(text[start:i])
                break
    return contents


def extract_answer(text: str) -> float | None:
    """The response's final answer as a number: what \\boxed{...} holds if the response boxes
    anything (None unless every box holds the same plain number), else the last
    "answer is N", else the last number in the text."""
    boxes = boxed(text)
    if boxes:
        values = {to_number(b) for b in boxes}
        return values.pop() if len(values) == 1 else None
    said = _ANSWER_IS.findall(text)
    if said:
        return to_number(said[-1])
    nums = _NUMBER.findall(text)
    return to_number(nums[-1]) if nums else None


def has_answer_format(text: str) -> bool:
    return bool(_BOXED.search(text) or _ANSWER_IS.search(text))


def number_is_correct(text: str, answer: str) -> bool:
    """Whether the response's final number equals the numeric ground truth `answer`."""
    truth = to_number(answer)
    if truth is None:
        raise ValueError(f"ground truth {answer!r} is not a plain number (reward.kind: number)")
    got = extract_answer(text)
    return got is not None and abs(got - truth) < 1e-6


def math_verify_is_correct(text: str, answer: str) -> bool:
    """Whether `math-verify` finds the response's answer equal to the ground truth `answer`
    (read as LaTeX math). Its time limits use SIGALRM, which only the main thread has:
    elsewhere they are off."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(
        answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=timeout
    )
    if not gold:
        raise ValueError(f"math-verify cannot read the ground truth {answer!r}")
    return verify(gold, parse(text, parsing_timeout=timeout), timeout_seconds=timeout)


GRADERS: dict[str, Callable[[str, str], bool]] = {
    "math_verify": math_verify_is_correct,
    "number": number_is_correct,
}


def check_ground_truth(answer: str, kind: RewardKind) -> str | None:
    """Why `kind` cannot grade against `answer` (None: it can), for data loaders to name the
    row at load time rather than fail mid-run."""
    if not answer.strip():
        return "the ground truth is empty"
    if kind == "number" and to_number(answer) is None:
        return f"ground truth {answer!r} is not a plain number (reward.kind: number)"
    return None


def reward(text: str, answer: str, kind: RewardKind = "number", format_bonus: float = 0.1) -> float:
    """1 for the right final answer, plus `format_bonus` when it is stated explicitly."""
    right = GRADERS[kind](text, answer)
    return float(right) + (format_bonus if has_answer_format(text) else 0.0)


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476), scaled by `penalty`: 0 up
    to `max_tokens - buffer` tokens, then falling linearly to -`penalty` at `max_tokens`
    (an answer cut off at the cap gets the full penalty), -`penalty` beyond. Added to the
    rule reward, it teaches a policy to stop before the cap without a cliff at it."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if not 1 <= buffer <= max_tokens:
        raise ValueError(f"buffer must lie in 1..max_tokens={max_tokens}, got {buffer}")
    if penalty < 0:
        raise ValueError(f"penalty must be non-negative, got {penalty}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    free = max_tokens - buffer
    if num_tokens <= free:
        return 0.0
    return -penalty * min(1.0, (num_tokens - free) / buffer)
