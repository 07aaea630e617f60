"""How often the draft is accepted: per draft position, pooled over recent drafts and per
running request. Plain Python, testable without vLLM.

Position i of a draft is tried when the i tokens before it were accepted; its conditional
acceptance p_i is what the controller prices a k on (`expected_tokens`).

- The pool holds the evidence of the last `memory` verified drafts (each one fades the
  older ones by 1 - 1/memory), whatever the concurrency. It learns only from drafts
  verified before their request's first EOS: text past an ignored EOS (benchmarks that
  equalise lengths) is accepted far less by any head and is never what a rollout makes.
- Nothing fades with time alone: where nothing is drafted the evidence stays as it was,
  and the controller's exploration budget (controller.Controller) decides when to probe.
- `restart()` keeps the pool's estimates but caps the weight of its evidence at
  `restart_weight` drafts: after a weight swap or at a new wave of requests the old
  evidence is a prior, which the first drafts of the new regime overrule within a step or
  two at large B.
- Each running request keeps its own evidence (fading over its last `request_memory`
  drafts), and is priced on it (`running_tokens`), so a step's k is priced on the
  requests running now: in a rollout's tail the few left are not the average request of
  its bulk. In the pool a request's n-th draft weighs 1 / (1 + n / `request_share`), so
  that the tail's few requests do not become the pool. Drafts past a request's first EOS
  go to a pool of their own, which prices only requests past their EOS (and their own
  evidence restarts there: their text changed).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def expected_tokens(conditional: np.ndarray) -> np.ndarray:
    """E[tokens per step | k] for k = 0..len(conditional) (last axis: draft positions)."""
    conditional = np.asarray(conditional, dtype=float)
    runs = np.cumsum(np.cumprod(conditional, axis=-1), axis=-1)
    return np.concatenate([np.ones(conditional.shape[:-1] + (1,)), 1.0 + runs], axis=-1)


def conditional_from_cumulative(cumulative) -> np.ndarray:
    """P(position i accepted | positions < i accepted) from P(positions <= i all accepted)."""
    cumulative = np.asarray(cumulative, dtype=float)
    previous = np.concatenate([[1.0], cumulative[:-1]])
    return np.divide(cumulative, previous, out=np.zeros_like(cumulative), where=previous > 0)


def _tried_and_accepted(num_draft_tokens: int, num_accepted: int, k_max: int):
    """Positions a draft of `num_draft_tokens` with `num_accepted` accepted tried, accepted."""
    return min(num_accepted + 1, num_draft_tokens, k_max), min(num_accepted, k_max)


class _Pool:
    """Fading per-position counts of tried and accepted draft tokens."""

    def __init__(self, k_max: int, memory: float):
        self.tried, self.accepted, self.memory = np.zeros(k_max), np.zeros(k_max), memory

    def add(self, tried: int, accepted: int, weight: float) -> None:
        fade = 1.0 - weight / self.memory
        self.tried *= fade
        self.accepted *= fade
        self.tried[:tried] += weight
        self.accepted[:accepted] += weight

    def cap(self, weight: float) -> bool:
        """Keep the estimates at the weight of at most `weight` drafts; whether it changed."""
        held = float(self.tried[0]) if len(self.tried) else 0.0
        if held <= weight:
            return False
        self.tried *= weight / held
        self.accepted *= weight / held
        return True


class AcceptanceEstimator:
    def __init__(
        self,
        k_max: int,
        prior: float = 0.6,
        prior_weight: float = 4.0,
        optimism: float = 1.0,
        memory: float = 512.0,
        restart_weight: float = 32.0,
        request_weight: float = 16.0,
        request_memory: float = 16.0,
        request_share: float = 16.0,
    ):
        self.k_max, self.prior, self.prior_weight = k_max, prior, prior_weight
        self.optimism, self.memory, self.restart_weight = optimism, memory, restart_weight
        self.request_weight, self.request_memory = request_weight, request_memory
        self.request_share = request_share
        self.between: float | None = None  # variance of acceptance between requests
        self.pool = _Pool(k_max, memory)  # drafts before their request's first EOS
        self.past_eos = _Pool(k_max, memory)  # and past it
        # id -> [[tried], [accepted], [drafts given, past its first EOS, 0, ...]]
        self.requests: dict[str, np.ndarray] = {}
        self.version = 0  # bumps when the pool's estimates change, so callers can cache

    @property
    def tried(self) -> np.ndarray:
        return self.pool.tried

    @property
    def accepted(self) -> np.ndarray:
        return self.pool.accepted

    def observe(
        self,
        num_draft_tokens: int,
        num_accepted: int,
        request_id: str | None = None,
        before_eos: bool = True,
    ) -> None:
        """One verified draft. Past its request's first EOS (`before_eos` false) it goes to
        a pool of its own, which prices only requests past their EOS."""
        tried, accepted = _tried_and_accepted(num_draft_tokens, num_accepted, self.k_max)
        own = None
        if request_id is not None:
            own = self.requests.get(request_id)
            if own is None:
                # two columns at least: row 2 holds (drafts given, past its first EOS)
                own = self.requests[request_id] = np.zeros((3, max(self.k_max, 2)))
        # A request's drafts weigh less in a pool the more it has given: the few requests
        # of a rollout's tail, hundreds of drafts each, would otherwise speak for the next
        # wave's bulk.
        weight = 1.0 if own is None else 1.0 / (1.0 + own[2, 0] / self.request_share)
        (self.pool if before_eos else self.past_eos).add(tried, accepted, weight)
        self.version += before_eos
        if own is not None:
            if not before_eos and not own[2, 1]:  # its text changed: its evidence restarts
                own[:2] = 0.0
                own[2, 1] = 1.0
            own[:2] *= 1.0 - 1.0 / self.request_memory
            own[0, :tried] += 1
            own[1, :accepted] += 1
            own[2, 0] += 1

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the evidence of every request not in `keep` (those finished)."""
        keep = set(keep)
        self.requests = {r: own for r, own in self.requests.items() if r in keep}

    def restart(self) -> None:
        """Keep the pools' estimates, at the weight of at most `restart_weight` drafts."""
        self.past_eos.cap(self.restart_weight)
        if self.pool.cap(self.restart_weight):
            self.version += 1

    def conditional(self, pool: _Pool | None = None) -> np.ndarray:
        """A pool's estimate (default: before EOS), each position shrunk toward the one
        before (position 0 toward `prior`), so that rarely tried positions borrow strength."""
        pool = pool or self.pool
        p = np.empty(self.k_max)
        previous = self.prior
        for i in range(self.k_max):
            p[i] = (pool.accepted[i] + self.prior_weight * previous) / (
                pool.tried[i] + self.prior_weight
            )
            previous = p[i]
        return p

    def optimistic_conditional(self, pool: _Pool | None = None) -> np.ndarray:
        """The estimate with position 0 raised by `optimism` standard errors of its evidence
        (at most 1): with little evidence (after a restart) the step drafts and learns at
        once, and a draft that had bad luck early is not shut out. Deeper positions keep
        their point estimates: few drafts reach them, so a bound there would be wide and
        would buy depth the steps do not repay (on the float32 demo's end point it priced
        k = 3 at 2.51 tokens, the point estimate 2.37, and the engine ran k = 3 at B = 8-15
        where k = 1 made tokens 25% faster); probes (the controller's budget) explore
        depth instead."""
        pool = pool or self.pool
        p = np.array(self.conditional(pool), dtype=float)
        if self.k_max:
            spread = np.sqrt(p[0] * (1.0 - p[0]) / (pool.tried[0] + self.prior_weight))
            p[0] = min(p[0] + self.optimism * spread, 1.0)
        return p

    def expected_tokens(self) -> np.ndarray:
        return expected_tokens(self.conditional())

    def optimistic_tokens(self) -> np.ndarray:
        """E[tokens per step | k] under `optimistic_conditional`."""
        return expected_tokens(self.optimistic_conditional())

    def running_tokens(self, request_ids: Iterable[str] = (), optimistic: bool = True):
        """E[tokens per request-step | k], the mean over `request_ids` of each request's own
        estimate; the pool's alone where none of them has evidence of its own.

        A request's estimate at each position shrinks its own evidence, with
        `_request_weight` drafts' weight, toward the pool's (optimistic or point) estimate
        there (past its EOS, the past-EOS pool's) scaled by how the request fared against
        the pool at the position before: a request whose drafts fail early is not drafted
        deep on the pool's deep positions, which its easy requests reach, and the pool's
        shape (conditional acceptance falling or rising with depth) is kept."""
        estimate = self.optimistic_conditional if optimistic else self.conditional
        pooled = estimate()
        ids = list(request_ids)
        own = [self.requests[r] for r in ids if r in self.requests]
        if not own:
            return expected_tokens(pooled)
        counts = np.stack(own)
        weight = self._request_weight(counts)
        p = np.empty((len(own), self.k_max))
        past = counts[:, 2, 1] > 0
        shape = np.tile(pooled, (len(own), 1))
        if past.any():
            shape[past] = estimate(self.past_eos)
        level = np.ones(len(own))  # the request's acceptance over the pool's, so far
        for i in range(self.k_max):
            prior = np.minimum(shape[:, i] * level, 1.0)
            p[:, i] = (counts[:, 1, i] + weight * prior) / (counts[:, 0, i] + weight)
            level = p[:, i] / np.maximum(shape[:, i], 1e-9)
        others = len(ids) - len(own)
        return (expected_tokens(p).sum(axis=0) + others * expected_tokens(pooled)) / len(ids)

    def _request_weight(self, counts: np.ndarray) -> float:
        """How many drafts' weight the pool has against a request's own evidence: p(1 - p)
        over the variance of acceptance between requests, as empirical Bayes has it (a
        pool of like requests outweighs a request's few noisy drafts; where requests
        differ, each one's own drafts soon speak for it). The variance is measured at
        position 0 whenever enough running requests have drafts of their own (a rollout's
        bulk), and kept for the steps that have few (its tail)."""
        tried, accepted = counts[:, 0, 0], counts[:, 1, 0]
        sure = tried >= 4
        p = float(self.conditional()[0]) if self.k_max else 0.5
        if sure.sum() >= 8:
            rates = accepted[sure] / tried[sure]
            between = np.mean((rates - p) ** 2) - np.mean(p * (1 - p) / tried[sure])
            between = max(float(between), 1e-4)
            self.between = between if self.between is None else 0.9 * self.between + 0.1 * between
        if self.between is None:
            return self.request_weight
        return float(np.clip(p * (1 - p) / self.between, 1.0, self.request_memory * 4))


class FrozenAcceptance(AcceptanceEstimator):
    """Known conditional acceptance that does not learn (offline tables, tests): no
    uncertainty, so nothing to be optimistic about."""

    def __init__(self, conditional):
        super().__init__(len(conditional), optimism=0.0)
        self._conditional = np.asarray(conditional, dtype=float)

    def observe(self, *args, **kwargs) -> None:
        pass

    def conditional(self, pool: _Pool | None = None) -> np.ndarray:
        return self._conditional
