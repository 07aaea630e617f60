"""The controller's regime suite: recorded rollouts replayed in closed loop, step by step,
under every policy and every known step-cost profile (modelled, in seconds).

A trace holds rollouts as an engine made them (`benchmarks/regime_suite.py --record` records
them at a fixed k on the project's own engine): per request its prompt and output
lengths, its first EOS, and every verified draft (output position, tokens drafted,
accepted). From them `World` knows, at every output position of every request, how many
draft tokens in a row would be accepted there (`runs`): a draft from position t with a
accepted covers t..t+a with a, a - 1, ..., 0; a chain accepted whole goes on with what
the next draft showed. A replay then runs each rollout as the engine does: one prefill
step, then decode steps over the requests still running, each at the k its policy
chooses, each request advancing by min(run, k) + 1 tokens. A step costs what the profile's
own timed steps say (`MeasuredSteps`) plus what the profile does not time (sampling at
T > 0), times `cost_scale(k)`; our controller is handed back what the scheduler would
hand it: each verified draft (flagged past EOS where it is), the time of each step
that ran the k of the step before it (as the scheduler times them), strayed as a busy
2-core host strays it (`StepNoise`, measured: slow spells that last tens of steps,
so that a price timed in one spell is off in the next), a restart at each rollout (the
job swaps weights between rollouts).

Policies: ours (`GoodputController` on the profile's fitted model, or with no profile),
every fixed k, and an oracle that knows each request's true acceptance near its position
(over the next `ORACLE_WINDOW` positions) and each step's true cost, and takes the k of
most tokens per second.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from grpo_specdec.simulate import MeasuredSteps, UnprofiledCosts
from vllm_plugin.acceptance import AcceptanceEstimator, expected_tokens
from vllm_plugin.controller import (
    NO_COST,
    FixedPolicy,
    HingeLatency,
    LatencyModel,
    LinearCost,
    profile_latency,
)
from vllm_plugin.goodput_controller import GoodputController

ORACLE_WINDOW = 16  # output positions over which the oracle knows a request's acceptance
MAX_RUN = 16
# An engine's first rollout runs every step 1.7-1.9x slower than its later ones (measured on
# the EPYC without bfloat16, at every B, k = 0: caches and allocator cold): an engine that
# learns its prices there must not keep them.
FIRST_ROLLOUT_SLOWER = 1.8


@dataclass(frozen=True)
class StepNoise:
    """How the step times the controller is handed stray from what the steps cost, in log:
    a per-rollout offset, and within a rollout a slow part (AR(1), `slow_phi` per step)
    plus white noise. Measured on the EPYC without bfloat16 (10 natural-EOS rounds of the
    float32 demo's end point, 13,361 steady steps against their configuration's median at
    the same B and k): offsets sd 0.07; within a rollout sd 0.105, autocorrelated 0.69,
    0.55, 0.37, 0.25, 0.15 at lags 1, 2, 5, 10, 20 steps. Slow noise is what misleads a
    learner of prices: a cell timed in a slow spell keeps its price after the spell ends."""

    rollout_sd: float = 0.07
    slow_sd: float = 0.09  # 0.75 of the within-rollout variance
    slow_phi: float = 0.9
    white_sd: float = 0.053

    def draws(self, rng: np.random.Generator):
        """One rollout's noise, step after step (log)."""
        offset = self.rollout_sd * rng.normal()
        slow = self.slow_sd * rng.normal()
        spread = self.slow_sd * math.sqrt(1.0 - self.slow_phi**2)
        while True:
            yield offset + slow + self.white_sd * rng.normal()
            slow = self.slow_phi * slow + spread * rng.normal()


NOISE = StepNoise()


@dataclass
class Request:
    prompt: int
    output: int
    eos: int | None  # output position of the first EOS (None: none made)
    drafts: list[tuple[int, int, int]]  # (position, drafted, accepted), in order


def request_runs(req: Request) -> np.ndarray:
    """Per output position: draft tokens in a row accepted if drafting from there."""
    length = req.output
    value = np.full(length + 1, -1, dtype=np.int64)
    cont = np.full(length + 1, -1, dtype=np.int64)
    for t, n, a in req.drafts:
        for j in range(a + 1):
            if 0 <= t + j < length and value[t + j] < 0:
                value[t + j] = a - j
                if a == n:  # accepted whole: the chain goes on past what was drafted
                    cont[t + j] = t + a + 1
    filled = np.flatnonzero(value[:length] >= 0)
    for pos in range(length - 1, -1, -1):  # positions no draft covered: the next one's
        if value[pos] < 0:
            later = filled[filled > pos]
            value[pos] = value[later[0]] if len(later) else 0
        elif 0 <= cont[pos] < length:
            value[pos] += value[cont[pos]]
    return np.minimum(value[:length], MAX_RUN)


