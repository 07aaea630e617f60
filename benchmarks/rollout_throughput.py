"""Rollout throughput on SmolLM2-135M: no speculation, fixed k, vLLM's static batch-size
table, the paper's rule and our controller, measured side by side in one run.

    python benchmarks/rollout_throughput.py            # or: make bench

Two workloads: fixed concurrency B (each request exactly --tokens tokens, greedy), and a
GRPO-shaped rollout (P prompts x G samples, temperature 1, natural stop, so concurrency
decays as sequences finish). One speculative engine serves every speculative
configuration (the scheduler's k source is switched between runs); a plain engine with
no draft is the baseline. Configurations are interleaved and repeated; each keeps its
own acceptance estimator and starts every run from an empty prefix cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import (
    ASSETS,
    DOCS,
    load_json,
    smollm2,
    smollm2_head,
    smollm2_profile,
    write_section,
)
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings
from grpo_specdec.tasks.arithmetic import make_problems
from vllm_plugin.controller import (
    AcceptanceEstimator,
    FixedPolicy,
    FrozenAcceptance,
    GoodputPolicy,
    LatencyModel,
    PaperPolicy,
    conditional_from_cumulative,
)
from vllm_plugin.settings import hardware_name


def static_table(latency: LatencyModel, conditional, k_max: int, max_batch: int) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` ranges: the goodput-optimal k per
    batch size under acceptance measured once, offline."""
    ks = GoodputPolicy(latency, FrozenAcceptance(conditional), max_batch).table()
    ranges = []
    for b, k in enumerate(ks, start=1):
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = b
        else:
            ranges.append([b, b, int(k)])
    return ranges


@dataclass
class Config:
    """One compared configuration: its engine and, on the speculative engine, where k
    comes from and the acceptance estimator that only this configuration's runs feed."""

    engine: Engine
    policy: object = None  # a Policy, or vLLM's dense batch-size -> k list
    acceptance: AcceptanceEstimator | None = None


def run(engine: Engine, prompts: list[str], sampling: SamplingSettings) -> dict:
    res = engine.generate(prompts, sampling)
    return {
        "wall_s": res.wall_s,
        "tokens": res.num_generated_tokens,
        "mean_acceptance_length": res.spec["mean_acceptance_length"],
    }


