"""Rollout throughput on SmolLM2-135M: no speculation, k = 0 with the draft loaded (with
the plugin's free-k=0 patch and as vLLM ships it), fixed k, vLLM's static batch-size table,
the paper's rule and our controller, measured side by side in one run.

    python benchmarks/rollout_throughput.py            # or: make bench

Workloads:
- fixed concurrency B = 1..64, greedy and T=1: each request exactly --tokens tokens, on the
  head's own task (arithmetic questions) and, at B = 1 and 8, on prompts outside it;
- GRPO-shaped rollouts at T=1 (P prompts x G samples, natural stop, so concurrency
  decays as sequences finish): `untrained` (SmolLM2 as shipped, 8 x 8, max 256 tokens),
  `trained` (the policy after --trained-iterations of `grpo-specdec train` at
  --trained-lr, with the head it learnt online; trained here if absent) and `long` (4 x
  16, max 512 tokens);
- the tail shape (`benchmarks/tail_shape.py`: 8 mixed-level prompts x 8 samples, each its
  own request with its own length budget under a 1024 cap), where the last tenth of the
  requests take a quarter of the no-speculation wall time: its makespan and its tail phase
  (after 90% of the requests finished) are reported apart.
One speculative engine per policy serves every speculative configuration (the
scheduler's k source is switched between runs); a plain engine with no draft is the
baseline. Configurations are interleaved and repeated; each keeps its own acceptance
estimator and starts every run from an empty prefix cache.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import (
    ASSETS,
    load_json,
    protocol_args,
    quiet_machine,
    smollm2,
    smollm2_head,
    smollm2_profile,
    trained_policy,
    write_study,
)
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings
from grpo_specdec.measure import run_protocol, speedup
from grpo_specdec.simulate import VLLM_EXAMPLE_TABLES, recommend_table
from grpo_specdec.tasks.arithmetic import make_problems
from grpo_specdec.tasks.tail_shape import in_flight, tail_phase_s, tail_shape, tokens_after_eos
from grpo_specdec.vllm_compat import dense_k_table
from vllm_plugin.controller import (
    AcceptanceEstimator,
    FixedPolicy,
    GoodputPolicy,
    LatencyModel,
    PaperPolicy,
    conditional_from_cumulative,
    profile_latency,
)
from vllm_plugin.patches import free_k0_v0_32
from vllm_plugin.settings import hardware_name

# GRPO shapes: which policy answers, prompts x group, token cap.
SHAPES = {
    "untrained": ("base", 8, 8, 256),
    "trained": ("trained", 8, 8, 256),
    "long": ("base", 4, 16, 512),
}
TAIL = tail_shape()  # the tail shape's defaults: 8 x 8 requests, budgets under a 1024 cap
TAIL_FRACTION = 0.1  # the tail phase: after all but this share of the requests finished
VLLM_EXAMPLE_TABLES_NAMES = [f"vLLM example table ({n})" for n in VLLM_EXAMPLE_TABLES]
FEW_IN_FLIGHT = 8  # "few sequences in flight": B at or below this
# Prompts unlike the head's training task (arithmetic word problems).
OUTSIDE_PROMPTS = [
    "Write a short poem about the sea at night.",
    "Explain why the sky is blue to a ten-year-old.",
    "List five tips for keeping a houseplant alive.",
    "Describe the plot of a detective story set in a small village.",
    "What are the main differences between a cat and a dog as pets?",
    "Give me a recipe for a simple vegetable soup.",
    "Summarise the benefits of regular exercise in a paragraph.",
    "Write a polite email declining a meeting invitation.",
]


@dataclass
class Config:
    """One compared configuration: its engine and, on the speculative engine, where k
    comes from and the acceptance estimator that only this configuration's runs feed."""

    engine: Engine
    policy: object = None  # a Policy, or vLLM's dense batch-size -> k list
    acceptance: AcceptanceEstimator | None = None
    free_k0: bool = True  # False: steps with k = 0 run the draft pass, as vLLM ships it
    group: bool = False  # the engine drafts from the group's text; its state is reset per run
    with_history: bool = False  # ... and starts each run from an earlier rollout's answers


def run(engine: Engine, prompts: list[str], sampling: SamplingSettings, per_request) -> dict:
    res = engine.generate(prompts, sampling, **per_request)
    answers = [s.token_ids for group in res.outputs for s in group]
    return {
        "wall_s": res.wall_s,
        "tokens": res.num_generated_tokens,
        "tokens_after_eos": tokens_after_eos(answers, engine.tokenizer.eos_token_id),
        "mean_acceptance_length": res.spec["mean_acceptance_length"],
        **({"mal_before_eos": 1.0} if not res.spec["drafts"] else {}),  # nothing verified
        "per_position_acceptance": res.spec.get("per_position_acceptance", []),
        "scheduled_s": res.scheduled_s,
        "finished_s": res.finished_s,
        "lengths": [[len(s.token_ids) for s in group] for group in res.outputs],
    }


