"""The rollout simulator (grpo_specdec/simulate.py) against every configuration measured by
benchmarks/rollout_throughput.py: predicted vs measured wall time, one row each.

    python benchmarks/simulator_validation.py      # rewrites docs/benchmarks/simulator.md

Runs that carry their own profiles (profile format >= 5, `profiles` in the run's JSON, e.g.
`rollout_throughput.py --fresh-profile`) are predicted from what a simulator user has: the
profile of the configuration's drafting (greedy or sampled) with the prefill and sampling
costs it timed, the acceptance per position the engine measured on that workload at fixed
k = k_max with the same drafting, and each repeat's output lengths; nothing is fitted.

Earlier runs (their profiles lack those costs) are predicted as before: the run's latency
model, its calibration acceptance (measured once at k_max on the policy's GRPO rollout) or
the one that reproduces the configuration's mean acceptance length, and the costs the
profile left out, fitted once on one trace and stated in the report.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import ASSETS, load_json, write_study
from benchmarks.rollout_throughput import OUTSIDE_PROMPTS, SHAPES, TAIL
from grpo_specdec.assets.smollm2 import default_dir
from grpo_specdec.simulate import (
    NONE_UNPROFILED,
    VLLM_EXAMPLE_TABLES,
    MeasuredSteps,
    Replay,
    UnprofiledCosts,
    Workload,
    drawn_replay,
    lengths_from_trace,
    replay,
)
from grpo_specdec.tasks.arithmetic import make_problems
from vllm_plugin.compat import dense_k_table
from vllm_plugin.controller import (
    NO_COST,
    FixedPolicy,
    FrozenAcceptance,
    GoodputPolicy,
    LatencyModel,
    PaperPolicy,
    profile_latency,
)

GOAL, LIMIT = 0.07, 0.15  # within GOAL for >= 90% of configurations, none beyond LIMIT
# The one trace the unprofiled costs are fitted on (its k = 0 decode steps).
CALIBRATION_RUN, CALIBRATION_SHAPE = "rollout_throughput_group", "untrained"
# The profiler times 16 steps after 4 warm-up steps at each k = 0..k_max: its contexts run
# from the prompt to prompt + 20 (k + 1) tokens, 35 beyond the prompt on average at k_max 5.
PROFILE_CONTEXT_BEYOND_PROMPT = 35.0
DRAWS = 16  # replays per repeat of a run with its own profiles, tokens drawn (`drawn_replay`)


@dataclass
class Measured:
    run: str
    section: str
    key: str
    config: str
    wall_s: float
    mal: float
    workload: Workload
    model: str  # which policy answered: "base" or "trained"


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_dir())


def prompt_tokens(prompts: list[str]) -> np.ndarray:
    """Token counts of user prompts through SmolLM2's chat template, as Engine.encode makes
    them."""
    tok = _tokenizer()
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    return np.array([len(tok.encode(t, add_special_tokens=False)) for t in texts], dtype=float)


def max_batch_of(args: dict) -> int:
    """The largest batch the run's controller priced (benchmarks/rollout_throughput.py)."""
    return max(engine_slots(args), len(OUTSIDE_PROMPTS))


def engine_slots(args: dict) -> int:
    """max_num_seqs of the run's engines as runs before commit 4a1f9bc sized them: by the
    batch sizes, GRPO shapes and tail shape only (a run of --batch-sizes 1 served the 8
    outside-the-task prompts one at a time). Later runs hold `max_batch_of` sequences."""
    shapes = [s for s in args["shapes"].split(",") if s]
    batch_sizes = [int(b) for b in args["batch_sizes"].split(",") if b]
    return max(
        [
            *batch_sizes,
            *(SHAPES[s][1] * SHAPES[s][2] for s in shapes if s != "tail"),
            *([len(TAIL.prompts)] if "tail" in shapes else []),
        ]
    )


