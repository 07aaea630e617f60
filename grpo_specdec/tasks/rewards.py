"""Rule-based reward: is the final number right, plus a small bonus for the answer format."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer is\s*:?\s*\$?\\?\(?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?|(?<![\w.])-?\.\d+")


def to_number(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def extract_answer(text: str) -> float | None:
    """The response's final answer: \\boxed{...} if present, else "answer is N", else the
    last number in the text. Thousands separators, signs and decimals are handled."""
    for pattern in (_BOXED, _ANSWER_IS):
        hits = pattern.findall(text)
        for hit in reversed(hits):
            nums = _NUMBER.findall(hit)
            if nums and (value := to_number(nums[-1])) is not None:
                return value
    nums = _NUMBER.findall(text)
    return to_number(nums[-1]) if nums else None


def has_answer_format(text: str) -> bool:
    return bool(_BOXED.search(text) or _ANSWER_IS.search(text))


def reward(text: str, answer: float, format_bonus: float = 0.1) -> float:
    """1 for the right final number, plus `format_bonus` when it is stated explicitly."""
    got = extract_answer(text)
    correct = got is not None and abs(got - answer) < 1e-6
    return float(correct) + (format_bonus if has_answer_format(text) else 0.0)