def run_config(config: Config, prompts: list[str], sampling: SamplingSettings) -> dict:
    """One run from this configuration's own state: its policy and estimator in the
    scheduler, and an empty prefix cache (no run reuses another's prefill)."""
    config.engine.llm.reset_prefix_cache()
    if config.policy is None:
        return run(config.engine, prompts, sampling)
    scheduler = config.engine.scheduler()
    scheduler.set_policy(config.policy, config.acceptance)
    mark = scheduler.steps_scheduled
    out = run(config.engine, prompts, sampling)
    out["trace"] = [(t, b, k) for t, b, k, _ in scheduler.steps_since(mark)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument(
        "--tokens", type=int, default=64, help="tokens per request, fixed-concurrency workload"
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument(
        "--max-tokens", type=int, default=256, help="cap per sample, GRPO-shaped workload"
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(DOCS / "BENCHMARKS.md"))
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    target = smollm2()
    draft = smollm2_head(target)
    profile_path = smollm2_profile(target, draft, args.k_max)
    latency = LatencyModel.from_dict(load_json(profile_path)["latency"])
    max_batch = max(max(batch_sizes), args.prompts * args.group)
    common = dict(
        model=target, max_model_len=1024, max_num_seqs=max_batch, kv_cache_gib=2.0, seed=0
    )
    plain = Engine(EngineConfig(**common))
    spec = Engine(
        EngineConfig(
            **common,
            speculative={
                "draft": draft,
                "k": args.k_max,
                "concurrency_aware": True,
                "controller": {"policy": "goodput", "profile": str(profile_path)},
            },
        )
    )
    scheduler = spec.scheduler()

    questions = [p.question for p in make_problems(max_batch, seed=7, level=2)]
    grpo_prompts = [p.question for p in make_problems(args.prompts, seed=11, level=2)]
    grpo_sampling = SamplingSettings(n=args.group, temperature=1.0, max_tokens=args.max_tokens)

    # Calibrate the static table the way a user would: measure acceptance once at k_max.
    scheduler.set_policy(FixedPolicy(args.k_max))
    calib = spec.generate(grpo_prompts, grpo_sampling).spec
    conditional = conditional_from_cumulative(calib["per_position_acceptance"])
    table = static_table(latency, conditional, args.k_max, max_batch)
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    def on_spec(policy, acceptance=None) -> Config:
        return Config(spec, policy, acceptance or scheduler.new_acceptance())

    ours = scheduler.new_acceptance()
    configs = {
        "no spec": Config(plain),
        **{f"k={k}": on_spec(FixedPolicy(k)) for k in range(1, args.k_max + 1)},
        "static table": on_spec(build_dynamic_sd_schedule_lookup(table, max_batch, args.k_max)),
        "paper rule": on_spec(PaperPolicy(latency.c_peak, args.k_max)),
        "ours": on_spec(GoodputPolicy(latency, ours, max_batch), ours),
    }

    fixed: dict[str, dict[int, list[dict]]] = {n: {b: [] for b in batch_sizes} for n in configs}
    grpo: dict[str, list[dict]] = {n: [] for n in configs}
    for rep in range(args.repeats):
        for config in configs.values():  # warm both engines and each estimator before timing
            if rep == 0:
                run_config(config, questions[:4], SamplingSettings(max_tokens=8, ignore_eos=True))
        for b in batch_sizes:
            for name, config in configs.items():
                fixed[name][b].append(
                    run_config(
                        config,
                        questions[:b],
                        SamplingSettings(max_tokens=args.tokens, ignore_eos=True),
                    )
                )
        for name, config in configs.items():
            grpo[name].append(run_config(config, grpo_prompts, grpo_sampling))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    plain.shutdown()
    spec.shutdown()

    tps = lambda runs: statistics.median(r["tokens"] / r["wall_s"] for r in runs)  # noqa: E731
    results = {
        "hardware": hardware_name(),
        "k_max": args.k_max,
        "c_peak": latency.c_peak,
        "static_table": table,
        "calibration_conditional_acceptance": conditional.tolist(),
        "fixed": {
            n: {
                b: {
                    "tokens_per_s": tps(runs),
                    "mal": statistics.median(r["mean_acceptance_length"] for r in runs),
                }
                for b, runs in per_b.items()
            }
            for n, per_b in fixed.items()
        },
        "grpo": {
            n: {
                "tokens_per_s": tps(runs),
                "wall_s": statistics.median(r["wall_s"] for r in runs),
                "mal": statistics.median(r["mean_acceptance_length"] for r in runs),
            }
            for n, runs in grpo.items()
        },
        "traces": {n: grpo[n][-1].get("trace", []) for n in ("ours", "paper rule", "static table")},
        "args": vars(args),
    }
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / "rollout_throughput.json").write_text(json.dumps(results, indent=1))
    plot(results, batch_sizes)
    write_section(Path(args.out), "rollout-throughput", report(results, batch_sizes))
    print(report(results, batch_sizes))


def report(r: dict, batch_sizes: list[int]) -> str:
    names = list(r["fixed"])
    base = r["fixed"]["no spec"]
    lines = [
        "## Rollout throughput (SmolLM2-135M, CPU)",
        "",
        f"Measured with `python benchmarks/rollout_throughput.py` on {r['hardware']}, "
        f"k_max = {r['k_max']}, profiled C_peak = {r['c_peak']:.0f} tokens. Median of "
        f"{r['args']['repeats']} interleaved repeats; every configuration in one run.",
        "",
        f"### Fixed concurrency: generated tokens/s (ratio to no speculation), {r['args']['tokens']} tokens per request, greedy",
        "",
        "| config | " + " | ".join(f"B={b}" for b in batch_sizes) + " |",
        "|---|" + "---|" * len(batch_sizes),
    ]
    for n in names:
        cells = [
            f"{r['fixed'][n][b]['tokens_per_s']:.0f} ({r['fixed'][n][b]['tokens_per_s'] / base[b]['tokens_per_s']:.2f}x)"
            for b in batch_sizes
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    best_fixed = {
        b: max(r["fixed"][n][b]["tokens_per_s"] for n in names if n.startswith("k="))
        for b in batch_sizes
    }
    lines += [
        "",
        "Ours vs the best fixed k at each B: "
        + ", ".join(
            f"B={b}: {r['fixed']['ours'][b]['tokens_per_s'] / best_fixed[b]:.2f}x"
            for b in batch_sizes
        )
        + ".",
        "",
    ]
    g = r["grpo"]
    a = r["args"]
    lines += [
        f"### GRPO-shaped rollout: {a['prompts']} prompts x {a['group']} samples, temperature 1.0, max {a['max_tokens']} tokens",
        "",
        "| config | tokens/s | vs no spec | wall s | mean acceptance length |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        lines.append(
            f"| {n} | {g[n]['tokens_per_s']:.0f} | {g[n]['tokens_per_s'] / g['no spec']['tokens_per_s']:.2f}x | "
            f"{g[n]['wall_s']:.1f} | {g[n]['mal']:.2f} |"
        )
    lines += [
        "",
        f"Static table used: `{r['static_table']}` (from the profile and acceptance "
        f"{[round(x, 2) for x in r['calibration_conditional_acceptance']]} measured once at k={r['k_max']}).",
        "",
        "![throughput vs B](assets/rollout_throughput_vs_b.png)",
        "",
        "![k chosen over a GRPO rollout](assets/rollout_k_trace.png)",
    ]
    return "\n".join(lines)


def plot(r: dict, batch_sizes: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, per_b in r["fixed"].items():
        style = "-o" if n in ("ours", "no spec", "paper rule", "static table") else ":."
        ax.plot(
            batch_sizes,
            [per_b[b]["tokens_per_s"] for b in batch_sizes],
            style,
            label=n,
            lw=2 if n == "ours" else 1,
        )
    ax.set(
        xscale="log",
        xlabel="concurrency B",
        ylabel="generated tokens/s",
        title="Fixed-concurrency throughput",
    )
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ASSETS / "rollout_throughput_vs_b.png", dpi=120)

    fig, axes = plt.subplots(len(r["traces"]), 1, figsize=(8, 2.2 * len(r["traces"])), sharex=True)
    for ax, (n, trace) in zip(np.atleast_1d(axes), r["traces"].items(), strict=True):
        if not trace:
            continue
        t0 = trace[0][0]
        t = [x[0] - t0 for x in trace]
        ax.step(t, [x[2] for x in trace], where="post", label="k chosen", color="C0")
        ax.set_ylabel(f"{n}\nk")
        ax2 = ax.twinx()
        ax2.plot(t, [x[1] for x in trace], color="C1", alpha=0.6, label="running B")
        ax2.set_ylabel("B")
    np.atleast_1d(axes)[-1].set_xlabel("seconds into the GRPO-shaped rollout")
    fig.suptitle("k chosen per step (blue) as concurrency (orange) decays")
    fig.tight_layout()
    fig.savefig(ASSETS / "rollout_k_trace.png", dpi=120)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f}s")