def workload_of(section: str, key: str, args: dict) -> tuple[str, np.ndarray, float]:
    """(the policy that answered, per-request prompt lengths, temperature) of a workload,
    as benchmarks/rollout_throughput.py made it."""
    if section == "grpo":
        model, n_prompts, group, _ = SHAPES[key]
        prompts = [p.question for p in make_problems(n_prompts, seed=11, level=2)]
        return model, np.repeat(prompt_tokens(prompts), group), 1.0
    if section == "tail":
        return "base", prompt_tokens(TAIL.prompts), 1.0
    temp, b = key.split("/")
    questions = [p.question for p in make_problems(max_batch_of(args), seed=7, level=2)]
    prompts = (questions if section == "fixed" else OUTSIDE_PROMPTS)[: int(b)]
    return "base", prompt_tokens(prompts), float(temp)


def measured_configs(run: str, data: dict) -> list[Measured]:
    args = data["args"]
    rows = []
    for section, keyed in data["results"].items():
        for key, configs in keyed.items():
            model, prompt_lengths, temperature = workload_of(section, key, args)
            if section == "grpo":
                conditional = data["calibration_conditional_acceptance"][model]
                lengths = lengths_from_trace(data["traces"][key], conditional)
            else:
                lengths = np.full(len(prompt_lengths), float(args["tokens"]))
            workload = Workload(lengths, prompt_lengths, temperature)
            for config, v in configs.items():
                rows.append(
                    Measured(run, section, key, config, v["wall_s"], v["mal"], workload, model)
                )
    return rows


def setup_of(config: str, model: str, data: dict, latency: LatencyModel, conditional):
    """(policy, latency the steps cost, k_max, draft pass at k = 0) of a configuration, as
    benchmarks/rollout_throughput.py built it for the policy `model`. Acceptance-driven
    policies price k on `conditional`."""
    args, k_max = data["args"], data["k_max"]
    max_batch = max_batch_of(args)
    name = config.removeprefix("sampled ")
    if name in ("no spec", "k=0 (draft loaded)", "k=0, vLLM as shipped"):
        return FixedPolicy(0), latency, k_max, name == "k=0, vLLM as shipped"
    if name.startswith("k="):
        return FixedPolicy(int(name[2:])), latency, k_max, False
    if name == "static table":
        table = dense_k_table(data["static_tables"][model], max_batch, k_max)
        return table, latency, k_max, False
    if name.startswith("vLLM example table ("):
        table = VLLM_EXAMPLE_TABLES[name[len("vLLM example table (") : -1]]
        return dense_k_table(table, max_batch, k_max), latency, k_max, False
    if name == "paper rule":
        return PaperPolicy(latency.c_peak, k_max), latency, k_max, False
    if name in ("group", "group +history"):  # no draft model: its drafts cost nothing to make
        k_group = args["group_k_max"]
        free = LatencyModel(latency.target, NO_COST, latency.speculation)
        return (
            GoodputPolicy(latency, FrozenAcceptance(conditional[:k_group]), max_batch),
            free,
            k_group,
            False,
        )
    # ours, sampled ours, ours + group (+history): the goodput controller on the EAGLE engine
    return (
        GoodputPolicy(latency, FrozenAcceptance(conditional[:k_max]), max_batch),
        latency,
        k_max,
        False,
    )


def predict(m: Measured, data: dict, conditional, unprofiled: UnprofiledCosts) -> Replay:
    """The replay of a configuration; where the engine held fewer sequences than the
    workload has, one replay per wave of that many, back to back (exact for one slot)."""
    latency = profile_latency(data)
    policy, cost, k_max, shipped_k0 = setup_of(m.config, m.model, data, latency, conditional)
    w, slots = m.workload, engine_slots(data["args"])
    waves = [
        replay(
            cost,
            conditional,
            Workload(
                w.output_lengths[i : i + slots], w.prompt_lengths[i : i + slots], w.temperature
            ),
            policy,
            unprofiled,
            shipped_k0,
        )
        for i in range(0, len(w.output_lengths), slots)
    ]
    if len(waves) == 1:
        return waves[0]
    drafted = [r for r in waves if r.mal > 1]
    return Replay(
        makespan_s=sum(r.makespan_s for r in waves),
        tokens=sum(r.tokens for r in waves),
        tail_s=waves[-1].tail_s,
        mal=float(np.mean([r.mal for r in drafted])) if drafted else 1.0,
        steps=[],
    )


