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
- the tail shape (`grpo_specdec/tasks/length_budgets.py`: 8 mixed-level prompts x 8 samples, each its
  own request with its own length budget under a 1024 cap), where the last tenth of the
  requests take a quarter of the no-speculation wall time: its makespan and its tail phase
  (after 90% of the requests finished) are reported apart.
One speculative engine per policy serves every speculative configuration (the
scheduler's k source is switched between runs); a plain engine with no draft is the
baseline. Configurations are interleaved and repeated; each keeps its own acceptance
estimator and starts every run from an empty prefix cache. The rounds' summaries, the
study's tables and its plots: benchmarks/rollout_report.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import (
    ASSETS,
    command,
    fresh_controller,
    load_json,
    parser,
    protocol_args,
    quiet_machine,
    smollm2,
    smollm2_head,
    smollm2_profile,
    trained_policy,
    warmed,
    write_study,
)
from benchmarks.rollout_report import (
    VLLM_EXAMPLE_TABLES_NAMES,
    plot,
    report,
    summarise,
)
from grpo_specdec.bench.measure import run_protocol
from grpo_specdec.bench.tail_shape import tokens_after_eos
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings
from grpo_specdec.simulate import VLLM_EXAMPLE_TABLES, recommend_table
from grpo_specdec.tasks.arithmetic import make_problems
from grpo_specdec.tasks.length_budgets import tail_shape
from vllm_plugin.acceptance import conditional_from_cumulative
from vllm_plugin.compat import dense_k_table
from vllm_plugin.controller import FixedPolicy, PaperPolicy, profile_latency
from vllm_plugin.patches.features import free_k0_v0_32
from vllm_plugin.settings import hardware_name

# GRPO shapes: which policy answers, prompts x group, token cap.
SHAPES = {
    "untrained": ("base", 8, 8, 256),
    "trained": ("trained", 8, 8, 256),
    "long": ("base", 4, 16, 512),
}
TAIL = tail_shape()  # the tail shape's defaults: 8 x 8 requests, budgets under a 1024 cap
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
    comes from: a policy, vLLM's dense batch-size -> k list, or a callable that makes a
    fresh policy for every run (ours: a controller that has learnt nothing yet)."""

    engine: Engine
    policy: object = None
    free_k0: bool = True  # False: steps with k = 0 run the draft pass, as vLLM ships it
    group: bool = False  # the engine drafts from the group's text; its state is reset per run
    with_history: bool = False  # ... and starts each run from an earlier rollout's answers


def replay_lengths(plain: Engine, workload: tuple, endings: dict) -> tuple:
    """The tail workload with each request's length fixed to what a seeded rollout with no
    speculation gave it (EOS or its budget): every configuration then makes exactly those
    tokens, so makespans compare equal work. A speculative engine samples with other
    random draws than the plain one, so without this each configuration's answers, and the few longest
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
    engine, scheduler = config.engine, None
    engine.llm.reset_prefix_cache()
    if config.group:
        engine.group_draft_reset()
        if config.with_history and history is not None:
            engine.group_draft_add_history(history)
    if config.policy is not None:
        scheduler = engine.scheduler()
        scheduler.set_policy(config.policy() if callable(config.policy) else config.policy)
        mark, before_eos = scheduler.steps_scheduled, Counter(scheduler.verified_before_eos)
    free_k0_v0_32.ENABLED = config.free_k0
    try:
        res = engine.generate(prompts, sampling, **(per_request or {}))
    finally:
        free_k0_v0_32.ENABLED = True
    answers = [s.token_ids for group in res.outputs for s in group]
    out = {
        "wall_s": res.wall_s,
        "tokens": res.num_generated_tokens,
        "tokens_after_eos": tokens_after_eos(answers, engine.tokenizer.eos_token_id),
        "mean_acceptance_length": res.spec["mean_acceptance_length"],
        # nothing accepted at all (or nothing drafted): nothing accepted before EOS either
        **({"mal_before_eos": 1.0} if res.spec["mean_acceptance_length"] == 1.0 else {}),
        "per_position_acceptance": res.spec.get("per_position_acceptance", []),
        "scheduled_s": res.scheduled_s,
        "finished_s": res.finished_s,
        "lengths": [[len(s.token_ids) for s in group] for group in res.outputs],
    }
    if scheduler is not None:
        out["trace"] = [(t, b, k) for t, b, k, _ in scheduler.steps_since(mark)]
        verified = scheduler.verified_before_eos - before_eos
        out["mal_before_eos"] = (
            1 + verified["accepted"] / verified["drafts"] if verified["drafts"] else 1.0
        )
    if config.group:
        out["group"] = engine.group_draft_stats()["sources"]
    return out