def replay_lengths(plain: Engine, workload: tuple, endings: dict) -> tuple:
    """The tail workload with each request's length fixed to what a seeded rollout with no
    speculation gave it (EOS or its budget): every configuration then makes exactly those
    tokens, so makespans compare equal work. A speculative engine on CPU cannot follow
    per-request seeds, so without this each configuration's answers, and the few longest
    ones that set the makespan, would differ by chance (one run: the longest answer 780 to
    1024 tokens across configurations). `endings` gets how the reference answers ended."""
    section, key, policy, prompts, sampling, per_request = workload
    plain.llm.reset_prefix_cache()
    reference = plain.generate(prompts, sampling, **per_request)
    lengths = [len(group[0].token_ids) for group in reference.outputs]
    for group in reference.outputs:
        ending = "eos" if group[0].finish_reason == "stop" else "budget"
        endings[ending] = endings.get(ending, 0) + 1
    exact = sampling.model_copy(update={"ignore_eos": True})
    return section, key, policy, prompts, exact, {**per_request, "max_tokens": lengths}


def run_config(
    config: Config,
    prompts: list[str],
    sampling: SamplingSettings,
    history=None,
    per_request: dict | None = None,
) -> dict:
    """One run from this configuration's own state: its policy and estimator in the
    scheduler, an empty prefix cache (no run reuses another's prefill), and for group
    drafts an empty history (or, with_history, the answers of `history` only).
    `per_request`: Engine.generate's per-prompt seeds and max_tokens."""
    per_request = per_request or {}
    config.engine.llm.reset_prefix_cache()
    if config.group:
        config.engine.group_draft_reset()
        if config.with_history and history is not None:
            config.engine.group_draft_add_history(history)
    if config.policy is None:
        out = run(config.engine, prompts, sampling, per_request)
    else:
        scheduler = config.engine.scheduler()
        scheduler.set_policy(config.policy, config.acceptance)
        mark, before_eos = scheduler.steps_scheduled, Counter(scheduler.verified_before_eos)
        free_k0_v0_32.ENABLED = config.free_k0
        try:
            out = run(config.engine, prompts, sampling, per_request)
        finally:
            free_k0_v0_32.ENABLED = True
        out["trace"] = [(t, b, k) for t, b, k, _ in scheduler.steps_since(mark)]
        verified = scheduler.verified_before_eos - before_eos
        out["mal_before_eos"] = (
            1 + verified["accepted"] / verified["drafts"] if verified["drafts"] else 1.0
        )
    if config.group:
        out["group"] = config.engine.group_draft_stats()["sources"]
    return out


def group_configs(
    group_only: Engine, hybrid: Engine, latency: LatencyModel, max_batch: int
) -> dict[str, Config]:
    """Drafts from the group's text: alone (no draft model; vLLM's model-free ngram host),
    and next to the EAGLE head under our controller, each with its own estimator."""
    scheduler = hybrid.scheduler()

    def hybrid_config(with_history: bool) -> Config:
        ours = scheduler.new_acceptance()
        return Config(
            hybrid,
            GoodputPolicy(latency, ours, max_batch),
            ours,
            group=True,
            with_history=with_history,
        )

    return {
        "group": Config(group_only, group=True),
        "group +history": Config(group_only, group=True, with_history=True),
        "ours + group": hybrid_config(False),
        "ours + group +history": hybrid_config(True),
    }


def sampled_configs(
    sampled: Engine,
    sampled_hybrid: Engine | None,
    latency: LatencyModel,
    k_max: int,
    max_batch: int,
) -> dict[str, Config]:
    """The same head drafting by sampling (q handed to verification): fixed k and ours,
    each with its own estimator, priced on the profile of sampled drafting; and ours next
    to drafts from the group's text (verified one-hot)."""
    scheduler = sampled.scheduler()
    ours = scheduler.new_acceptance()
    configs = {
        **{
            f"sampled k={k}": Config(sampled, FixedPolicy(k), scheduler.new_acceptance())
            for k in range(1, k_max + 1)
        },
        "sampled ours": Config(sampled, GoodputPolicy(latency, ours, max_batch), ours),
    }
    if sampled_hybrid is not None:
        ours = sampled_hybrid.scheduler().new_acceptance()
        policy = GoodputPolicy(latency, ours, max_batch)
        configs["sampled ours + group"] = Config(sampled_hybrid, policy, ours, group=True)
    return configs