def extended(conditional, k: int) -> np.ndarray:
    """The acceptance vector to position k, its last value carried on."""
    c = np.asarray(conditional, dtype=float)
    return np.concatenate([c, np.full(max(0, k - len(c)), c[-1])])[: max(k, len(c))]


def mal_matched(m: Measured, data: dict, conditional, unprofiled: UnprofiledCosts):
    """The prediction with the calibration acceptance scaled (s * p_i, at most 1) so that the
    replay's mean acceptance length equals the configuration's measured one (bisection on s;
    a policy that never drafts keeps the calibration acceptance)."""
    lo, hi = 0.0, 1.0 / max(float(np.min(conditional)), 1e-3)
    best = predict(m, data, conditional, unprofiled)
    if m.mal <= 1.0 and best.mal <= 1.0:
        return best
    for _ in range(24):
        s = (lo + hi) / 2
        best = predict(m, data, np.minimum(s * conditional, 1.0), unprofiled)
        lo, hi = (s, hi) if best.mal < m.mal else (lo, s)
    return best


def fit_unprofiled(data: dict, shape: str) -> UnprofiledCosts:
    """The costs the profile lacks, from one trace: prefill per prompt token from its first
    step; least squares on its k = 0 decode steps of the step time beyond the profile's
    T(B) against B (sampling at T = 1) and against the tokens of context beyond the
    profile's (every running request has made as many tokens as steps have run, where
    k = 0)."""
    latency = profile_latency(data)
    trace = data["traces"][shape]
    _, n_prompts, group, _ = SHAPES[shape]
    prompts = prompt_tokens([p.question for p in make_problems(n_prompts, seed=11, level=2)])
    prompt = float(prompts.mean())
    reference = prompt + PROFILE_CONTEXT_BEYOND_PROMPT
    prefill_ms = 1000 * (trace[1][0] - trace[0][0])
    rows, excess = [], []
    for i in range(1, len(trace) - 1):  # step i lasts until step i + 1 starts
        _, b, k = trace[i]
        if k == 0:
            rows.append([b, b * max(prompt + i - reference, 0.0)])
            excess.append(1000 * (trace[i + 1][0] - trace[i][0]) - float(latency.step_ms(b, 0)))
    coef = np.linalg.lstsq(np.array(rows), np.array(excess), rcond=None)[0]
    return UnprofiledCosts(
        sampling_ms_per_token=float(max(coef[0], 0)),
        attention_ms_per_kv_token=float(max(coef[1], 0)),
        reference_context=reference,
        prefill_ms_per_token=prefill_ms / float(prompts.sum() * group),
    )


@dataclass
class Repeats:
    """A configuration of a run with profiles of its own: each repeat's wall time and
    workload, and the acceptance the engine measured on that workload."""

    run: str
    section: str
    key: str
    config: str
    wall_s: list[float]
    workloads: list[Workload]
    model: str
    workload_acceptance: np.ndarray  # at fixed k = k_max, the configuration's drafting
    own_acceptance: np.ndarray  # this configuration's own drafts

    @property
    def spread(self) -> float:
        """How far the repeats lie from their median, the largest of them, relative."""
        median = float(np.median(self.wall_s))
        return max(abs(w / median - 1) for w in self.wall_s)