def timed_rounds(
    configs: dict[str, Config], workload: tuple, repeats: int, seed: int, label: str, history=None
):
    """Every configuration on one workload ((section, key, policy, prompts, sampling,
    per-request settings)) under the measurement protocol (grpo_specdec/bench/measure.py):
    each warmed on it, then `repeats` rounds in a seeded shuffled order, every run from the
    configuration's own state (`run_config`); `history`: the group drafts' earlier answers."""
    *_, prompts, sampling, per_request = workload
    runs = {
        n: functools.partial(run_config, c, prompts, sampling, history, per_request)
        for n, c in configs.items()
    }
    progress = functools.partial(print, f"{label}:", flush=True)
    return run_protocol(runs, repeats=repeats, seed=seed, progress=progress)


def max_batch_of(args: dict) -> int:
    """The most sequences a run's engines hold and its controllers price: its largest
    workload (benchmarks/simulator_validation.py prices a saved run's steps by it too)."""
    shapes = [s for s in args["shapes"].split(",") if s]
    return max(
        [
            *(int(b) for b in args["batch_sizes"].split(",") if b),
            *([len(OUTSIDE_PROMPTS)] if args["outside"] else []),
            *(SHAPES[s][1] * SHAPES[s][2] for s in shapes if s != "tail"),
            *([len(TAIL.prompts)] if "tail" in shapes else []),
        ]
    )


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


def compared_configs(args, engines: dict[str, Engine], latencies: dict, table) -> dict[str, Config]:
    """Every configuration on one policy's engines, each with its own estimator: no
    speculation on the plain engine; k = 0, fixed k, the static tables, the paper's rule and
    ours on the speculative one; with --group, drafts from the group's text alone (no draft
    model; vLLM's model-free ngram host) and next to the EAGLE head under our controller;
    with --sampled, the same head drafting by sampling (q handed to verification), priced on
    the profile of sampled drafting: fixed k and ours, and ours next to drafts from the
    group's text (verified one-hot)."""
    k_max, max_batch, spec = args.k_max, max_batch_of(vars(args)), engines["spec"]
    latency, examples = latencies["greedy"], VLLM_EXAMPLE_TABLES.values()

    def ours(engine: str, latency):
        return fresh_controller(engines[engine].scheduler(), latency, max_batch)

    def tabled(table) -> Config:
        return Config(spec, dense_k_table(table, max_batch, k_max))

    configs = {
        "no spec": Config(engines["plain"]),
        "k=0 (draft loaded)": Config(spec, FixedPolicy(0)),
        "k=0, vLLM as shipped": Config(spec, FixedPolicy(0), False),
        **{f"k={k}": Config(spec, FixedPolicy(k)) for k in range(1, k_max + 1)},
        "static table": tabled(table),
        **{n: tabled(t) for n, t in zip(VLLM_EXAMPLE_TABLES_NAMES, examples, strict=True)},
        "paper rule": Config(spec, PaperPolicy(latency.c_peak, k_max)),
        "ours": Config(spec, ours("spec", latency)),
        # After one rollout (the warm-up), with and without a profile: how near an engine
        # that learns its prices comes to a profiled one.
        "ours, warmed": Config(spec, warmed(ours("spec", latency))),
        "ours, no profile, warmed": Config(spec, warmed(ours("spec", None))),
    }
    if args.group:
        group, hybrid = engines["group"], engines["hybrid"]
        configs |= {
            "group": Config(group, group=True),
            "group +history": Config(group, group=True, with_history=True),
            "ours + group": Config(hybrid, ours("hybrid", latency), group=True),
            "ours + group +history": Config(
                hybrid, ours("hybrid", latency), group=True, with_history=True
            ),
        }
    if args.sampled:
        sampled, priced = engines["sampled"], latencies["probabilistic"]
        configs |= {f"sampled k={k}": Config(sampled, FixedPolicy(k)) for k in range(1, k_max + 1)}
        configs["sampled ours"] = Config(sampled, ours("sampled", priced))
        if args.group:
            policy = ours("sampled hybrid", priced)
            configs["sampled ours + group"] = Config(engines["sampled hybrid"], policy, group=True)
    return configs