def named_configs(only: str, known: list[str]) -> tuple[list[str], list[str]]:
    """(known, unknown) names in the comma-separated `only`, where a name may hold a comma
    itself ("k=0, vLLM as shipped"): the longest run of pieces that is a known name wins."""
    parts, picked, unknown, i = only.split(","), [], [], 0
    while i < len(parts):
        j = next(
            (j for j in range(len(parts), i, -1) if ",".join(parts[i:j]).strip() in known), None
        )
        if j is None:
            unknown.append(parts[i].strip())
            i += 1
        else:
            picked.append(",".join(parts[i:j]).strip())
            i = j
    return picked, unknown


def mean_conditional(per_position: list[list[float]]) -> list[float]:
    """The conditional acceptance per position, averaged over runs, from each run's
    per-position acceptance; a run whose drafts never reached a position (a policy that
    chose a smaller k that time) leaves it to the runs that did."""
    conditional = [conditional_from_cumulative(c) for c in per_position]
    return [
        statistics.fmean(c[i] for c in conditional if i < len(c))
        for i in range(max(len(c) for c in conditional))
    ]


def few_in_flight_share(trace: list) -> float:
    """Share of the rollout's wall time spent in steps with at most FEW_IN_FLIGHT running."""
    if len(trace) < 2:
        return 0.0
    t = np.array([x[0] for x in trace])
    b = np.array([x[1] for x in trace])
    dt = np.diff(t)
    return float(dt[b[:-1] <= FEW_IN_FLIGHT].sum() / dt.sum())


