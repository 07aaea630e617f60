"""The controller's regime suite (modelled): every recorded trace (tests/data/regimes/) and
the synthetic non-stationary cases, replayed in closed loop on every known profile, under
ours, every fixed k, k = 0 and an oracle (grpo_specdec/regimes.py). Writes
docs/benchmarks/regime_suite.md and docs/assets/regime_suite.json; tests/test_regimes.py
holds the goals on the same cases.

    python benchmarks/regime_suite.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ASSETS, ROOT, STUDIES  # noqa: E402
from grpo_specdec.regimes import (  # noqa: E402
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


def main() -> None:
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
        {"trace": t.name, "profile": c.name, "ratio": no_profile_ratio(t, c, K_MAX)}
        for t in traces
        for c in profiles
        if len(t.rollouts) > 1
    ]
    (ASSETS / "regime_suite.json").write_text(
        json.dumps({"cases": rows, "no_profile": starts}, indent=1)
    )
    (STUDIES / "regime_suite.md").write_text(report(rows, starts, time.perf_counter() - start))
    print(f"{sum(r['meets'] for r in rows)} of {len(rows)} cases meet every goal")


def report(rows: list[dict], starts: list[dict], seconds: float) -> str:
    lines = [
        "# Regime suite (modelled)",
        "",
        "Recorded rollouts replayed in closed loop on each profile (`python "
        "benchmarks/regime_suite.py`, grpo_specdec/regimes.py; the goals are held by "
        f"tests/test_regimes.py). {len(rows)} cases in {seconds:.0f} s. Ratios are "
        "throughput ratios, ours over the other: goals >= "
        + ", ".join(f"{v} {g}" for g, v in GOALS.items())
        + ". k = 0 stands for no speculation too: the profiles time k = 0 with the draft "
        "loaded, which `make bench-k0` measures level with the plain engine.",
        "",
        "| trace | profile | best fixed k | ours vs best fixed k | ours vs k = 0 | ours vs oracle "
        "| ours' steps per k | meets |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ks = ", ".join(f"{k}: {n}" for k, n in r["ours_k_steps"].items())
        lines.append(
            f"| {r['trace']} | {r['profile']} | {r['best_fixed']} | {r['vs best fixed k']:.3f} "
            f"| {r['vs k=0']:.3f} | {r['vs oracle']:.3f} | {ks} | "
            f"{'yes' if r['meets'] else '**no**'} |"
        )
    lines += [
        "",
        "## Started without a profile",
        "",
        "Throughput of an engine that starts with no profile (k = 0 until its own timed "
        "steps show a k that pays) over a profiled one's, on each trace's rollouts after "
        "the first (both having run the first). Goal: >= 0.95.",
        "",
        "| trace | profile | no profile vs profiled |",
        "|---|---|---|",
    ]
    lines += [f"| {s['trace']} | {s['profile']} | {s['ratio']:.3f} |" for s in starts]
    if BEFORE.is_file():
        lines += before_section(json.loads(BEFORE.read_text()), rows)
    return "\n".join(lines) + "\n"


def before_section(before: list[dict], rows: list[dict]) -> list[str]:
    """The cases under 404421f's controller beside today's."""
    now = {(r["trace"], r["profile"]): r for r in rows}
    lines = [
        "",
        "## Before: the controller of 404421f",
        "",
        f"{sum(b['meets'] for b in before)} of {len(before)} cases met every goal (today: "
        f"{sum(r['meets'] for r in rows)} of {len(rows)}). Its estimator (a fade of 0.9998 "
        "per running sequence per step, 512 drafts' memory, learning from every verified "
        "draft, past EOS too) and goodput table on the profile as given, fed as its "
        "scheduler fed them: `choose` called `estimator.step(B)` then `policy.choose(B, "
        "context)`, every verified draft `estimator.observe(drafted, accepted)`, nothing "
        "timed, nothing restarted (git show 404421f:vllm_plugin/controller.py).",
        "",
        "| trace | profile | vs best fixed k: then / now | vs k = 0: then / now "
        "| vs oracle: then / now |",
        "|---|---|---|---|---|",
    ]
    for b in before:
        r = now.get((b["trace"], b["profile"]))
        if r is None:
            continue
        lines.append(
            f"| {b['trace']} | {b['profile']} | "
            + " | ".join(f"{b[g]:.3f} / {r[g]:.3f}" for g in GOALS)
            + " |"
        )
    return lines


if __name__ == "__main__":
    main()
