"""The controller's regime suite (modelled): every recorded trace (tests/data/regimes/) and
the synthetic non-stationary cases, replayed in closed loop on every known profile, under
ours, every fixed k, k = 0 and an oracle (grpo_specdec/regimes.py). Writes
docs/benchmarks/regime_suite.md and docs/assets/regime_suite.json; tests/test_regimes.py
holds the goals on the same cases.

    python benchmarks/regime_suite.py
    python benchmarks/regime_suite.py --record --name end --policy RUN/iter_10/policy \\
        --draft RUN/iter_10/draft --out tests/data/regimes/end.json.gz

--record records a trace instead: it rolls out the demo recipe's prompts (arithmetic,
levels 1-2) as the tail shape, each sample its own request with a log-normal length budget
around 128 tokens (cap 512), on the project's engine with the given policy and EAGLE head,
drafting a fixed k every step (so that every output position is covered by a verified
draft), sampling as the job does (T = 0.7, probabilistic drafts); and saves, per request,
its prompt and output lengths, its first EOS and every verified draft (position, drafted,
accepted), as the scheduler saw them. `--ignore-eos` makes each request run to its budget
past EOS, as the benchmarks' equal-token rounds do. Step times are not recorded: the suite
prices steps from each profile.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ASSETS, ROOT, parser, prose, table, write_study  # noqa: E402
from grpo_specdec.regimes import (  # noqa: E402
    FIRST_ROLLOUT_SLOWER,
    Request,
    Rollout,
    Trace,
    cases,
    known_costs,
    no_profile_ratio,
    run_case,
    synthetic_traces,
    verdict,
)

K_MAX = 4
TRACES = ROOT / "tests" / "data" / "regimes"
GOALS = {"vs best fixed k": 0.98, "vs k=0": 0.98, "vs oracle": 0.95}
# The same cases under the controller of 404421f (before this suite existed), run once
# with the adapter the study shows.
BEFORE = ASSETS / "regime_suite_before.json"
CAP, MEDIAN, SIGMA = 512, 128, 0.7  # a recorded rollout's length budgets


def all_traces() -> list[Trace]:
    """The recorded traces, the synthetic ones, and the end-of-run comparison's sequence:
    rounds past EOS (equal tokens), then natural EOS, on one controller."""
    recorded = {p.name.removesuffix(".json.gz"): Trace.load(p) for p in TRACES.glob("*.json.gz")}
    traces = [recorded[name] for name in sorted(recorded)]
    if {"past_eos", "end"} <= set(recorded):
        past, natural = recorded["past_eos"], recorded["end"]
        traces.append(
            Trace(
                "past_eos, then end (one controller)",
                past.rollouts + natural.rollouts,
                natural.temperature,
                "the end-of-run comparison's order: equal-token rounds, then natural EOS",
            )
        )
    return traces + synthetic_traces()


def suite() -> None:
    start = time.perf_counter()
    traces, profiles = all_traces(), known_costs(ASSETS)
    rows = []
    for trace, costs in cases(traces, profiles):
        results = run_case(trace, costs, K_MAX)
        ratios = verdict(results)
        best = min(
            (n for n in results if n.startswith("k=") and n != "k=0"),
            key=lambda n: results[n].seconds,
        )
        rows.append(
            {
                "trace": trace.name,
                "profile": costs.name,
                "seconds": {n: r.seconds for n, r in results.items()},
                "best_fixed": best,
                **ratios,
                "ours_k_steps": results["ours"].k_steps,
                "meets": all(ratios[g] >= bound for g, bound in GOALS.items()),
            }
        )
        print(
            f"{trace.name} | {costs.name}: " + ", ".join(f"{g} {v:.3f}" for g, v in ratios.items())
        )
    starts = [
        {
            "trace": t.name,
            "profile": c.name,
            "ratio": no_profile_ratio(t, c, K_MAX),
            "slow_first_ratio": no_profile_ratio(t, c, K_MAX, FIRST_ROLLOUT_SLOWER),
        }
        for t in traces
        for c in profiles
        if len(t.rollouts) > 1
    ]
    (ASSETS / "regime_suite.json").write_text(
        json.dumps({"cases": rows, "no_profile": starts}, indent=1)
    )
    text = report(rows, starts, time.perf_counter() - start)
    write_study("regime_suite", "Regime suite (modelled)", text, "regime_suite.py")
    print(f"{sum(r['meets'] for r in rows)} of {len(rows)} cases meet every goal")


def report(rows: list[dict], starts: list[dict], seconds: float) -> str:
    goals = ", ".join(f"{v} {g}" for g, v in GOALS.items())
    header = ["trace", "profile", "best fixed k", "ours vs best fixed k", "ours vs k = 0"]
    header += ["ours vs oracle", "ours' steps per k", "meets"]
    lines = [
        prose("regime_suite", "cases", cases=len(rows), seconds=f"{seconds:.0f}", goals=goals),
        "",
        *table(
            header,
            (
                [r["trace"], r["profile"], r["best_fixed"]]
                + [f"{r[g]:.3f}" for g in GOALS]
                + [", ".join(f"{k}: {n}" for k, n in r["ours_k_steps"].items())]
                + ["yes" if r["meets"] else "**no**"]
                for r in rows
            ),
        ),
        "",
        prose("regime_suite", "no_profile", slower=f"{FIRST_ROLLOUT_SLOWER:g}"),
        "",
        *table(
            ["trace", "profile", "no profile vs profiled", "the same, first rollout slower"],
            (
                [s["trace"], s["profile"], f"{s['ratio']:.3f}", f"{s['slow_first_ratio']:.3f}"]
                for s in starts
            ),
        ),
    ]
    if BEFORE.is_file():  # the cases under 404421f's controller beside today's
        before = json.loads(BEFORE.read_text())
        now = {(r["trace"], r["profile"]): r for r in rows}
        met = f"{sum(b['meets'] for b in before)} of {len(before)}"
        meets = f"{sum(r['meets'] for r in rows)} of {len(rows)}"
        header = ["trace", "profile", "vs best fixed k: then / now", "vs k = 0: then / now"]
        lines += [
            "",
            prose("regime_suite", "before", met=met, meets=meets),
            "",
            *table(
                [*header, "vs oracle: then / now"],
                (
                    [b["trace"], b["profile"]]
                    + [f"{b[g]:.3f} / {now[(b['trace'], b['profile'])][g]:.3f}" for g in GOALS]
                    for b in before
                    if (b["trace"], b["profile"]) in now
                ),
            ),
        ]
    return "\n".join(lines) + "\n"


def record_rollout(engine, questions, group, temperature, ignore_eos, seed) -> Rollout:
    from vllm import SamplingParams

    from grpo_specdec.tasks.length_budgets import with_budgets

    shape = with_budgets(questions, group, CAP, MEDIAN, SIGMA, seed)
    scheduler = engine.scheduler()
    prompt_ids = [engine.encode(p) for p in shape.prompts]
    params = [
        SamplingParams(temperature=temperature, max_tokens=budget, ignore_eos=ignore_eos)
        for budget in shape.max_tokens
    ]
    scheduler.draft_events.clear()
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    drafts = collections.defaultdict(list)
    for request_id, position, drafted, accepted, _ in scheduler.draft_events:
        drafts[request_id.rsplit("-", 1)[0]].append((position, drafted, accepted))
    eos_ids = {engine.tokenizer.eos_token_id}  # the tokenizer's EOS and the generation config's
    config = Path(engine.cfg.model) / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    requests = []
    for prompt, out in zip(prompt_ids, outputs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        eos = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        requests.append(Request(len(prompt), len(tokens), eos, drafts[out.request_id]))
    return Rollout(requests)


def record(args) -> None:
    from grpo_specdec.engine import Engine, EngineConfig
    from grpo_specdec.tasks.arithmetic import make_problems
    from vllm_plugin.controller import FixedPolicy

    speculative = {"draft": args.draft, "k": args.k, "draft_sampling": "probabilistic"}
    speculative |= {"concurrency_aware": True, "draft_watch": False}
    fields = {"model": args.policy, "max_model_len": CAP + 256, "speculative": speculative}
    fields["max_num_seqs"] = args.prompts * args.group
    engine = Engine(EngineConfig.model_validate(fields))
    try:
        engine.scheduler().set_policy(FixedPolicy(args.k))
        rollouts = []
        for r in range(args.rollouts):
            half = args.prompts // 2
            seed = args.seed + r
            problems = make_problems(half, seed, 1) + make_problems(args.prompts - half, seed, 2)
            questions = [p.question for p in problems]
            rollout = record_rollout(
                engine, questions, args.group, args.temperature, args.ignore_eos, seed
            )
            drafted = sum(len(q.drafts) for q in rollout.requests)
            print(f"{args.name}: rollout {r + 1}: {drafted} verified drafts", flush=True)
            rollouts.append(rollout)
    finally:
        engine.shutdown()
    source = (
        f"{args.source or f'policy {args.policy}, head {args.draft}'}; k = {args.k} every "
        f"step, T = {args.temperature}, {'EOS ignored' if args.ignore_eos else 'natural EOS'}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Trace(args.name, rollouts, args.temperature, source).save(args.out)
    print(f"saved {args.out}")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--record", action="store_true", help="record a trace (below), not the suite")
    rec = ap.add_argument_group("--record: the trace to record")
    rec.add_argument("--name")
    rec.add_argument("--policy", help="the policy's model folder")
    rec.add_argument("--draft", help="the EAGLE head's folder")
    rec.add_argument("--out", help="the trace file (.json.gz)")
    rec.add_argument("--temperature", type=float, default=0.7)
    rec.add_argument("--ignore-eos", action="store_true")
    rec.add_argument("--rollouts", type=int, default=3, help="batches of prompts, in turn")
    rec.add_argument("--prompts", type=int, default=8)
    rec.add_argument("--group", type=int, default=8)
    rec.add_argument("--k", type=int, default=4, help="draft tokens every step")
    rec.add_argument("--seed", type=int, default=1000, help="which problems and budgets")
    rec.add_argument("--source", default="", help="what the policy and head are, for the trace")
    args = ap.parse_args()
    if not args.record:
        return suite()
    missing = [f"--{f}" for f in ("name", "policy", "draft", "out") if not getattr(args, f)]
    if missing:
        ap.error(f"--record needs {', '.join(missing)}")
    record(args)


if __name__ == "__main__":
    main()