def compared_configs(
    plain: Engine, spec: Engine, latency: LatencyModel, table, k_max: int, max_batch: int
) -> dict[str, Config]:
    scheduler = spec.scheduler()

    def on_spec(policy, acceptance=None) -> Config:
        return Config(spec, policy, acceptance or scheduler.new_acceptance())

    ours = scheduler.new_acceptance()
    return {
        "no spec": Config(plain),
        "k=0 (draft loaded)": on_spec(FixedPolicy(0)),
        "k=0, vLLM as shipped": Config(spec, FixedPolicy(0), scheduler.new_acceptance(), False),
        **{f"k={k}": on_spec(FixedPolicy(k)) for k in range(1, k_max + 1)},
        "static table": on_spec(dense_k_table(table, max_batch, k_max)),
        **{
            label: on_spec(dense_k_table(example, max_batch, k_max))
            for label, example in zip(
                VLLM_EXAMPLE_TABLES_NAMES, VLLM_EXAMPLE_TABLES.values(), strict=True
            )
        },
        "paper rule": on_spec(PaperPolicy(latency.c_peak, k_max)),
        "ours": on_spec(GoodputPolicy(latency, ours, max_batch), ours),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--temperatures", default="0,1", help="fixed-concurrency workloads")
    ap.add_argument(
        "--tokens", type=int, default=64, help="tokens per request, fixed-concurrency workload"
    )
    ap.add_argument(
        "--shapes", default=",".join([*SHAPES, "tail"]), help="GRPO shapes to run (and `tail`)"
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated configurations to run (no spec always runs); default: all",
    )
    ap.add_argument(
        "--outside",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the prompts outside the head's training task, at B = 1 and all of them",
    )
    ap.add_argument("--trained-iterations", type=int, default=12)
    ap.add_argument("--trained-lr", type=float, default=1e-4)
    ap.add_argument(
        "--group",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compare drafts from the group's text (alone and with EAGLE)",
    )
    ap.add_argument("--group-k-max", type=int, default=8, help="longest group-only draft")
    ap.add_argument(
        "--sampled",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also compare the head drafting by sampling (draft_sampling: probabilistic)",
    )
    ap.add_argument(
        "--head", default=None, help="the SmolLM2 policy's head (default: the bootstrapped one)"
    )
    ap.add_argument(
        "--study",
        default="rollout_throughput",
        help="the study file to rewrite (docs/benchmarks/STUDY.md); also names its files in "
        "docs/assets",
    )
    ap.add_argument("--note", default="", help="a paragraph on what this run is for")
    ap.add_argument(
        "--fresh-profile",
        action="store_true",
        help="measure the latency profiles now, not from the store: the run and its profile "
        "see the machine in the same state (benchmarks/simulator_validation.py)",
    )
    protocol_args(ap)
    args = ap.parse_args()
    machine = quiet_machine(args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES and s != "tail"]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {[*SHAPES, 'tail']}")
    grpo_shapes = [s for s in shapes if s != "tail"]

    target = smollm2()
    # Every head of the default's architecture and vocabulary size costs the same.
    fresh = args.fresh_profile
    profile_path = smollm2_profile(target, smollm2_head(target), args.k_max, fresh=fresh)
    profiles = {"greedy": load_json(profile_path)}
    latency = profile_latency(profiles["greedy"])
    if args.sampled:
        sampled_profile = smollm2_profile(
            target, smollm2_head(target), args.k_max, "probabilistic", fresh=fresh
        )
        profiles["probabilistic"] = load_json(sampled_profile)
        sampled_latency = profile_latency(profiles["probabilistic"])
    models = {"base": (target, args.head or smollm2_head(target))}
    if any(SHAPES[s][0] == "trained" for s in grpo_shapes):
        models["trained"] = trained_policy(args.trained_iterations, args.trained_lr)
    max_batch = max(
        [
            *batch_sizes,
            *([len(OUTSIDE_PROMPTS)] if args.outside else []),
            *(SHAPES[s][1] * SHAPES[s][2] for s in grpo_shapes),
            *([len(TAIL.prompts)] if "tail" in shapes else []),
        ]
    )

    # Workloads: (section, key, policy, prompts, sampling, per-request settings).
    questions = [p.question for p in make_problems(max_batch, seed=7, level=2)]
    workloads = []
    for temp in temperatures:
        for b in batch_sizes:
            sampling = SamplingSettings(max_tokens=args.tokens, ignore_eos=True, temperature=temp)
            workloads.append(("fixed", f"{temp:g}/{b}", "base", questions[:b], sampling, {}))
        for b in (1, len(OUTSIDE_PROMPTS)) if args.outside else ():
            sampling = SamplingSettings(max_tokens=args.tokens, ignore_eos=True, temperature=temp)
            workloads.append(
                ("outside", f"{temp:g}/{b}", "base", OUTSIDE_PROMPTS[:b], sampling, {})
            )
    for shape in grpo_shapes:
        policy, n_prompts, group, cap = SHAPES[shape]
        prompts = [p.question for p in make_problems(n_prompts, seed=11, level=2)]
        sampling = SamplingSettings(n=group, temperature=1.0, max_tokens=cap)
        workloads.append(("grpo", shape, policy, prompts, sampling, {}))
    if "tail" in shapes:
        sampling = SamplingSettings(temperature=1.0, max_tokens=TAIL.cap)
        budgets = {"seeds": TAIL.seeds, "max_tokens": TAIL.max_tokens}
        workloads.append(("tail", "tail", "base", TAIL.prompts, sampling, budgets))

    # One policy at a time (its engines, then the next policy's): every configuration of a
    # workload still runs side by side, interleaved, in each repeat.
    results: dict[str, dict[str, dict[str, list[dict]]]] = {}
    orders: dict[str, list[list[str]]] = {}
    tables, calibration = {}, {}
    tail_endings: dict[str, int] = {}
    for name, (model, draft) in models.items():
        own_workloads = [w for w in workloads if w[2] == name]
        if not own_workloads:
            continue
        common = dict(
            model=model, max_model_len=1024, max_num_seqs=max_batch, kv_cache_gib=1.5, seed=0
        )
        scheduling = {}
        if any(w[0] == "tail" for w in own_workloads):
            common["max_model_len"] = TAIL.cap + 256
            # vLLM 0.32 on CPU fails a seeded request whose prefill is split over steps:
            # every engine schedules the tail shape's prefills in one step.
            scheduling["max_num_batched_tokens"] = len(TAIL.prompts) * 256
        controller = {"policy": "goodput", "profile": str(profile_path)}
        with_group = {**controller, "group": {"enabled": True}}

        def engine(common=common, scheduling=scheduling, **speculative) -> Engine:
            spec_cfg = speculative or None
            return Engine(EngineConfig(**common, speculative=spec_cfg), **scheduling)

        eagle = {"draft": draft, "k": args.k_max, "concurrency_aware": True}
        plain = engine()
        spec = engine(**eagle, controller=controller)
        engines = [plain, spec]
        own_workloads = [
            replay_lengths(plain, w, tail_endings) if w[0] == "tail" else w for w in own_workloads
        ]
        if args.group:
            group_only = engine(draft=None, k=args.group_k_max, controller=with_group)
            hybrid = engine(**eagle, controller=with_group)
            engines += [group_only, hybrid]
        if args.sampled:
            sampled_controller = {"policy": "goodput", "profile": str(sampled_profile)}
            sampled = engine(**eagle, draft_sampling="probabilistic", controller=sampled_controller)
            engines.append(sampled)
            sampled_hybrid = None
            if args.group:
                sampled_hybrid = engine(
                    **eagle,
                    draft_sampling="probabilistic",
                    controller={**sampled_controller, "group": {"enabled": True}},
                )
                engines.append(sampled_hybrid)
        # Calibrate the static table the way a user would: measure acceptance once at
        # k_max, on this policy's own GRPO-shaped rollout.
        spec.scheduler().set_policy(FixedPolicy(args.k_max))
        own = [w for w in own_workloads if w[0] in ("grpo", "tail")]
        calib_prompts, calib_sampling, calib_per_request = (
            own[0][3:]
            if own
            else (questions[:8], SamplingSettings(n=8, temperature=1.0, max_tokens=256), {})
        )
        measured = spec.generate(calib_prompts, calib_sampling, **calib_per_request).spec
        conditional = conditional_from_cumulative(measured["per_position_acceptance"])
        calibration[name] = conditional.tolist()
        tables[name] = recommend_table(latency, conditional, args.k_max, max_batch)
        configs = compared_configs(plain, spec, latency, tables[name], args.k_max, max_batch)
        if args.group:
            configs.update(group_configs(group_only, hybrid, latency, max_batch))
        if args.sampled:
            configs.update(
                sampled_configs(sampled, sampled_hybrid, sampled_latency, args.k_max, max_batch)
            )
        if args.only:
            keep, unknown = named_configs(args.only, list(configs))
            if unknown:
                ap.error(f"--only: unknown {unknown}; known: {list(configs)}")
            configs = {n: c for n, c in configs.items() if n in {"no spec", *keep}}
        # "+history": the answers of an earlier rollout of the same prompts by this policy
        # (as in a GRPO epoch that comes back to them), made once with no speculation.
        history = {
            (section, key): plain.generate(prompts, sampling, **per_request)
            for section, key, _, prompts, sampling, per_request in own_workloads
            if section in ("grpo", "tail")
            and args.group
            and any(c.with_history for c in configs.values())
        }
        # The protocol (grpo_specdec/measure.py), per workload: every configuration warmed
        # on it, then --repeats rounds in a seeded shuffled order.
        for w, (section, key, _, prompts, sampling, per_request) in enumerate(own_workloads):
            past = history.get((section, key))
            timed = run_protocol(
                {
                    cname: functools.partial(
                        run_config, config, prompts, sampling, past, per_request
                    )
                    for cname, config in configs.items()
                },
                repeats=args.repeats,
                seed=args.order_seed + w,
                progress=functools.partial(print, f"{name} {section} {key}:", flush=True),
            )
            for cname, runs in timed.runs.items():
                for out, busy in zip(runs, timed.busy[cname], strict=True):
                    out["others_cpu_share"] = busy
            results.setdefault(section, {})[key] = timed.runs
            orders[f"{section}/{key}"] = timed.orders
        for e in engines:
            e.shutdown()

    def summary(runs: list[dict]) -> dict:
        out = {
            "tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "mal": statistics.median(r["mean_acceptance_length"] for r in runs),
            # Each repeat, for the simulator's validation: its wall time, and (where lengths
            # vary) every request's output length; the conditional acceptance per position.
            "wall_s_runs": [r["wall_s"] for r in runs],
            "s_per_token_runs": [r["wall_s"] / r["tokens"] for r in runs],
            "makespan_s_runs": [max(r["finished_s"]) for r in runs],
            "others_cpu_share": [r.get("others_cpu_share") for r in runs],
            "tokens_after_eos": statistics.median(r["tokens_after_eos"] for r in runs),
        }
        if all("mal_before_eos" in r for r in runs):
            out["mal_before_eos"] = statistics.median(r["mal_before_eos"] for r in runs)
        if any(len({n for group in r["lengths"] for n in group}) > 1 for r in runs):
            out["lengths_runs"] = [[n for group in r["lengths"] for n in group] for r in runs]
        drafted = [r["per_position_acceptance"] for r in runs if r["per_position_acceptance"]]
        if drafted and runs[-1]["mean_acceptance_length"] > 1.0:
            out["conditional_acceptance"] = mean_conditional(drafted)
        if "group" in runs[-1]:
            for source in runs[-1]["group"]:
                for what in ("draft_tokens", "accepted_tokens"):
                    out[f"{source}_{what}"] = statistics.median(
                        r["group"][source][what] for r in runs
                    )
        if "trace" in runs[-1]:
            out["few_in_flight_share"] = statistics.median(
                few_in_flight_share(r["trace"]) for r in runs
            )
        out["makespan_s"] = statistics.median(max(r["finished_s"]) for r in runs)
        out["tail_s"] = statistics.median(
            tail_phase_s(r["finished_s"], TAIL_FRACTION) for r in runs
        )
        return out

    report_data = {
        "hardware": hardware_name(),
        "k_max": args.k_max,
        "c_peak": latency.c_peak,
        "latency": latency.to_dict(),
        # Each profile the run priced on (greedy, and sampled drafting with --sampled): its
        # latency model, the costs it timed for the simulator, its timed steps (the
        # simulator's validation prices each replayed step by them), when it was measured.
        "profiles": {
            name: {f: p.get(f) for f in ("latency", "unprofiled", "measurements", "created")}
            for name, p in profiles.items()
        },
        "static_tables": tables,
        "calibration_conditional_acceptance": calibration,
        "trained_policy": models.get("trained"),
        "results": {
            section: {
                key: with_speedups(section, {n: summary(r) for n, r in per.items()})
                for key, per in keyed.items()
            }
            for section, keyed in results.items()
        },
        "orders": orders,
        "machine": machine,
        "traces": {
            key: per["ours"][-1]["trace"]
            for section in ("grpo", "tail")
            for key, per in results.get(section, {}).items()
            if "ours" in per
        },
        # The tail shape's requests, each (first scheduled, last token), in each
        # configuration's last run: B over time.
        "tail_timelines": {
            n: list(zip(r[-1]["scheduled_s"], r[-1]["finished_s"], strict=True))
            for n, r in results.get("tail", {}).get("tail", {}).items()
        },
        "tail_reference_endings": tail_endings,
        "tail_lengths": {
            n: [group[0] for group in r[-1]["lengths"]]
            for n, r in results.get("tail", {}).get("tail", {}).items()
        },
        "args": vars(args),
        "command": shlex.join(["python", "benchmarks/rollout_throughput.py", *sys.argv[1:]]),
    }
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / f"{args.study}.json").write_text(json.dumps(report_data, indent=1))
    plot(report_data)
    text = report(report_data)
    write_study(args.study, "Rollout throughput (SmolLM2-135M, CPU)", text, "rollout_throughput.py")
    print(text)


