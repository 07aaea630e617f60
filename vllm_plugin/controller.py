"""How many tokens to draft this step: plain Python, testable without vLLM.

Goodput of drafting k tokens at live concurrency B (tokens per millisecond):

    G(B, k) = B * E[tokens per step | k] / step(B, k, c)
    step(B, k, c) = T(B (k + 1)) + [k > 0] S(B) + k D(B)
                    + (a_s B + a_q B (k + 1)) max(c - c_0, 0)

T(n) is the step latency with n tokens in the target forward (a roofline: flat while
memory-bound, linear past the knee C_peak), S(B) what a step pays for speculating at all
(verification by rejection sampling, the draft's metadata; a step with k = 0 pays none
of it), D(B) the cost of one draft step over B sequences, and attention beyond c_0, the
context T, S and D were timed at, in two parts per token of context: a_s per sequence
(decode attention is memory-bound: the k + 1 queries of one sequence share one read of
its KV cache) and a_q per query token (the compute that does grow with k). c is the
running requests' mean context; late in a rollout, where the tail runs, it is long. And
E[tokens | k] = 1 + sum_{i<k} prod_{j<=i} p_j with p_j the measured conditional
acceptance at draft position j, which the goodput policy takes at an upper
confidence bound of its estimate (`AcceptanceEstimator`) and picks the k with the largest
G; the paper's rule and a fixed k sit behind the same interface.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import numpy as np

from vllm_plugin.acceptance import AcceptanceEstimator


@dataclass(frozen=True)
class HingeLatency:
    """T(n) = flat + slope * max(n - knee, 0), in milliseconds."""

    flat: float
    slope: float
    knee: float

    def __call__(self, n):
        return self.flat + self.slope * np.maximum(np.asarray(n, dtype=float) - self.knee, 0.0)


@dataclass(frozen=True)
class LinearCost:
    """D(B) = base + per_seq * B, in milliseconds."""

    base: float
    per_seq: float

    def __call__(self, b):
        return self.base + self.per_seq * np.asarray(b, dtype=float)


NO_COST = LinearCost(0.0, 0.0)


@dataclass(frozen=True)
class LatencyModel:
    """step_ms(B, k, c) = T(B (k + 1)) + [k > 0] S(B) + k D(B)
    + (attention_per_seq B + attention B (k + 1)) max(c - context, 0)."""

    target: HingeLatency
    draft: LinearCost
    speculation: LinearCost = NO_COST
    attention: float = 0.0  # ms per query token per context token beyond `context`
    context: float = 0.0  # mean context (tokens) of the steps T, S and D were fitted on
    attention_per_seq: float = 0.0  # ms per sequence per context token beyond `context`

    @property
    def c_peak(self) -> float:
        """Tokens per step where the step turns compute-bound: past the knee, the point
        where the per-token cost has grown as large as the fixed cost (T doubles). For
        a sharp roofline this is the knee itself; on CPU, where every token costs
        something, it is the balance point."""
        if self.target.slope <= 0:
            return math.inf
        return self.target.knee + self.target.flat / self.target.slope

    def step_ms(self, b, k, context=None):
        """`context`: the requests' mean context in tokens (None: the profile's own)."""
        b, k = np.asarray(b, dtype=float), np.asarray(k, dtype=float)
        ms = self.target(b * (k + 1)) + (k > 0) * self.speculation(b) + k * self.draft(b)
        return ms + self.attention_ms(b, b * (k + 1), context)

    @property
    def prices_attention(self) -> bool:
        return bool(self.attention or self.attention_per_seq)

    def attention_ms(self, sequences, query_tokens, context=None):
        """What `sequences` with `query_tokens` between them pay to attend to a mean
        `context` beyond the profile's (None: the profile's own, which T, S and D price)."""
        per_context_token = self.attention_per_seq * np.asarray(
            sequences, dtype=float
        ) + self.attention * np.asarray(query_tokens, dtype=float)
        if context is None:
            return 0.0 * per_context_token
        return per_context_token * max(float(context) - self.context, 0.0)

    def to_dict(self) -> dict:
        return {
            "target": asdict(self.target),
            "draft": asdict(self.draft),
            "speculation": asdict(self.speculation),
            "attention": self.attention,
            "attention_per_seq": self.attention_per_seq,
            "context": self.context,
            "c_peak": self.c_peak,
        }

    @classmethod
    def from_dict(cls, d: dict) -> LatencyModel:
        speculation = LinearCost(**d["speculation"]) if "speculation" in d else NO_COST
        return cls(
            HingeLatency(**d["target"]),
            LinearCost(**d["draft"]),
            speculation,
            float(d.get("attention", 0.0)),
            float(d.get("context", 0.0)),
            float(d.get("attention_per_seq", 0.0)),
        )


def _nonnegative_lstsq(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop negative terms, refit)."""
    active = np.ones(features.shape[1], dtype=bool)
    while True:
        coef = np.zeros(features.shape[1])
        coef[active] = np.linalg.lstsq(features[:, active], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        active &= coef > 0


def fit_latency(b, k, ms) -> tuple[LatencyModel, float]:
    """Least-squares fit of step_ms(B, k) to measured steps, in relative error; returns
    (model, rms error ms).

    Relative, because the controller compares steps of one B with each other: an
    absolute fit lets the 200 ms steps of B = 64 decide, and at B = 1 it got the price of
    a draft step wrong by half (measured: it drafted k = 5 where k = 3 was fastest). The
    knee is searched over 0 and the measured token counts; for each candidate the six
    linear coefficients are solved non-negative.
    """
    b, k, ms = (np.asarray(x, dtype=float) for x in (b, k, ms))
    n = b * (k + 1)
    on = (k > 0).astype(float)
    weight = 1.0 / ms
    best = None
    for knee in np.unique(np.concatenate([[0.0], n])):
        features = np.stack(
            [np.ones_like(n), np.maximum(n - knee, 0), on, on * b, k, k * b], axis=1
        )
        coef = _nonnegative_lstsq(features * weight[:, None], ms * weight)
        sse = float((((features @ coef - ms) * weight) ** 2).sum())
        if best is None or sse < best[0] - 1e-12:
            best = (sse, knee, coef)
    knee, coef = best[1], [float(c) for c in best[2]]
    flat, slope, s_base, s_per_seq, d_base, d_per_seq = coef
    model = LatencyModel(
        HingeLatency(flat, slope, float(knee)),
        LinearCost(d_base, d_per_seq),
        LinearCost(s_base, s_per_seq),
    )
    return model, math.sqrt(float(((model.step_ms(b, k) - ms) ** 2).mean()))


def fit_attention(latency: LatencyModel, b, k, context, ms, reference: float) -> LatencyModel:
    """`latency` (fitted on steps at mean context `reference`) with the attention term
    fitted to steps timed at other contexts: what those steps cost beyond the model, per
    context token, in its two parts (per sequence and per query token), least squares in
    relative error, each at least 0. Telling the parts apart takes steps of one B at
    several k (the profile times k = 0 and its largest k at a long context)."""
    b, k, context, ms = (np.asarray(x, dtype=float) for x in (b, k, context, ms))
    beyond = (context - reference) / ms
    features = np.stack([b * beyond, b * (k + 1) * beyond], axis=1)
    excess = (ms - latency.step_ms(b, k)) / ms
    per_seq, per_query = (float(c) for c in _nonnegative_lstsq(features, excess))
    return replace(
        latency, attention=per_query, attention_per_seq=per_seq, context=float(reference)
    )


def profile_latency(profile: dict) -> LatencyModel:
    """A stored profile's latency model (`grpo-specdec profile`'s JSON). One fitted before
    the attention term had its per-sequence part has that term refitted from its own
    long-context steps, so that no hardware is profiled again for it."""
    latency = LatencyModel.from_dict(profile["latency"])
    if "attention_per_seq" in profile["latency"]:
        return latency
    draft_sampling = profile.get("key", {}).get("draft_sampling", "greedy")
    _, long = own_steps(profile.get("measurements", []), draft_sampling)
    if not long:
        return latency
    fields = ("batch", "k", "context", "ms")
    return fit_attention(
        replace(latency, attention=0.0),
        *([r[f] for r in long] for f in fields),
        reference=latency.context,
    )


def timed_temperature(draft_sampling: str) -> float:
    """The temperature a profile's own steps sample at: sampled drafting is timed at T = 1."""
    return 0.0 if draft_sampling == "greedy" else 1.0


def own_steps(rows: list[dict], draft_sampling: str) -> tuple[list[dict], list[dict]]:
    """A profile's decode steps timed at its own temperature (not the prefill steps, nor
    those timed again at T = 1 for the simulator), split into (short, long) context."""
    temperature = timed_temperature(draft_sampling)
    own = [
        r for r in rows if not r.get("prefill") and r.get("temperature", temperature) == temperature
    ]
    return [r for r in own if not r.get("long_context")], [r for r in own if r.get("long_context")]


class Policy(Protocol):
    """Where a step's k comes from: the running batch's size, the requests' mean context and
    their ids (for policies that price k on what each running request has shown)."""

    def choose(
        self, batch_size: int, context: float | None = None, requests: Sequence[str] = ()
    ) -> int: ...


class FixedPolicy:
    def __init__(self, k: int):
        self.k = k

    def choose(
        self, batch_size: int, context: float | None = None, requests: Sequence[str] = ()
    ) -> int:
        return self.k


class PaperPolicy:
    """FastGRPO's rule, for a chain draft: N_verify = min(C_peak // B, N_max) tokens per
    sequence, depth L = clamp(floor(log2(N_verify / alpha)), L_min, L_max), k = min(L,
    N_verify - 1, k_max)."""

    def __init__(
        self,
        c_peak: float,
        k_max: int,
        alpha: float = 0.75,
        l_min: int = 3,
        l_max: int = 5,
        n_max: int = 160,
    ):
        self.c_peak, self.k_max, self.alpha = c_peak, k_max, alpha
        self.l_min, self.l_max, self.n_max = l_min, l_max, n_max

    def choose(
        self, batch_size: int, context: float | None = None, requests: Sequence[str] = ()
    ) -> int:
        n_verify = min(int(self.c_peak // max(batch_size, 1)), self.n_max)
        if n_verify <= 1:
            return 0
        depth = min(max(int(math.floor(math.log2(n_verify / self.alpha))), self.l_min), self.l_max)
        return min(depth, n_verify - 1, self.k_max)


class GoodputPolicy:
    """argmax_k G(B, k), made non-increasing in B by a running minimum over B (the
    latency model's knee makes larger batches never reward deeper drafts). The context is
    priced in steps of CONTEXT_STEP tokens."""

    CONTEXT_STEP = 64

    def __init__(self, latency: LatencyModel, estimator: AcceptanceEstimator, max_batch: int):
        self.latency, self.estimator, self.max_batch = latency, estimator, max_batch
        self._b = np.arange(1, max_batch + 1, dtype=float)[:, None]
        self._k = np.arange(estimator.k_max + 1, dtype=float)[None, :]
        self._step_ms: dict[float | None, np.ndarray] = {}  # [B, k+1] per context, per profile
        self._table: np.ndarray | None = None
        self._key: tuple = ()

    def table(self, context: float | None = None) -> np.ndarray:
        """k for batch sizes 1..max_batch under the current acceptance estimates, at the
        requests' mean `context` (None: the profile's own)."""
        if context is not None and self.latency.prices_attention:
            context = self.CONTEXT_STEP * round(context / self.CONTEXT_STEP)
        else:
            context = None
        if self._key != (self.estimator.version, context) or self._table is None:
            step_ms = self._step_ms.get(context)
            if step_ms is None:
                step_ms = self._step_ms[context] = self.latency.step_ms(self._b, self._k, context)
            goodput = self._b * self.estimator.optimistic_tokens()[None, :] / step_ms
            self._table = np.minimum.accumulate(goodput.argmax(axis=1))
            self._key = (self.estimator.version, context)
        return self._table

    def choose(
        self, batch_size: int, context: float | None = None, requests: Sequence[str] = ()
    ) -> int:
        return int(self.table(context)[min(max(batch_size, 1), self.max_batch) - 1])
