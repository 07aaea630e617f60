"""Replay a GRPO-shaped rollout step by step and predict its makespan under each policy.

All requests start together (one prefill step over every prompt), then every step decodes
the B requests still running with the k their policy picks for B, and a request leaves once
it has its output length. A step costs the controller's own `LatencyModel.step_ms(B, k,
context)` plus the costs the profile does not time (`UnprofiledCosts`); it advances each request
by E[tokens | k] from the conditional acceptance (`expected_tokens`), or, with draws, by
tokens drawn position by position from it (`drawn_replay`, the mean of many replays): the
expectation advances every request alike, so its batch ends when the average request does,
while a measured batch ends with its unluckiest one. The policies are the
controller's (`FixedPolicy`, `PaperPolicy`, `GoodputPolicy`) or vLLM's dense batch-size ->
k list, read as the scheduler reads its `dynamic_sd_lookup`: once per step, indexed by the
requests scheduled.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from vllm_plugin.acceptance import FrozenAcceptance, expected_tokens
from vllm_plugin.controller import (
    NO_COST,
    FixedPolicy,
    GoodputPolicy,
    LatencyModel,
    LinearCost,
    PaperPolicy,
    Policy,
    own_steps,
    profile_latency,
)

TAIL_AFTER = 0.9  # the tail phase starts once this share of requests has finished


@dataclass(frozen=True)
class UnprofiledCosts:
    """Step costs the latency model leaves out (`grpo-specdec profile` times the first and
    the last in a profile's `unprofiled`, from format 5). Sampling at T > 0 costs per
    verified token (softmax over the vocabulary, rejection sampling) where the profile
    timed greedy steps; attention costs per query token per token of context beyond the
    context the profile was measured at, where the latency model has no attention term of
    its own (format < 4); a prefill step costs per prompt token (None: the profile's T(n),
    which extrapolates decode steps of at most B (k_max + 1) tokens to the whole batch's
    prompts)."""

    sampling_ms_per_token: float = 0.0
    attention_ms_per_kv_token: float = 0.0
    reference_context: float = 0.0
    prefill_ms_per_token: float | None = None

    def prefill_ms(self, latency: LatencyModel, prompt_tokens: float) -> float:
        if self.prefill_ms_per_token is None:
            return float(latency.target(prompt_tokens))
        return self.prefill_ms_per_token * prompt_tokens

    def step_ms(self, contexts: np.ndarray, k: int, temperature: float) -> float:
        query_tokens = len(contexts) * (k + 1)
        sampling = self.sampling_ms_per_token * query_tokens if temperature > 0 else 0.0
        beyond = np.maximum(contexts - self.reference_context, 0.0).sum()
        return sampling + self.attention_ms_per_kv_token * (k + 1) * float(beyond)


NONE_UNPROFILED = UnprofiledCosts()


def _along(x: float, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """ys (rows per point of xs, ascending) at x: linear between points, the first row below
    them, and beyond the last along its last segment."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(int(np.searchsorted(xs, x)), len(xs) - 1)
    share = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + share * (ys[i] - ys[i - 1])


@dataclass(frozen=True)
class MeasuredSteps:
    """Step costs read off a profile's timed steps, not off the latency model the controller
    fitted to them, so that a replay of the controller's choices is not priced by the
    controller's own beliefs: the ms of each timed (B, k), linear in B between the timed
    batch sizes; at a context beyond the one a B's steps were timed at, plus what the
    long-context steps cost per sequence per context token more than their short twins,
    linear in k between the k timed there and in B between their batch sizes.
    `less_draft`: a draft cost to take off (k D(B)), for drafts that cost nothing to make."""

    batches: np.ndarray  # the timed B, ascending
    ms: np.ndarray  # [B, k] ms of a step at the context it was timed at
    contexts: np.ndarray  # [B] mean context of those steps
    long_batches: np.ndarray
    long_ks: np.ndarray
    per_context: np.ndarray  # [long B, long k] ms per sequence per context token
    less_draft: LinearCost = NO_COST

    @classmethod
    def from_profile(cls, profile: dict) -> MeasuredSteps:
        draft_sampling = profile.get("key", {}).get("draft_sampling", "greedy")
        short_rows, long_rows = own_steps(profile.get("measurements", []), draft_sampling)
        short = {(r["batch"], r["k"]): r for r in short_rows}
        if not short:
            raise ValueError("profile: no timed steps in its `measurements`")
        batches = sorted({b for b, _ in short})
        ks = range(max(k for _, k in short) + 1)
        missing = [(b, k) for b in batches for k in ks if (b, k) not in short]
        if missing:
            raise ValueError(f"profile: no timed step at (B, k) = {missing[0]}")
        long = {(r["batch"], r["k"]): r for r in long_rows}
        long_batches = sorted({b for b, _ in long})
        long_ks = sorted({k for _, k in long})
        per_context = [
            [
                max(long[b, k]["ms"] - short[b, k]["ms"], 0.0)
                / (b * (long[b, k]["context"] - short[b, k]["context"]))
                for k in long_ks
            ]
            for b in long_batches
        ]
        return cls(
            np.array(batches, dtype=float),
            np.array([[short[b, k]["ms"] for k in ks] for b in batches]),
            np.array([statistics.fmean(short[b, k]["context"] for k in ks) for b in batches]),
            np.array(long_batches, dtype=float),
            np.array(long_ks, dtype=float),
            np.array(per_context).reshape(len(long_batches), len(long_ks)),
        )

    @property
    def prices_attention(self) -> bool:
        return len(self.long_batches) > 0

    def step_ms(self, b, k, context=None) -> float:
        b, k = float(b), int(k)
        if k >= self.ms.shape[1]:
            raise ValueError(f"k={k}: the profile timed k <= {self.ms.shape[1] - 1}")
        ms = float(_along(b, self.batches, self.ms[:, k])) - k * float(self.less_draft(b))
        if context is None or not self.prices_attention:
            return ms
        beyond = max(float(context) - float(_along(b, self.batches, self.contexts)), 0.0)
        per_k = np.array([np.interp(k, self.long_ks, row) for row in self.per_context])
        per_token = float(np.interp(b, self.long_batches, per_k))
        return ms + per_token * b * beyond


@dataclass(frozen=True)
class Workload:
    """A rollout: per-request output and prompt lengths (tokens), sampled at `temperature`."""

    output_lengths: np.ndarray
    prompt_lengths: np.ndarray
    temperature: float = 1.0

    def __post_init__(self):
        out = np.asarray(self.output_lengths, dtype=float)
        prompts = np.broadcast_to(np.asarray(self.prompt_lengths, dtype=float), out.shape)
        if out.ndim != 1 or not len(out):
            raise ValueError("output_lengths: need a non-empty list of per-request lengths")
        if (out < 1).any():
            raise ValueError(f"output_lengths: every request makes >= 1 token, got {out.min()}")
        if (prompts < 1).any():
            raise ValueError("prompt_lengths: every prompt has >= 1 token")
        object.__setattr__(self, "output_lengths", out)
        object.__setattr__(self, "prompt_lengths", prompts.copy())


@dataclass
class Replay:
    """What one replay predicts. `steps`: (start s, requests running B, k) per step."""

    makespan_s: float
    tokens: float
    tail_s: float
    mal: float  # tokens per request-step over the steps that drafted, as the engine reports
    steps: list[tuple[float, int, int]] = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s


def replay(
    latency: LatencyModel,
    conditional,
    workload: Workload,
    policy: Policy | list[int],
    unprofiled: UnprofiledCosts = NONE_UNPROFILED,
    draft_pass_at_k0: bool = False,
    steps_priced_by: MeasuredSteps | None = None,
    rng: np.random.Generator | None = None,
) -> Replay:
    """Replay `workload` with k from `policy`. `conditional`: P(draft position i accepted |
    positions < i accepted), one per position up to the policy's largest k.
    `draft_pass_at_k0`: steps with k = 0 still run one draft pass, as vLLM 0.32 ships.
    `steps_priced_by`: the profile's timed steps price each step (default: `latency`).
    `rng`: each request's tokens in a step are drawn (its drafts accepted position by
    position, up to the first rejection) instead of E[tokens | k]: a batch ends with its
    unluckiest request, which the expectation never is."""
    conditional = np.asarray(conditional, dtype=float)
    tokens_at = expected_tokens(conditional)
    choose = (lambda b, _: policy[b]) if isinstance(policy, list) else policy.choose
    costs = steps_priced_by or latency
    if costs.prices_attention:  # the profile timed attention itself
        unprofiled = replace(unprofiled, attention_ms_per_kv_token=0.0)
    remaining = workload.output_lengths - 1.0  # the prefill step makes every first token
    contexts = workload.prompt_lengths + 1.0
    t_ms = unprofiled.prefill_ms(latency, float(workload.prompt_lengths.sum()))
    finished_at = np.full(len(remaining), t_ms)  # those of one token finish with prefill
    steps = [(0.0, len(remaining), 0)]
    drafted_steps = drafted_tokens = 0.0
    running = np.flatnonzero(remaining > 0)
    while len(running):
        b = len(running)
        context = float(contexts[running].mean())
        k = int(choose(b, context))
        if k >= len(tokens_at):
            raise ValueError(
                f"policy chose k={k} for B={b}; acceptance covers k <= {len(tokens_at) - 1}"
            )
        steps.append((t_ms / 1000, b, k))
        t_ms += float(costs.step_ms(b, k, context)) + unprofiled.step_ms(
            contexts[running], k, workload.temperature
        )
        if k == 0 and draft_pass_at_k0:
            t_ms += float(latency.draft(b))
        tokens = np.full(b, tokens_at[k])
        if rng is not None and k > 0:
            tokens = 1.0 + np.cumprod(rng.random((b, k)) < conditional[:k], axis=1).sum(axis=1)
        made = np.minimum(tokens, remaining[running])
        if k > 0:
            drafted_steps += b
            drafted_tokens += float(tokens.sum())
        remaining[running] -= made
        contexts[running] += made
        done = running[remaining[running] <= 1e-9]
        finished_at[done] = t_ms
        running = running[remaining[running] > 1e-9]
    order = np.sort(finished_at)
    tail_start = order[math.ceil(TAIL_AFTER * len(order)) - 1]
    return Replay(
        makespan_s=t_ms / 1000,
        tokens=float(workload.output_lengths.sum()),
        tail_s=(t_ms - tail_start) / 1000,
        mal=drafted_tokens / drafted_steps if drafted_steps else 1.0,
        steps=steps,
    )


def drawn_replay(draws: int, *args, seed: int = 0, **kwargs) -> Replay:
    """The mean of `draws` replays (arguments as `replay`'s) whose tokens per step are drawn
    from the acceptance, one seeded generator across them: makespan, tail and MAL averaged,
    the steps those of the first."""
    if draws < 1:
        raise ValueError(f"draws: need at least 1 replay, got {draws}")
    rng = np.random.default_rng(seed)
    runs = [replay(*args, rng=rng, **kwargs) for _ in range(draws)]
    return Replay(
        makespan_s=statistics.fmean(r.makespan_s for r in runs),
        tokens=runs[0].tokens,
        tail_s=statistics.fmean(r.tail_s for r in runs),
        mal=statistics.fmean(r.mal for r in runs),
        steps=runs[0].steps,
    )


def compared_policies(
    latency: LatencyModel,
    conditional,
    k_max: int,
    max_batch: int,
    static_table: list[int] | None = None,
) -> dict[str, Policy | list[int]]:
    """The policies compared: no speculation, fixed k = 1..k_max, vLLM's static table (a
    dense batch-size -> k list, `vllm_plugin.compat.dense_k_table`), the paper's rule and ours
    (goodput, pricing k on `conditional` as if its estimator had converged to it)."""
    policies: dict[str, Policy | list[int]] = {"no spec": FixedPolicy(0)}
    policies.update({f"k={k}": FixedPolicy(k) for k in range(1, k_max + 1)})
    if static_table is not None:
        policies["static table"] = static_table
    policies["paper rule"] = PaperPolicy(latency.c_peak, k_max)
    policies["ours"] = GoodputPolicy(latency, FrozenAcceptance(conditional[:k_max]), max_batch)
    return policies


# vLLM's docs' example static tables (dynamic speculation), EAGLE and EAGLE-3 on
# Llama-3.1-8B: what a user copies when they have no table of their own.
VLLM_EXAMPLE_TABLES = {
    "EAGLE": [[1, 64, 3], [65, 128, 1], [129, 512, 0]],
    "EAGLE-3": [[1, 16, 5], [17, 32, 4], [33, 64, 3], [65, 128, 1], [129, 512, 0]],
}


def recommend_table(
    latency: LatencyModel, conditional, k_max: int, max_batch: int
) -> list[list[int]]:
    """A `num_speculative_tokens_per_batch_size` table for stacks that can only give vLLM a
    static table: per batch size, the k of largest goodput under this profile and
    acceptance (non-increasing in B), as inclusive [first B, last B, k] ranges."""
    ks = GoodputPolicy(latency, FrozenAcceptance(conditional[:k_max]), max_batch).table()
    ranges: list[list[int]] = []
    for b, k in enumerate(ks, start=1):
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = b
        else:
            ranges.append([b, b, int(k)])
    return ranges


def lengths_from_trace(trace, conditional) -> np.ndarray:
    """Per-request output lengths of a rollout from its per-step (time, B, k) trace: a
    request that left after step i made one token in the prefill step (the trace's first)
    and E[tokens | k] in each later step it ran (exact where k = 0)."""
    tokens_at = expected_tokens(np.asarray(conditional, dtype=float))
    if not trace:
        raise ValueError("trace: no steps")
    made, lengths = 0.0, []
    for i, (_, b, k) in enumerate(trace):
        made += 1.0 if i == 0 else float(tokens_at[min(int(k), len(tokens_at) - 1)])
        after = int(trace[i + 1][1]) if i + 1 < len(trace) else 0
        if after > b:
            raise ValueError(f"trace step {i + 1}: B rose from {b} to {after}; not one batch")
        lengths += [made] * (int(b) - after)
    return np.array(lengths)


def named_lengths(shape: str) -> np.ndarray:
    """Output lengths of a named shape: `fixed:N:L` (N requests of L tokens) or
    `lognormal:N:MEDIAN:SIGMA:CAP` (the N quantiles of a log-normal capped at CAP, no RNG:
    the long-tailed rollouts GRPO sees)."""
    name, *params = shape.split(":")
    try:
        if name == "fixed" and len(params) == 2:
            n, length = int(params[0]), int(params[1])
            return np.full(n, float(length))
        if name == "lognormal" and len(params) == 4:
            from statistics import NormalDist

            n, median, sigma, cap = (
                int(params[0]),
                float(params[1]),
                float(params[2]),
                float(params[3]),
            )
            z = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
            return np.clip(np.round(median * np.exp(sigma * z)), 1, cap)
    except ValueError as err:
        raise ValueError(f"length shape {shape!r}: {err}") from None
    raise ValueError(f"length shape {shape!r}: expected fixed:N:L or lognormal:N:MEDIAN:SIGMA:CAP")


def load_profile(path: str | Path) -> tuple[LatencyModel, UnprofiledCosts]:
    """The latency model of a profile JSON (`{"latency": LatencyModel.to_dict()}`), with its
    `unprofiled` costs where the file has them."""
    try:
        data = json.loads(Path(path).read_text())
        latency = profile_latency(data)
        unprofiled = UnprofiledCosts(**data.get("unprofiled", {}))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"latency profile {path}: {type(err).__name__}: {err}") from None
    return latency, unprofiled