def current_configs(run: str, data: dict) -> list[Repeats]:
    args, k_max = data["args"], data["k_max"]
    rows = []
    for section, keyed in data["results"].items():
        for key, configs in keyed.items():
            model, prompt_lengths, temperature = workload_of(section, key, args)
            for config, v in configs.items():
                source = "sampled " if config.startswith("sampled") else ""
                at_k_max = configs.get(f"{source}k={k_max}", {}).get("conditional_acceptance")
                own = v.get("conditional_acceptance", at_k_max)
                at_k_max = at_k_max or own or [0.0] * k_max  # none drafted: any will do
                lengths = v.get("lengths_runs") or [
                    [float(args["tokens"])] * len(prompt_lengths)
                ] * len(v["wall_s_runs"])
                workloads = [
                    Workload(np.array(n, dtype=float), prompt_lengths, temperature) for n in lengths
                ]
                rows.append(
                    Repeats(
                        run,
                        section,
                        key,
                        config,
                        v["wall_s_runs"],
                        workloads,
                        model,
                        np.asarray(at_k_max, dtype=float),
                        np.asarray(own or at_k_max, dtype=float),
                    )
                )
    return rows


def predict_repeats(
    r: Repeats, data: dict, conditional: np.ndarray, draws: int = DRAWS
) -> np.ndarray:
    """Each repeat's predicted makespan, from the profile of the configuration's drafting
    and the costs that profile timed: the mean of `draws` replays with tokens drawn from
    `conditional` (0: one replay of the expected tokens). Each step is priced by the
    profile's timed steps (interpolated), not by the latency model the controller decides
    with."""
    profile = data["profiles"]["probabilistic" if r.config.startswith("sampled") else "greedy"]
    latency = profile_latency(profile)
    costs = UnprofiledCosts(**(profile.get("unprofiled") or {}))
    policy, cost, _, shipped_k0 = setup_of(r.config, r.model, data, latency, conditional)
    # group drafts cost nothing to make: the timed steps less the fitted draft pass
    steps = replace(
        MeasuredSteps.from_profile(profile),
        less_draft=latency.draft if cost.draft == NO_COST else NO_COST,
    )
    args = (cost, conditional)
    later = (policy, costs, shipped_k0, steps)
    return np.array(
        [
            (
                drawn_replay(draws, *args, w, *later) if draws else replay(*args, w, *later)
            ).makespan_s
            for w in r.workloads
        ]
    )


def verdict(errors: list) -> str:
    e = np.abs([x for x in errors if x is not None])
    return (
        f"{(e <= GOAL).mean():.0%} of {len(e)} within ±{GOAL:.0%} (goal ≥ 90%), "
        f"{(e > LIMIT).sum()} beyond ±{LIMIT:.0%} (goal 0), worst {e.max():+.1%}"
    )