@dataclass
class Rollout:
    requests: list[Request]


class World:
    """One rollout's requests, as a replay walks them."""

    def __init__(self, requests: list[Request], k_max: int):
        self.prompts = np.array([r.prompt for r in requests], dtype=float)
        self.outputs = np.array([r.output for r in requests], dtype=np.int64)
        self.eos = np.array(
            [r.eos if r.eos is not None else r.output for r in requests], dtype=np.int64
        )
        runs = [request_runs(r) for r in requests]
        self.offsets = np.concatenate([[0], np.cumsum([len(x) for x in runs])[:-1]])
        self.runs = np.concatenate(runs)
        # reach[position, j]: the share of the next ORACLE_WINDOW positions whose run is >= j
        reach = []
        for x in runs:
            at_least = (x[:, None] >= np.arange(k_max + 1)[None, :]).astype(float)
            sums = np.vstack([np.zeros(k_max + 1), np.cumsum(at_least, axis=0)])
            start = np.arange(len(x))
            end = np.minimum(start + ORACLE_WINDOW, len(x))
            reach.append((sums[end] - sums[start]) / (end - start)[:, None])
        self.reach = np.concatenate(reach)

    def _rows(self, index: np.ndarray, position: np.ndarray) -> np.ndarray:
        last = self.outputs[index] - 1
        return self.offsets[index] + np.minimum(position, last)

    def run_at(self, index: np.ndarray, position: np.ndarray) -> np.ndarray:
        return self.runs[self._rows(index, position)]

    def true_tokens(self, index: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Each request's expected tokens at k = 0..k_max over the next ORACLE_WINDOW
        positions, from the runs there."""
        reach = self.reach[self._rows(index, position)]
        conditional = np.divide(
            reach[:, 1:], reach[:, :-1], out=np.zeros_like(reach[:, 1:]), where=reach[:, :-1] > 0
        )
        return expected_tokens(conditional)


@dataclass
class Trace:
    name: str
    rollouts: list[Rollout]
    temperature: float
    source: str = ""

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        data = json.loads(gzip.decompress(Path(path).read_bytes()))
        rollouts = [
            Rollout([Request(r["prompt"], r["output"], r["eos"], r["drafts"]) for r in ro])
            for ro in data["rollouts"]
        ]
        return cls(data["name"], rollouts, data["temperature"], data.get("source", ""))

    def save(self, path: str | Path) -> None:
        data = {
            "name": self.name,
            "temperature": self.temperature,
            "source": self.source,
            "rollouts": [
                [
                    {"prompt": r.prompt, "output": r.output, "eos": r.eos, "drafts": r.drafts}
                    for r in ro.requests
                ]
                for ro in self.rollouts
            ],
        }
        text = json.dumps(data, separators=(",", ":")).encode()
        Path(path).write_bytes(gzip.compress(text, mtime=0))


def synthetic_rollout(
    rng: np.random.Generator, lengths, acceptance: Callable[[int], float], prompt: int = 60
) -> Rollout:
    """Requests of `lengths` whose draft at output position t is accepted token by token
    with probability acceptance(t) (one draw per position, so runs are consistent)."""
    requests = []
    for length in lengths:
        length = int(length)
        accept = rng.random(length + MAX_RUN) < np.array(
            [acceptance(t) for t in range(length + MAX_RUN)]
        )
        drafts, t = [], 1
        while t < length:
            a = 0
            while a < MAX_RUN and accept[t + a]:
                a += 1
            drafts.append((t, MAX_RUN, a))
            t += a + 1
        requests.append(Request(prompt, length, None, drafts))
    return Rollout(requests)


def grpo_lengths(rng: np.random.Generator, n: int = 64, median: float = 60, cap: int = 400):
    """Long-tailed output lengths: log-normal around `median`, capped."""
    return np.clip(np.round(median * np.exp(0.7 * rng.standard_normal(n))), 4, cap)


def synthetic_traces(seed: int = 0) -> list[Trace]:
    """The non-stationary cases: a bulk at p = 0.85 whose tail (past position 80) falls to
    p = 0.2, ten rollouts; acceptance swinging 0.85 -> 0.2 -> 0.85 across swaps."""
    rng = np.random.default_rng(seed)
    bulk_tail = [
        synthetic_rollout(rng, grpo_lengths(rng), lambda t: 0.85 if t < 80 else 0.2)
        for _ in range(10)
    ]
    swings = [
        synthetic_rollout(rng, grpo_lengths(rng), lambda t, p=p: p)
        for p in (0.85, 0.85, 0.85, 0.2, 0.2, 0.2, 0.85, 0.85, 0.85)
    ]
    return [
        Trace("synthetic: bulk p=0.85, tail p=0.2, x10", bulk_tail, 1.0),
        Trace("synthetic: p 0.85 -> 0.2 -> 0.85 across swaps", swings, 1.0),
    ]


@dataclass(frozen=True)
class Costs:
    """A profile as the suite uses it: what steps truly cost, and the model fitted to them
    that the controller is given (`ours(..., profiled=False)` starts one without it)."""

    name: str
    true_steps: MeasuredSteps | LatencyModel
    unprofiled: UnprofiledCosts
    model: LatencyModel
    scale: tuple[float, float] = (1.0, 1.0)  # true cost x scale[0] at k = 0 .. scale[1] at k_max
    timed_greedy: bool = False  # its profile timed greedy drafts
    drafting: float = 1.0  # true cost x this where k > 0

    def step_ms(self, batch: int, k: int, context: float, contexts, temperature, k_max) -> float:
        ms = float(self.true_steps.step_ms(batch, k, context))
        ms += self.unprofiled.step_ms(contexts, k, temperature)
        share = k / k_max if k_max else 0.0
        ms *= self.drafting if k else 1.0
        return ms * (self.scale[0] + share * (self.scale[1] - self.scale[0]))

    def prefill_ms(self, prompt_tokens: float) -> float:
        return self.unprofiled.prefill_ms(self.model, prompt_tokens)


def profile_costs(name: str, profile: dict, timed_greedy: bool = False) -> Costs:
    unprofiled = UnprofiledCosts(**profile.get("unprofiled", {}))
    steps, model = MeasuredSteps.from_profile(profile), profile_latency(profile)
    return Costs(name, steps, unprofiled, model, timed_greedy=timed_greedy)


def model_costs(name: str, latency: LatencyModel) -> Costs:
    return Costs(name, latency, UnprofiledCosts(), latency)


# A Xeon without bfloat16 instructions, float32 SmolLM2 (docs/benchmarks: T(n) = 29.2 + 1.76 n
# ms); its draft costs as the EPYC's relative to the target's flat cost.
XEON_NO_BF16 = LatencyModel(HingeLatency(29.2, 1.76, 0.0), LinearCost(1.25, 0.0), NO_COST)


def known_costs(assets: Path) -> list[Costs]:
    """The CPU profiles we know (three measured, one modelled) and the modelled GPU roofline."""
    read = lambda name: json.loads((assets / name).read_text())  # noqa: E731
    gpu = read("gpu_profile_published_llama31_8b.json")
    return [
        profile_costs(
            "Xeon (AMX)", read("rollout_throughput.json")["profiles"]["greedy"], timed_greedy=True
        ),
        profile_costs(
            "EPYC (AVX512-BF16)",
            read("rollout_throughput_epyc.json")["profiles"]["greedy"],
            timed_greedy=True,
        ),
        # float32 SmolLM2 on AVX2, drafts sampled (`grpo-specdec profile --draft-sampling
        # probabilistic`): the machine of the float32 demos (docs/benchmarks/demo.md)
        profile_costs("EPYC, no bf16 (float32, AVX2)", read("profile_epyc_no_bf16.json")),
        model_costs("Xeon, no bf16 (modelled)", XEON_NO_BF16),
        model_costs("GPU, Llama-3.1-8B (modelled)", profile_latency(gpu)),
    ]


class Oracle:
    """Knows each running request's acceptance near its position and each step's cost."""

    def __init__(self, costs: Costs, k_max: int, temperature: float):
        self.costs, self.k_max, self.temperature = costs, k_max, temperature

    def choose_step(self, world: World, index, position, contexts) -> int:
        tokens = world.true_tokens(index, position).sum(axis=0)
        context = float(contexts.mean())
        ms = [
            self.costs.step_ms(len(index), k, context, contexts, self.temperature, self.k_max)
            for k in range(self.k_max + 1)
        ]
        return int(np.argmax(tokens / np.array(ms)))


@dataclass
class Result:
    seconds: float
    tokens: int
    k_steps: dict[int, int] = field(default_factory=dict)


def replay(
    trace: Trace, costs: Costs, policy, k_max: int, seed: int = 0, rollouts: slice = slice(None)
) -> Result:
    """Replay `trace`'s rollouts one after another under `policy` (a Policy, a
    `GoodputController`, fed back as the scheduler feeds it, or an `Oracle`)."""
    rng = np.random.default_rng(seed)
    controller = policy if hasattr(policy, "drafts_verified") else None
    total_ms, tokens, k_steps = 0.0, 0, {}
    for rollout in trace.rollouts[rollouts]:
        world = World(rollout.requests, k_max)
        timing = NOISE.draws(rng)
        previous_k = None
        n = len(world.outputs)
        ids = np.array([f"r{i}" for i in range(n)])
        position = np.ones(n, dtype=np.int64)  # the prefill step makes each first token
        contexts = world.prompts + 1.0
        total_ms += costs.prefill_ms(float(world.prompts.sum()))
        if controller is not None:
            controller.restart()
            controller.forget([])
        running = np.flatnonzero(position < world.outputs)
        while len(running):
            batch = len(running)
            context = float(contexts[running].mean())
            if isinstance(policy, Oracle):
                k = policy.choose_step(world, running, position[running], contexts[running])
            else:
                k = int(policy.choose(batch, context, ids[running]))
            ms = costs.step_ms(batch, k, context, contexts[running], trace.temperature, k_max)
            total_ms += ms
            k_steps[k] = k_steps.get(k, 0) + 1
            accepted = np.minimum(world.run_at(running, position[running]), k)
            if controller is not None:
                if k:
                    before = position[running] <= world.eos[running]
                    for r, a, ok in zip(running, accepted, before):
                        controller.drafts_verified(ids[r], k, int(a), bool(ok))
                strayed = ms * math.exp(next(timing))  # the host strays every step
                # The scheduler times only a step whose k sized the drafts it verifies too
                # (a step that changes k verifies one k and drafts another).
                if previous_k == k:
                    controller.step_timed(batch, k, context, strayed)
            previous_k = k
            made = np.minimum(accepted + 1, world.outputs[running] - position[running])
            position[running] += made
            contexts[running] += made
            running = running[position[running] < world.outputs[running]]
        tokens += int(world.outputs.sum())
    return Result(total_ms / 1000.0, tokens, dict(sorted(k_steps.items())))


def ours(costs: Costs, k_max: int, max_batch: int, profiled: bool = True) -> GoodputController:
    return GoodputController(
        costs.model if profiled else None, AcceptanceEstimator(k_max), max_batch
    )


def run_case(trace: Trace, costs: Costs, k_max: int) -> dict[str, Result]:
    """Every policy on one trace and profile: fixed k = 0..k_max, the oracle, ours."""
    max_batch = max(len(ro.requests) for ro in trace.rollouts)
    out = {f"k={k}": replay(trace, costs, FixedPolicy(k), k_max) for k in range(k_max + 1)}
    out["oracle"] = replay(trace, costs, Oracle(costs, k_max, trace.temperature), k_max)
    out["ours"] = replay(trace, costs, ours(costs, k_max, max_batch), k_max)
    return out


def verdict(results: dict[str, Result]) -> dict[str, float]:
    """Ours against the best fixed k (k >= 1), k = 0 and the oracle, as throughput ratios."""
    ours_s = results["ours"].seconds
    best_fixed = min(
        r.seconds for name, r in results.items() if name.startswith("k=") and name != "k=0"
    )
    return {
        "vs best fixed k": best_fixed / ours_s,
        "vs k=0": results["k=0"].seconds / ours_s,
        "vs oracle": results["oracle"].seconds / ours_s,
    }


def no_profile_ratio(trace: Trace, costs: Costs, k_max: int, first_slower: float = 1.0) -> float:
    """Throughput of an engine started without a profile over a profiled one's, over the
    trace's rollouts after its first (which both ran first, each learning from it, with
    every step of it `first_slower` times dearer: see FIRST_ROLLOUT_SLOWER)."""
    max_batch = max(len(ro.requests) for ro in trace.rollouts)
    first = replace(costs, scale=tuple(first_slower * s for s in costs.scale))
    seconds = []
    for profiled in (True, False):
        controller = ours(costs, k_max, max_batch, profiled)
        replay(trace, first, controller, k_max, rollouts=slice(0, 1))
        seconds.append(replay(trace, costs, controller, k_max, rollouts=slice(1, None)).seconds)
    return seconds[0] / seconds[1]


# What a drafting step costs at T = 1 over what a greedy profile timed, against a k = 0 step:
# on the EPYC at B = 1, k = 1, 1.25x a k = 0 step measured and 1.10x profiled.
SAMPLED_DRAFTING = 1.25 / 1.10


def cases(traces: list[Trace], profiles: list[Costs]) -> list[tuple[Trace, Costs]]:
    """Every trace on every profile; on each CPU profile again with true costs 1.1x (k = 0)
    to 1.25x (k_max) what the profile says; and on each profile timed greedy again with every
    drafting step `SAMPLED_DRAFTING` times what it timed (modelled from one measured point)."""
    out = []
    for costs in profiles:
        out += [(trace, costs) for trace in traces]
        if "GPU" not in costs.name:
            dearer = replace(costs, name=f"{costs.name}, costs 1.1-1.25x", scale=(1.1, 1.25))
            out += [(trace, dearer) for trace in traces]
        if costs.timed_greedy:
            sampled = replace(
                costs,
                name=f"{costs.name}, drafts {SAMPLED_DRAFTING:.2f}x what greedy timed",
                drafting=SAMPLED_DRAFTING,
            )
            out += [(trace, sampled) for trace in traces]
    return out
