"""Rule-based reward: is the final number right, plus a small bonus for the answer format;
and DAPO's soft overlong punishment, a length term to add to it."""

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


def is_correct(text: str, answer: float) -> bool:
    """Whether the response's final answer is the right number."""
    got = extract_answer(text)
    return got is not None and abs(got - answer) < 1e-6


def reward(text: str, answer: float, format_bonus: float = 0.1) -> float:
    """1 for the right final number, plus `format_bonus` when it is stated explicitly."""
    return float(is_correct(text, answer)) + (format_bonus if has_answer_format(text) else 0.0)


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