def current_report(runs: dict[str, dict]) -> str:
    rows = []
    still = {}  # per configuration: its repeats and its no-spec's all within GOAL
    for run, data in runs.items():
        configs = current_configs(run, data)
        predicted = {id(r): predict_repeats(r, data, r.workload_acceptance) for r in configs}
        expected = {id(r): predict_repeats(r, data, r.workload_acceptance, 0) for r in configs}
        base = {(r.section, r.key): r for r in configs if r.config == "no spec"}
        for r in configs:
            measured, at_k_max = float(np.median(r.wall_s)), float(np.median(predicted[id(r)]))
            own = float(np.median(predict_repeats(r, data, r.own_acceptance)))
            # Against no speculation in the same repeat (configurations run interleaved).
            plain = base[(r.section, r.key)]
            speedup = float(np.median(np.divide(plain.wall_s, r.wall_s)))
            modelled = float(np.median(predicted[id(plain)] / predicted[id(r)]))
            by_expectation = float(np.median(expected[id(plain)] / expected[id(r)]))
            rows.append(
                (r, measured, at_k_max / measured - 1, own / measured - 1, at_k_max)
                + (
                    (speedup, modelled, modelled / speedup - 1, by_expectation / speedup - 1)
                    if r is not plain
                    else (None,) * 4
                )
            )
            still[id(r)] = max(r.spread, plain.spread) <= GOAL
    spread = np.array([r.spread for r, *_ in rows])
    held = [row[7] for row in rows if still[id(row[0])]]
    by_run = [
        f"{run}: {verdict([row[7] for row in rows if row[0].run == run])}; the measurement "
        f"against itself {np.mean([row[0].spread <= GOAL for row in rows if row[0].run == run]):.0%}"
        for run in runs
    ]
    created = {
        f"{run} ({name})": p.get("created")
        for run, d in runs.items()
        for name, p in d["profiles"].items()
    }
    lines = [
        "### Runs with their own profiles",
        "",
        "Runs of `benchmarks/rollout_throughput.py --fresh-profile` ("
        + ", ".join(f"`{n}`" for n in runs)
        + "): the latency profiles were measured at the start of the run (profile format 5; "
        + "; ".join(f"{n} at {c}" for n, c in created.items())
        + "). Each configuration is predicted from the profile of its drafting (greedy or sampled) "
        "with the prefill and T = 1 sampling costs that profile timed; each step is priced by the "
        "profile's timed steps (interpolated in B, and in k and B for the long-context cost), not by "
        "the latency model the controller decides with; and from the acceptance per "
        "position the engine measured on the same workload with the same drafting at fixed "
        "k = k_max ('workload acceptance'), or on this configuration's own drafts ('own'). Each "
        f"repeat is replayed {DRAWS} times with its own output lengths, each request's tokens in "
        "a step drawn from that acceptance (`grpo_specdec.simulate.drawn_replay`), and "
        "predicted by their mean; predicted and measured are each the "
        "median over repeats. Nothing is fitted to these runs. 'vs no spec': the speedup over "
        "no speculation, measured (each repeat against no speculation's run next to it) and "
        "predicted, and how far the prediction is off.",
        "",
        f"- wall time, workload acceptance: {verdict([row[2] for row in rows])}.",
        f"- wall time, own acceptance: {verdict([row[3] for row in rows])}.",
        f"- speedup over no speculation, workload acceptance: {verdict([row[7] for row in rows])}.",
        "- the same speedups from one replay of the expected tokens per step instead of drawn "
        f"ones: {verdict([row[8] for row in rows])}.",
        f"- the measurement against itself: {(spread <= GOAL).mean():.0%} of {len(rows)} "
        f"configurations have every repeat within ±{GOAL:.0%} of their median; the largest "
        f"spread is ±{spread.max():.1%}.",
        "- the speedups of the configurations whose measurement held still (every repeat of "
        f"theirs and of no speculation's within ±{GOAL:.0%} of the median): "
        + (verdict(held) if held else "none")
        + ".",
        "- by run, speedups: " + "; ".join(by_run) + ".",
        "",
        "| run | workload | config | measured s | repeats within | predicted s | error "
        "| error, own acceptance | vs no spec: measured | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, measured, err, own_err, predicted, speedup, modelled, speedup_err, _ in rows:
        ratios = (
            f"{speedup:.2f}x | {modelled:.2f}x | {speedup_err:+.1%}"
            if speedup is not None
            else "— | — | —"
        )
        lines.append(
            f"| {r.run} | {r.section} {r.key} | {r.config} | {measured:.2f} | ±{r.spread:.1%} | "
            f"{predicted:.2f} | {err:+.1%} | {own_err:+.1%} | {ratios} |"
        )
    return "\n".join(lines)


def report(rows: list[tuple], unprofiled: UnprofiledCosts) -> str:
    def err(pred, meas):
        return pred / meas - 1

    calib = [err(r[5], r[4]) if r[5] is not None else None for r in rows]
    matched = [err(r[6], r[4]) for r in rows]
    raw = [err(r[7], r[4]) if r[7] is not None else None for r in rows]
    lines = [
        "### Earlier runs (profile formats 3-4)",
        "",
        "Every configuration of the earlier runs of "
        "`benchmarks/rollout_throughput.py` (docs/assets/rollout_throughput*.json), each from "
        "that run's own latency model and the configuration's own policy.",
        "",
        "- **A. calibration acceptance**: the run's `calibration_conditional_acceptance` "
        "(measured once at k_max on that policy's GRPO rollout). Not defined for drafts "
        "from the group's text or sampled drafts (no per-position acceptance of theirs is "
        "stored): '—'.",
        "- **B. MAL-matched**: that acceptance scaled so the replay's mean acceptance "
        "length equals the configuration's measured one.",
        "- **profile only**: A without the unprofiled costs below.",
        "",
        "Unprofiled costs (one fit, on the k = 0 decode steps of the `ours` trace of "
        f"`{CALIBRATION_RUN}` / `{CALIBRATION_SHAPE}`, applied to every run): sampling at T = 1 "
        f"{unprofiled.sampling_ms_per_token * 1000:.1f} µs per verified token; attention "
        f"{unprofiled.attention_ms_per_kv_token * 1e6:.0f} ns per query token per context token beyond "
        f"{unprofiled.reference_context:.0f} (the profile's mean context); prefill "
        f"{unprofiled.prefill_ms_per_token * 1000:.0f} µs per prompt token (its first step). "
        "That trace's own "
        "configuration (`ours`) is in-sample.",
        "",
        f"- A: {verdict(calib)}.",
        f"- B: {verdict(matched)}.",
        f"- profile only: {verdict(raw)}.",
        "",
        "| run | workload | config | measured s | A s | A err | B s | B err | profile only err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, a, b, p in zip(rows, calib, matched, raw, strict=True):
        run, section, key, config, meas, pa, pb, _ = r
        lines.append(
            f"| {run.removeprefix('rollout_throughput').strip('_') or 'main'} | {section} {key} | "
            f"{config} | {meas:.2f} | "
            + (f"{pa:.2f} | {a:+.1%}" if pa is not None else "— | —")
            + f" | {pb:.2f} | {b:+.1%} | "
            + (f"{p:+.1%}" if p is not None else "—")
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    stored = {p.stem: load_json(p) for p in sorted(ASSETS.glob("rollout_*.json"))}
    current = {run: data for run, data in stored.items() if "profiles" in data}
    runs = {
        run: data
        for run, data in stored.items()
        if run.startswith("rollout_throughput") and run not in current
    }
    unprofiled = fit_unprofiled(runs[CALIBRATION_RUN], CALIBRATION_SHAPE)
    rows = []
    for run, data in runs.items():
        for m in measured_configs(run, data):
            has_calibration = not (m.config.startswith(("group", "sampled")))
            conditional = extended(
                data["calibration_conditional_acceptance"][m.model],
                data["args"].get("group_k_max", 0) if m.config.startswith("group") else 0,
            )
            a = predict(m, data, conditional, unprofiled).makespan_s if has_calibration else None
            b = mal_matched(m, data, conditional, unprofiled).makespan_s
            raw = (
                predict(m, data, conditional, NONE_UNPROFILED).makespan_s
                if has_calibration
                else None
            )
            rows.append((run, m.section, m.key, m.config, m.wall_s, a, b, raw))
    text = (
        "Predicted wall time of every configuration measured by "
        "`benchmarks/rollout_throughput.py`, from that run's profile and the configuration's "
        "own policy. Earlier runs are predicted by deterministic expectations (one replay, "
        "E[tokens | k] per step).\n\n"
        + (current_report(current) + "\n\n" if current else "")
        + report(rows, unprofiled)
    )
    write_study(
        "simulator",
        "Rollout simulator vs the measured runs (SmolLM2-135M, CPU)",
        text,
        "simulator_validation.py",
    )
    print(text)


if __name__ == "__main__":
    main()