def with_speedups(section: str, per: dict[str, dict]) -> dict[str, dict]:
    """Each configuration's speedup over no speculation, paired by round, with its 95%
    interval: in makespan on the tail shape, in time per generated token elsewhere."""
    runs = "makespan_s_runs" if section == "tail" else "s_per_token_runs"
    base = per["no spec"][runs]
    for v in per.values():
        v["speedup"] = speedup(base, v[runs]).to_dict()
    return per


def _x(v: dict) -> str:
    """A configuration's speedup over no speculation with its interval, and a verdict
    only when the interval excludes 1.0."""
    sp = v["speedup"]
    verdict = {"gain": ", gain", "loss": ", loss"}.get(sp["verdict"], "")
    return f"{sp['median']:.2f}x [{sp['low']:.2f}, {sp['high']:.2f}]{verdict}"


def _ratio_table(per_key: dict, keys: list[str], header: list[str]) -> list[str]:
    names = list(per_key[keys[0]])
    lines = ["| config | " + " | ".join(header) + " |", "|---|" + "---|" * len(keys)]
    for n in names:
        cells = []
        for key in keys:
            cells.append(f"{per_key[key][n]['tokens_per_s']:.0f} ({_x(per_key[key][n])})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _fixed_summary(fixed: dict, keys: list[str]) -> str:
    """Ours against the best fixed k, and k = 0 with the draft loaded against no
    speculation, at each B: the parts of it that this run measured."""
    names = set(fixed[keys[0]])
    fixed_k = sorted(n for n in names if n.startswith("k=") and n[2] != "0")
    parts = []
    if "ours" in names and fixed_k:
        parts.append(
            "Ours vs the best fixed k: "
            + ", ".join(
                f"B={k.split('/')[1]}: "
                f"{fixed[k]['ours']['tokens_per_s'] / max(fixed[k][n]['tokens_per_s'] for n in fixed_k):.2f}x"
                for k in keys
            )
            + "."
        )
    k0 = [n for n in ("k=0 (draft loaded)", "k=0, vLLM as shipped") if n in names]
    if k0:
        parts.append(
            f"{' / '.join(k0)} vs no speculation: "
            + ", ".join(
                f"B={k.split('/')[1]}: " + " / ".join(_x(fixed[k][n]) for n in k0) for k in keys
            )
            + "."
        )
    return " ".join(parts)


def report(r: dict) -> str:
    a = r["args"]
    res = r["results"]
    lines = [
        f"Measured with `{r.get('command', 'python benchmarks/rollout_throughput.py')}` on "
        f"{r['hardware']}, "
        f"k_max = {r['k_max']}, "
        + (
            f"head `{Path(a['head']).name}`"
            if a.get("head")
            else "default head (reduced vocabulary)"
        )
        + ", profiled C_peak = "
        f"{r['c_peak']:.0f} tokens. Under the measurement protocol (`grpo_specdec/measure.py`): "
        "per workload every configuration warmed on it, then the median of "
        f"{a['repeats']} rounds, each in a seeded shuffled order (orders in the JSON); every "
        "configuration in one run, each from its own estimator and an empty prefix cache. "
        "Generated tokens/s (speedup over no speculation, paired by round, with its 95% "
        "bootstrap interval; gain or loss only where the interval excludes 1.0). "
        + r.get("machine", {}).get("note", "Others' CPU share: not measured.")
        + f" During the timed runs others took at most {_busiest(r)}.",
        *(["", a["note"]] if a.get("note") else []),
    ]
    fixed = res.get("fixed", {})
    temps = sorted({k.split("/")[0] for k in fixed}, key=float)
    for temp in temps:
        keys = sorted(
            (k for k in fixed if k.split("/")[0] == temp), key=lambda k: int(k.split("/")[1])
        )
        bs = [k.split("/")[1] for k in keys]
        label = "greedy" if float(temp) == 0 else f"T={temp}"
        lines += [
            "",
            f"### Fixed concurrency, {label}: {a['tokens']} tokens per request, arithmetic questions",
            "",
            *_ratio_table(fixed, keys, [f"B={b}" for b in bs]),
            "",
        ]
        lines.append(_fixed_summary(fixed, keys))
    outside = res.get("outside", {})
    if outside:
        keys = sorted(outside, key=lambda k: (float(k.split("/")[0]), int(k.split("/")[1])))
        header = [
            f"{'greedy' if float(k.split('/')[0]) == 0 else 'T=' + k.split('/')[0]}, B={k.split('/')[1]}"
            for k in keys
        ]
        lines += [
            "",
            f"### Prompts outside the head's task (general instructions), {a['tokens']} tokens per request",
            "",
            *_ratio_table(outside, keys, header),
        ]
    grpo = res.get("grpo", {})
    for shape, per in grpo.items():
        policy, n_prompts, group, cap = SHAPES[shape]
        what = (
            f"the policy after {a['trained_iterations']} iterations of `grpo-specdec train` "
            f"at lr {a['trained_lr']:g}, with its online head"
            if policy == "trained"
            else "SmolLM2 as shipped, the bootstrapped head"
        )
        few = per["ours"].get("few_in_flight_share", 0.0)
        lines += [
            "",
            f"### GRPO shape `{shape}`: {n_prompts} prompts x {group} samples, T=1, max {cap} tokens; {what}",
            "",
            f"Share of wall time with at most {FEW_IN_FLIGHT} sequences in flight (ours): {few:.0%}.",
            "",
            "| config | tokens/s | vs no spec | wall s | mean acceptance length "
            "| group tokens drafted / accepted | model tokens drafted / accepted |",
            "|---|---|---|---|---|---|---|",
        ]
        for n, v in per.items():
            lines.append(
                f"| {n} | {v['tokens_per_s']:.0f} | {_x(v)} | "
                f"{v['wall_s']:.1f} | {v['mal']:.2f} | {_by_source(v)} |"
            )
    tail = res.get("tail", {}).get("tail")
    if tail:
        lines += ["", *_tail_report(tail, r)]
    tag = a["study"]
    lines += [
        "",
        "Static tables used: "
        + "; ".join(f"{p}: `{t}`" for p, t in r["static_tables"].items())
        + " (from the profile and acceptance measured once at k_max on that policy's GRPO rollout).",
        "",
        *([f"![throughput vs B](../assets/{tag}_vs_b.png)"] * bool(fixed)),
        *(
            ["", f"![concurrency and k over each GRPO rollout](../assets/{tag}_k_trace.png)"]
            * bool(r["traces"])
        ),
        *(["", f"![the tail shape's B over time](../assets/{tag}_tail_b.png)"] * bool(tail)),
    ]
    return "\n".join(lines)


def _busiest(r: dict) -> str:
    shares = [
        s
        for keyed in r["results"].values()
        for per in keyed.values()
        for v in per.values()
        for s in v.get("others_cpu_share", [])
        if s is not None
    ]
    return f"{max(shares):.1%} of the machine" if shares else "an unmeasured share"


def _by_source(v: dict) -> str:
    """The 'group / model tokens drafted / accepted' cells of a row (empty without them)."""
    return " | ".join(
        f"{v[f'{s}_draft_tokens']:.0f} / {v[f'{s}_accepted_tokens']:.0f}"
        if f"{s}_draft_tokens" in v
        else ""
        for s in ("group", "model")
    )


def _endings(r: dict) -> str:
    endings = r.get("tail_reference_endings", {})
    n = sum(endings.values())
    return f"{endings.get('eos', 0)} of {n} ended at EOS there, the rest at their own budget"


def _tail_report(per: dict, r: dict) -> list[str]:
    base = per["no spec"]
    fixed = [n for n in per if n.startswith(("k=", "sampled k=")) and not n.startswith("k=0")]
    best_fixed = min(fixed, key=lambda n: per[n]["makespan_s"], default=None)
    lines = [
        f"### Tail shape: {len(TAIL.questions)} mixed-level prompts x {TAIL.group} samples, T=1, "
        f"each request its own budget under a {TAIL.cap} cap (`benchmarks/tail_shape.py`)",
        "",
        "Each request makes exactly the tokens a seeded rollout with no speculation gave it "
        f"({_endings(r)}), EOS then ignored, so every configuration does the same work "
        "(speculative engines on CPU cannot follow per-request seeds: left to chance, the "
        "longest answers, which set the makespan, differ from run to run). "
        "Makespan: the rollout's wall time from its first scheduling to its last token; tail "
        f"phase: from the moment {1 - TAIL_FRACTION:.0%} of the requests had finished to the "
        "last. Speedups are no speculation's time over the configuration's (higher is better).",
        "",
        "'after EOS': the tokens a configuration made past a request's first EOS (text a "
        "real rollout never makes, which its mean acceptance length counts too); 'MAL before "
        "EOS': the mean acceptance length of the verifications that began before it.",
        "",
        "| config | makespan s | speedup | tail phase s | tail speedup | tokens/s | mean acceptance length "
        "| MAL before EOS | after EOS | group tokens drafted / accepted | model tokens drafted / accepted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, v in per.items():
        after_eos, before_eos = v.get("tokens_after_eos"), v.get("mal_before_eos")
        lines.append(
            f"| {n} | {v['makespan_s']:.1f} | {_x(v)} | "
            f"{v['tail_s']:.1f} | {base['tail_s'] / v['tail_s']:.2f}x | {v['tokens_per_s']:.0f} | "
            f"{v['mal']:.2f} | {'-' if before_eos is None else f'{before_eos:.2f}'} | "
            f"{'-' if after_eos is None else f'{after_eos:.0f}'} | {_by_source(v)} |"
        )
    rivals = [best_fixed, "static table", "paper rule", *VLLM_EXAMPLE_TABLES_NAMES]
    for ours in ("ours", "sampled ours", "ours + group", "sampled ours + group"):
        if ours in per:
            lines += [
                "",
                f"{ours} vs "
                + ", ".join(
                    f"{n}: {per[n]['makespan_s'] / per[ours]['makespan_s']:.2f}x"
                    for n in rivals
                    if n in per
                )
                + f" in makespan (best fixed k: {best_fixed}).",
            ]
    return lines


def _plot_fixed(plt, fixed: dict, temps: list[str], path: Path) -> None:
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4.5), squeeze=False)
    for ax, temp in zip(axes[0], temps, strict=True):
        keys = sorted(
            (k for k in fixed if k.split("/")[0] == temp), key=lambda k: int(k.split("/")[1])
        )
        bs = [int(k.split("/")[1]) for k in keys]
        for n in fixed[keys[0]]:
            style = "-o" if n in ("ours", "no spec", "paper rule", "static table") else ":."
            ax.plot(
                bs,
                [fixed[k][n]["tokens_per_s"] for k in keys],
                style,
                label=n,
                lw=2 if n == "ours" else 1,
            )
        ax.set(
            xscale="log",
            xlabel="concurrency B",
            ylabel="generated tokens/s",
            title=f"Fixed concurrency, {'greedy' if float(temp) == 0 else 'T=' + temp}",
        )
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tag = r["args"]["study"]
    fixed = r["results"].get("fixed", {})
    temps = sorted({k.split("/")[0] for k in fixed}, key=float)
    if temps:
        _plot_fixed(plt, fixed, temps, ASSETS / f"{tag}_vs_b.png")

    timelines = r.get("tail_timelines", {})
    if timelines:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for n in ("no spec", "ours", "sampled ours", "sampled ours + group", "static table"):
            if n in timelines:
                times, counts = in_flight(*map(list, zip(*timelines[n], strict=True)))
                ax.step(times, counts, where="post", label=n)
        ax.set(
            xlabel="seconds since the first request was scheduled",
            ylabel="sequences in flight B",
            title="Tail shape: B over time",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(ASSETS / f"{tag}_tail_b.png", dpi=120)
        plt.close(fig)

    traces = {s: t for s, t in r["traces"].items() if t}
    if not traces:
        return
    fig, axes = plt.subplots(len(traces), 1, figsize=(8, 2.4 * len(traces)), squeeze=False)
    for ax, (shape, trace) in zip(axes[:, 0], traces.items(), strict=True):
        t0 = trace[0][0]
        t = [x[0] - t0 for x in trace]
        ax.plot(t, [x[1] for x in trace], color="C1", label="sequences in flight B")
        ax.axhline(FEW_IN_FLIGHT, color="C1", ls=":", lw=1)
        ax.set_ylabel(f"{shape}\nB")
        ax2 = ax.twinx()
        ax2.step(t, [x[2] for x in trace], where="post", color="C0", label="k chosen")
        ax2.set_ylabel("k")
    axes[-1, 0].set_xlabel("seconds into the GRPO-shaped rollout (ours)")
    fig.suptitle("Concurrency B (orange) and k chosen (blue) over each rollout")
    fig.tight_layout()
    fig.savefig(ASSETS / f"{tag}_k_trace.png", dpi=120)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f}s")
