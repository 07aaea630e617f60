"""A GRPO rollout shape with the tail real rollouts have: few sequences in flight for a
large share of the rollout's wall time.

    python benchmarks/tail_shape.py      # measures it (twice) and rewrites docs/benchmarks/tail_shape.md

The shape and the tail figures are `grpo_specdec.bench.tail_shape`'s (the job's
end-of-run comparison uses them too). This study rolls it out with no speculation and
counts how each answer ended: EOS, its own budget, or the global cap. Per-request finish
times are vLLM's own (`RequestOutput.metrics`), each sample one request so each has its own.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import ASSETS, protocol_args, quiet_machine, smollm2, write_study
from grpo_specdec.bench.tail_shape import (
    TailShape,
    in_flight,
    share_of_time_at_most,
    tail_shape,
    tail_share,
)
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings

# Seer (arXiv 2511.14617), veRL rollouts on H800 nodes: share of rollout time taken by the
# last 10% of requests to finish (Fig. 8), and mean answer length over the cap (Table 3).
SEER_TAIL_SHARE = {"Moonlight": 0.46, "Qwen2-VL-72B": 0.50, "Kimi-K2": 0.26}
SEER_MEAN_OVER_CAP = (1 / 5.4, 1 / 2.5)
PERCENTILES = (10, 25, 50, 75, 90, 95, 99, 100)
FEW_IN_FLIGHT = (8, 4)  # B at or below these: where speculation can pay on this CPU


@dataclass(frozen=True)
class Finished:
    """One request of a rollout: its answer's length, why it ended, and when it was first
    scheduled and produced its last token (seconds from the rollout's first scheduling)."""

    tokens: int
    ending: str  # "eos", "budget" (its own max_tokens, below the cap) or "cap"
    start_s: float
    end_s: float


def rollout(engine, shape: TailShape) -> list[Finished]:
    """Roll the shape out at T = 1 from an empty prefix cache, one request per sample.

    Each request is seeded, unless the engine speculates (vLLM 0.32 on CPU cannot then; the
    engine-wide seed is used). vLLM 0.32 on CPU also fails a seeded request whose prefill is
    split over steps, so the engine must schedule every prompt's prefill in one step
    (`max_num_batched_tokens` at least the prompts' total length)."""
    engine.llm.reset_prefix_cache()
    res = engine.generate(
        shape.prompts,
        SamplingSettings(temperature=1.0, max_tokens=shape.cap),
        seeds=shape.seeds,
        max_tokens=shape.max_tokens,
    )
    finished = []
    for (out,), start, end in zip(res.outputs, res.scheduled_s, res.finished_s, strict=True):
        tokens = len(out.token_ids)
        if out.finish_reason == "stop":
            ending = "eos"
        else:
            ending = "cap" if tokens >= shape.cap else "budget"
        finished.append(Finished(tokens, ending, start, end))
    return finished


def _summary(runs: list[list[Finished]], cap: int) -> dict:
    lengths = np.array([f.tokens for f in runs[0]])
    endings = [f.ending for f in runs[0]]
    per_run = []
    for run in runs:
        times, counts = in_flight([f.start_s for f in run], [f.end_s for f in run])
        per_run.append(
            {
                "makespan_s": max(f.end_s for f in run),
                "tail_share": tail_share([f.end_s for f in run]),
                **{f"b_le_{b}": share_of_time_at_most(times, counts, b) for b in FEW_IN_FLIGHT},
                "tokens": sum(f.tokens for f in run),
            }
        )
    return {
        "lengths": lengths,
        "percentiles": np.percentile(lengths, PERCENTILES),
        "mean_over_cap": float(lengths.mean() / cap),
        "endings": {e: endings.count(e) for e in ("eos", "budget", "cap")},
        "runs": per_run,
    }


def _report(shape: TailShape, summary: dict, plot_name: str, command: str) -> str:
    n = len(shape.prompts)
    pct = summary["percentiles"]
    lengths = summary["lengths"]
    ends = summary["endings"]
    seer = ", ".join(f"{k} {v:.0%}" for k, v in SEER_TAIL_SHARE.items())
    lo, hi = SEER_MEAN_OVER_CAP
    run_rows = "\n".join(
        f"| {i} | {r['makespan_s']:.1f} | {r['tokens']} | {r['tail_share']:.0%} | "
        f"{r['b_le_8']:.0%} | {r['b_le_4']:.0%} |"
        for i, r in enumerate(summary["runs"], start=1)
    )
    return f"""SmolLM2-135M-Instruct, no speculation, T = 1: {len(shape.questions)} prompts (arithmetic
word problems, levels 1..4 in turn) x G = {shape.group} = {n} requests, global cap {shape.cap}
tokens, each request's own budget a seeded log-normal draw (median and spread in the command
below). Command: `{command}`.

**Answer lengths** (tokens; run 1, the same seeds in every run):

| {" | ".join(f"p{p}" for p in PERCENTILES[:-1])} | max | mean | mean / cap |
|{"---|" * (len(PERCENTILES) + 2)}
| {" | ".join(f"{v:.0f}" for v in pct[:-1])} | {pct[-1]:.0f} | {lengths.mean():.0f} | {summary["mean_over_cap"]:.2f} (Seer: {lo:.2f}-{hi:.2f}) |

**How answers ended:** {ends["eos"]} of {n} at EOS ({ends["eos"] / n:.0%}), {ends["budget"]} at
their own budget below the cap, {ends["cap"]} at the global cap ({ends["cap"] / n:.0%}).

**Tail** (the wall time of each no-speculation rollout; wall clock on a shared 2-core CPU, so
noisy): the share of the makespan taken by the last 10% of requests to finish, and of the
makespan with at most 8 and at most 4 sequences in flight. Seer's last-10% shares: {seer}.

| run | makespan (s) | tokens | last 10% of requests | B <= 8 | B <= 4 |
|---|---|---|---|---|---|
{run_rows}

![B over time and the length CDF](../assets/{plot_name})"""


def _plot(runs: list[list[Finished]], cap: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_cdf) = plt.subplots(1, 2, figsize=(11, 4))
    for i, run in enumerate(runs, start=1):
        times, counts = in_flight([f.start_s for f in run], [f.end_s for f in run])
        ax_b.step(times, counts, where="post", label=f"run {i}")
    for b in FEW_IN_FLIGHT:
        ax_b.axhline(b, color="grey", lw=0.6, ls=":")
    ax_b.set(xlabel="seconds since the first request was scheduled", ylabel="B (in flight)")
    ax_b.set_title("Sequences in flight, no speculation")
    ax_b.legend()
    lengths = np.sort([f.tokens for f in runs[0]])
    ax_cdf.step(lengths, np.arange(1, len(lengths) + 1) / len(lengths), where="post")
    ax_cdf.axvline(cap, color="grey", lw=0.6, ls="--", label=f"cap {cap}")
    ax_cdf.set(xlabel="answer length (tokens)", ylabel="share of answers at most this long")
    ax_cdf.set_title("Answer-length CDF (run 1)")
    ax_cdf.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--cap", type=int, default=1024)
    ap.add_argument("--budget-median", type=int, default=256)
    ap.add_argument("--budget-sigma", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=2, help="rollouts of the same shape")
    protocol_args(ap, repeats=False)
    args = ap.parse_args()
    machine = quiet_machine(args)
    shape = tail_shape(
        args.prompts, args.group, args.cap, args.budget_median, args.budget_sigma, args.seed
    )
    engine = Engine(
        EngineConfig(model=smollm2(), max_model_len=args.cap + 256, kv_cache_gib=2.0, seed=0),
        max_num_batched_tokens=len(shape.prompts) * 256,  # every prefill in one step
    )
    runs = []
    for i in range(args.runs):
        runs.append(rollout(engine, shape))
        print(f"run {i + 1}: tail share {tail_share([f.end_s for f in runs[-1]]):.0%}", flush=True)
    engine.shutdown()
    summary = _summary(runs, shape.cap)
    plot = ASSETS / "tail_shape_runs.png"
    _plot(runs, shape.cap, plot)
    command = (
        f"python benchmarks/tail_shape.py --prompts {args.prompts} --group {args.group} "
        f"--cap {args.cap} --budget-median {args.budget_median} "
        f"--budget-sigma {args.budget_sigma:g} --seed {args.seed} --runs {args.runs}"
    )
    results = _report(shape, summary, plot.name, command) + "\n\n" + machine["note"]
    print(write_study("tail_shape", "A rollout shape with a tail", results, "tail_shape.py"))


if __name__ == "__main__":
    main()
