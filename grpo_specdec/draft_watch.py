"""After a draft swap, the new head's acceptance against the head it replaced.

The field's known silent failure is a draft that stops being accepted: after a sleep/wake
the draft's weights are gone (SGLang #31674, acceptance length ~1.0, rollouts 25% slower,
no error), or a sync leaves it broken (miles #1926, 2.71 -> 1.00). Speculation stays
lossless, so nothing else notices. The engine keeps the head it replaced; once the new one
has drafted MIN_DRAFT_TOKENS, a new head whose acceptance rate is, beyond sampling noise,
below COLLAPSE_RATIO of its predecessor's is replaced by that predecessor.

Why half: a head that learns online between rollouts moves acceptance by a few points (the
learning run's MAL moves by ~0.2 between iterations, docs/benchmarks/learning_run.md),
while one whose weights are lost or scrambled accepts next to nothing: halving is far from
the first and well short of the second. "Beyond noise": the new rate's upper bound, Z
binomial standard errors above it, must be below the line, so a few hundred drafts of a
sound head cannot trip it by chance.

Calls that ignore EOS are not counted: past the EOS a policy would have stopped at, a sound
head's drafts are accepted far less (in a `make demo` trial, 0.17 against 0.64 on the same
policy's rollouts, in the end-of-run comparison's equal-token rounds, which rolled that
head back).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpo_specdec.modelcheck import read_config

MIN_DRAFT_TOKENS = 100
COLLAPSE_RATIO = 0.5
Z = 3.0


@dataclass
class Head:
    """A head the engine served: its weights (as swapped in, or how to read them), version
    and metadata, and its drafts counted while it served."""

    weights: dict | Callable[[], dict]
    version: int
    metadata: dict | None
    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def measured(self) -> bool:
        return self.drafted >= MIN_DRAFT_TOKENS

    def state_dict(self) -> dict:
        return self.weights() if callable(self.weights) else self.weights


def starting_head(draft: str) -> Head:
    """The head an engine starts from, as the watch's first fallback: version 0 (until
    declared otherwise), its weights read from the folder only if it is ever needed."""
    from safetensors.torch import load_file

    def weights() -> dict:
        return {
            k: v for f in sorted(Path(draft).glob("*.safetensors")) for k, v in load_file(f).items()
        }

    cfg = read_config(draft, "draft")
    return Head(
        weights, 0, {"hidden_size": str(cfg["hidden_size"]), "vocab_size": str(cfg["vocab_size"])}
    )


@dataclass
class Rollback:
    """The engine went back from head `version` to head `to`."""

    version: int
    to: int
    rate: float
    previous_rate: float
    drafted: int

    def describe(self) -> str:
        return (
            f"draft head version {self.version} had {self.rate:.3f} of {self.drafted} drafts "
            f"accepted against version {self.to}'s {self.previous_rate:.3f}: the engine is back "
            f"on version {self.to}"
        )


class DraftWatch:
    def __init__(self, serving: Head):
        self.serving = serving  # the head the engine started with, then each swapped in
        self.fallback: Head | None = None  # a measured head the serving one is judged against

    def swapped(self, new: Head) -> None:
        """`new` now serves. The head it replaced becomes the fallback if it drafted enough
        to be judged by; else the fallback before it stays."""
        if self.serving.measured:
            self.fallback = self.serving
        self.serving = new

    def observe(self, drafted: int, accepted: int) -> Rollback | None:
        """Count the serving head's drafts; a Rollback when it has collapsed against the
        fallback (the caller swaps the fallback back in and calls `rolled_back`)."""
        head = self.serving
        head.drafted += drafted
        head.accepted += accepted
        fallback = self.fallback
        if fallback is None or not head.measured:
            return None
        n, rate = head.drafted, head.rate
        upper = rate + Z * math.sqrt(max(rate * (1 - rate), 1 / n) / n)
        if upper < COLLAPSE_RATIO * fallback.rate:
            return Rollback(head.version, fallback.version, rate, fallback.rate, n)
        self.fallback = None  # proven: judged no further
        return None

    def rolled_back(self) -> Head:
        """The fallback serves again; returns it."""
        head, self.serving, self.fallback = self.fallback, self.fallback, None
        return head


class SlowDecline:
    """A head that loses acceptance a little at a time never trips the collapse rule above,
    which compares each head with the one before it. This compares the acceptance at the
    first draft position (which the controller's choice of k does not change) over the last
    `window` rollouts with the best such window so far, and says so once when it has fallen
    below `ratio` of it (again only after it recovered). It says, it does not act: a policy
    that learns to answer differently lowers acceptance as surely as a worse head does."""

    def __init__(self, window: int = 3, ratio: float = 0.75):
        self.window, self.ratio = window, ratio
        self.recent: list[float] = []
        self.best: float | None = None
        self.alarmed = False

    def observe(self, first_position_rate: float) -> str | None:
        self.recent = [*self.recent, first_position_rate][-self.window :]
        if len(self.recent) < self.window:
            return None
        now = sum(self.recent) / self.window
        self.best = now if self.best is None else max(self.best, now)
        low = now < self.ratio * self.best
        said = low and not self.alarmed
        self.alarmed = low
        if not said:
            return None
        return (
            f"draft acceptance at the first position has fallen to {now:.3f} over the last "
            f"{self.window} rollouts, below {self.ratio:.0%} of its best ({self.best:.3f}): "
            "the head lags the policy, or the policy's answers changed"
        )