def main() -> None:
    ap = parser(__doc__)
    on_off = argparse.BooleanOptionalAction
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--temperatures", default="0,1", help="fixed-concurrency workloads")
    what = "tokens per request, fixed-concurrency workload"
    ap.add_argument("--tokens", type=int, default=64, help=what)
    what = "GRPO shapes to run (and `tail`)"
    ap.add_argument("--shapes", default=",".join([*SHAPES, "tail"]), help=what)
    what = "comma-separated configurations to run (no spec always runs); default: all"
    ap.add_argument("--only", default="", help=what)
    what = "also the prompts outside the head's training task, at B = 1 and all of them"
    ap.add_argument("--outside", action=on_off, default=True, help=what)
    ap.add_argument("--trained-iterations", type=int, default=12)
    ap.add_argument("--trained-lr", type=float, default=1e-4)
    what = "also compare drafts from the group's text (alone and with EAGLE)"
    ap.add_argument("--group", action=on_off, default=True, help=what)
    ap.add_argument("--group-k-max", type=int, default=8, help="longest group-only draft")
    what = "also compare the head drafting by sampling (draft_sampling: probabilistic)"
    ap.add_argument("--sampled", action=on_off, default=False, help=what)
    what = "the SmolLM2 policy's head (default: the bootstrapped one)"
    ap.add_argument("--head", default=None, help=what)
    what = "the study file to rewrite (docs/benchmarks/STUDY.md); also names its files in "
    ap.add_argument("--study", default="rollout_throughput", help=what + "docs/assets")
    ap.add_argument("--note", default="", help="a paragraph on what this run is for")
    what = "measure the latency profiles now, not from the store: the run and its profile "
    what += "see the machine in the same state (benchmarks/simulator_validation.py)"
    ap.add_argument("--fresh-profile", action="store_true", help=what)
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
    head, fresh = smollm2_head(target), args.fresh_profile
    paths = {
        drafting: smollm2_profile(target, head, args.k_max, drafting, fresh)
        for drafting in ("greedy", *(["probabilistic"] if args.sampled else []))
    }
    profiles = {drafting: load_json(path) for drafting, path in paths.items()}
    latencies = {drafting: profile_latency(profile) for drafting, profile in profiles.items()}
    latency = latencies["greedy"]
    models = {"base": (target, args.head or head)}
    if any(SHAPES[s][0] == "trained" for s in grpo_shapes):
        models["trained"] = trained_policy(args.trained_iterations, args.trained_lr)
    max_batch = max_batch_of(vars(args))

    # Workloads: (section, key, policy, prompts, sampling, per-request settings).
    questions = [p.question for p in make_problems(max_batch, seed=7, level=2)]
    workloads = []
    for temp in temperatures:
        sampling = SamplingSettings(max_tokens=args.tokens, ignore_eos=True, temperature=temp)
        for b in batch_sizes:
            workloads.append(("fixed", f"{temp:g}/{b}", "base", questions[:b], sampling, {}))
        for b in (1, len(OUTSIDE_PROMPTS)) if args.outside else ():
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
    results: dict[str, dict] = {}  # section -> key -> the protocol's timed rounds
    tables, calibration = {}, {}
    tail_endings: dict[str, int] = {}
    for name, (model, draft) in models.items():
        own_workloads = [w for w in workloads if w[2] == name]
        if not own_workloads:
            continue
        tail = any(w[0] == "tail" for w in own_workloads)
        fields = dict(model=model, max_num_seqs=max_batch, kv_cache_gib=1.5, seed=0)
        fields["max_model_len"] = TAIL.cap + 256 if tail else 1024

        def engine(drafting="greedy", group=False, fields=fields, **speculative) -> Engine:
            """The plain engine (no `speculative`), or one priced on the profile of its
            drafting, with or without drafts from the group's text."""
            controller = {"policy": "goodput", "profile": str(paths[drafting])}
            controller |= {"group": {"enabled": True}} if group else {}
            speculative = {**speculative, "controller": controller} if speculative else None
            return Engine(EngineConfig(**fields, speculative=speculative))

        eagle = {"draft": draft, "k": args.k_max, "concurrency_aware": True}
        sampled = {**eagle, "draft_sampling": "probabilistic"}
        engines = {"plain": engine(), "spec": engine(**eagle)}
        plain, spec = engines["plain"], engines["spec"]
        own_workloads = [
            replay_lengths(plain, w, tail_endings) if w[0] == "tail" else w for w in own_workloads
        ]
        if args.group:
            engines["group"] = engine(group=True, draft=None, k=args.group_k_max)
            engines["hybrid"] = engine(group=True, **eagle)
        if args.sampled:
            engines["sampled"] = engine("probabilistic", **sampled)
        if args.sampled and args.group:
            engines["sampled hybrid"] = engine("probabilistic", True, **sampled)
        # Calibrate the static table the way a user would: measure acceptance once at
        # k_max, on this policy's own GRPO-shaped rollout.
        spec.scheduler().set_policy(FixedPolicy(args.k_max))
        own = [w[3:] for w in own_workloads if w[0] in ("grpo", "tail")]
        default = (questions[:8], SamplingSettings(n=8, temperature=1.0, max_tokens=256), {})
        prompts, sampling, per_request = (own or [default])[0]
        measured = spec.generate(prompts, sampling, **per_request).spec
        conditional = conditional_from_cumulative(measured["per_position_acceptance"])
        calibration[name] = conditional.tolist()
        tables[name] = recommend_table(latency, conditional, args.k_max, max_batch)
        configs = compared_configs(args, engines, latencies, tables[name])
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
        for w, workload in enumerate(own_workloads):
            label, past = f"{name} {workload[0]} {workload[1]}", history.get(workload[:2])
            timed = timed_rounds(configs, workload, args.repeats, args.order_seed + w, label, past)
            results.setdefault(workload[0], {})[workload[1]] = timed
        for e in engines.values():
            e.shutdown()

    tail_runs = results["tail"]["tail"].runs if "tail" in results else {}
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
            s: {k: summarise(t, s) for k, t in keyed.items()} for s, keyed in results.items()
        },
        "orders": {f"{s}/{k}": t.orders for s, keyed in results.items() for k, t in keyed.items()},
        "machine": machine,
        "traces": {
            key: t.runs["ours"][-1]["trace"]
            for section in ("grpo", "tail")
            for key, t in results.get(section, {}).items()
            if "ours" in t.runs
        },
        # The tail shape's requests, each (first scheduled, last token), in each
        # configuration's last run: B over time.
        "tail_timelines": {
            n: list(zip(r[-1]["scheduled_s"], r[-1]["finished_s"], strict=True))
            for n, r in tail_runs.items()
        },
        "tail_reference_endings": tail_endings,
        "shapes": SHAPES,
        "tail_shape": {"prompts": len(TAIL.questions), "group": TAIL.group, "cap": TAIL.cap},
        "tail_lengths": {n: [group[0] for group in r[-1]["lengths"]] for n, r in tail_runs.items()},
        "args": vars(args),
        "command": command(),
    }
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / f"{args.study}.json").write_text(json.dumps(report_data, indent=1))
    plot(report_data)
    text = report(report_data)
    write_study(args.study, "Rollout throughput (SmolLM2-135M, CPU)", text, "rollout_throughput.py")
    print(text)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f}s")