def compare(
    latency: LatencyModel,
    conditional,
    workload: Workload,
    k_max: int,
    max_batch: int,
    static_table: list[int] | None = None,
    unprofiled: UnprofiledCosts = NONE_UNPROFILED,
    draws: int = 0,
) -> dict[str, Replay]:
    """One replay of `workload` per compared policy (`compared_policies`): the expectation,
    or with `draws` the mean of that many drawn replays (`drawn_replay`)."""
    if max_batch < len(workload.output_lengths):
        raise ValueError(
            f"max_batch={max_batch} is below the {len(workload.output_lengths)} requests of the "
            "workload: a replay starts every request at once (no queue)"
        )
    return {
        name: (
            drawn_replay(draws, latency, conditional, workload, policy, unprofiled)
            if draws
            else replay(latency, conditional, workload, policy, unprofiled)
        )
        for name, policy in compared_policies(
            latency, conditional, k_max, max_batch, static_table
        ).items()
    }


def comparison_table(replays: dict[str, Replay]) -> str:
    """Markdown: makespan, tokens/s, speedup over no speculation, tail phase, MAL."""
    base = replays["no spec"].makespan_s
    lines = [
        "| policy | makespan s | tokens/s | vs no spec | tail s (after 90% done) | MAL |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in replays.items():
        lines.append(
            f"| {name} | {r.makespan_s:.3f} | {r.tokens_per_s:.0f} | {base / r.makespan_s:.2f}x "
            f"| {r.tail_s:.3f} | {r.mal:.2f} |"
        )
    return "\n".join(lines)


def read_acceptance(spec: str) -> np.ndarray:
    """Conditional acceptance from `0.6,0.5,...` or a JSON file holding a list or
    {"conditional": [...]}."""
    try:
        if Path(spec).is_file():
            data = json.loads(Path(spec).read_text())
            values = data["conditional"] if isinstance(data, dict) else data
        else:
            values = [float(x) for x in spec.split(",")]
        conditional = np.asarray(values, dtype=float)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"acceptance {spec!r}: {err}") from None
    if (
        conditional.ndim != 1
        or not len(conditional)
        or ((conditional < 0) | (conditional > 1)).any()
    ):
        raise ValueError(f"acceptance {spec!r}: need one probability in [0, 1] per draft position")
    return conditional


def read_lengths(path: str | Path) -> np.ndarray:
    """Per-request output lengths from a JSON list or one integer a line."""
    text = Path(path).read_text()
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else text.split()
        return np.array([float(v) for v in values])
    except ValueError as err:
        raise ValueError(f"lengths file {path}: {err}") from None
