"""End-to-end GRPO speedup and ablation on SmolLM2-135M, the paper's table on our stack.

    python benchmarks/e2e_grpo.py [--shape default|generation_heavy] [--iterations N]
        [--set model.device=cuda --set ray.rollout_gpus=1 ...]

The same GRPO run (seed, data, iterations) in five configurations:
  (a) no speculation
  (b) fixed-k EAGLE, frozen draft            (common practice)
  (c) concurrency-aware, frozen draft
  (d) fixed k, online draft learning
  (e) full: concurrency-aware + online draft learning
Each is a real `grpo-specdec train` job (Ray, vLLM, hot-swaps). Results, with the time
split per iteration and acceptance length per iteration, go into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import (
    ASSETS,
    DOCS,
    ROOT,
    smollm2,
    smollm2_head,
    smollm2_profile,
    write_section,
)
from grpo_specdec.config import load_yaml
from grpo_specdec.job.config import TrainConfig
from vllm_plugin.settings import hardware_name

CONFIGS = {
    "a": ("no speculation", ["rollout.speculation=off", "draft.online=false"]),
    "b": ("fixed k, frozen draft", ["rollout.speculation=fixed", "draft.online=false"]),
    "c": (
        "concurrency-aware, frozen draft",
        ["rollout.speculation=concurrency_aware", "draft.online=false"],
    ),
    "d": ("fixed k, online draft", ["rollout.speculation=fixed", "draft.online=true"]),
    "e": (
        "full (concurrency-aware + online)",
        ["rollout.speculation=concurrency_aware", "draft.online=true"],
    ),
}
SHAPES = {
    "default": [],  # configs/smollm2_arith.yaml as is
    # Twice the tokens per sample and per group, half the groups: longer low-concurrency tails.
    "generation_heavy": [
        "rollout.prompts_per_iteration=2",
        "rollout.group_size=16",
        "rollout.max_tokens=256",
        "data.levels=[2,3]",
    ],
}


def run_config(
    key: str,
    shape: str,
    iterations: int,
    k: int,
    head: str,
    profile: Path,
    out_root: Path,
    extra: list[str],
) -> list[dict]:
    from grpo_specdec.job.run import Job

    out = out_root / shape / key
    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        *SHAPES[shape],
        *CONFIGS[key][1],
        f"iterations={iterations}",
        f"checkpoint_every={iterations}",
        f"rollout.k={k}",
        f"model.draft={head}",
        f"rollout.controller.profile={profile}",
        f"out={out}",
        *extra,
    ]
    cfg = load_yaml(TrainConfig, ROOT / "configs" / "smollm2_arith.yaml", overrides)
    job = Job(cfg)
    try:
        job.run()
    finally:
        job.shutdown()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for key, recs in runs.items():

        def mean(field, recs=recs):
            return statistics.mean(r[field] for r in recs)

        out[key] = {
            "generation_s": mean("generation_s"),
            "policy_update_s": mean("policy_update_s"),
            "draft_train_s": mean("draft_train_s"),
            "draft_wait_s": mean("draft_wait_s"),
            "sync_s": mean("sync_s"),
            "iteration_s": mean("iteration_s"),
            "reward": mean("reward_mean"),
            "accuracy": mean("accuracy"),
            "mal": [r["mean_acceptance_length"] for r in recs],
            "rewards": [r["rewards"] for r in recs],
            "tokens_per_s": mean("tokens_per_s"),
        }
    return out


def welch_t(x: list[float], y: list[float]) -> float:
    """Welch's t statistic for a difference in means (|t| < 2: within sampling noise)."""
    vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    return (statistics.mean(x) - statistics.mean(y)) / math.sqrt(vx + vy) if vx + vy > 0 else 0.0


def report(shape: str, s: dict, iterations: int, args) -> str:
    a = s["a"]
    gen_share = a["generation_s"] / a["iteration_s"]
    lines = [
        f"{iterations} iterations per configuration, the same seed and data in each.",
        "",
        f"Generation is {100 * gen_share:.0f}% of an iteration without speculation.",
        "",
        "| config | generation s/iter | policy update s | draft train s | sync s | iteration s | generation speedup vs (a) | end-to-end speedup vs (a) | mean acceptance length (first → last) | reward | t vs (a) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    flat_a = [x for it in a["rewards"] for x in it]
    for key, (name, _) in CONFIGS.items():
        r = s[key]
        flat = [x for it in r["rewards"] for x in it]
        lines.append(
            f"| ({key}) {name} | {r['generation_s']:.1f} | {r['policy_update_s']:.1f} | {r['draft_train_s']:.1f} | "
            f"{r['sync_s']:.2f} | {r['iteration_s']:.1f} | {a['generation_s'] / r['generation_s']:.2f}x | "
            f"{a['iteration_s'] / r['iteration_s']:.2f}x | {r['mal'][0]:.2f} → {r['mal'][-1]:.2f} | {r['reward']:.3f} | "
            f"{welch_t(flat, flat_a):+.2f} |"
        )
    e, b = s["e"], s["b"]
    lines += [
        "",
        "t vs (a): Welch's t of the per-sample rewards against (a); |t| < 2 means the reward "
        "curves agree within sampling noise, as lossless speculation should.",
        "",
        f"End-to-end speedup of (e): {a['iteration_s'] / e['iteration_s']:.2f}x over (a), "
        f"{b['iteration_s'] / e['iteration_s']:.2f}x over (b). Generation time of (e) vs (b), (c), (d): "
        + ", ".join(f"{s[k]['generation_s'] / e['generation_s']:.2f}x" for k in ("b", "c", "d"))
        + " (>1 means (e) is faster).",
        "",
        f"![acceptance length per iteration](assets/e2e_{shape}_acceptance.png) ![time split](assets/e2e_{shape}_split.png)",
    ]
    return "\n".join(lines)


def plot(shape: str, s: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in "bcde":
        ax.plot(
            range(1, len(s[key]["mal"]) + 1),
            s[key]["mal"],
            "-o",
            label=f"({key}) {CONFIGS[key][0]}",
        )
    ax.set(
        xlabel="GRPO iteration",
        ylabel="mean acceptance length",
        title=f"Acceptance length ({shape})",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ASSETS / f"e2e_{shape}_acceptance.png", dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4))
    parts = ["generation_s", "policy_update_s", "draft_wait_s", "sync_s"]
    bottom = [0.0] * len(CONFIGS)
    for part in parts:
        vals = [s[k][part] for k in CONFIGS]
        ax.bar(
            [f"({k})" for k in CONFIGS],
            vals,
            bottom=bottom,
            label=part.removesuffix("_s").replace("_", " "),
        )
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set(ylabel="seconds per iteration", title=f"Iteration time split ({shape})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ASSETS / f"e2e_{shape}_split.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=list(SHAPES), default="default")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--configs", default="abcde")
    ap.add_argument("--out", default=str(ROOT / "runs" / "e2e"))
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every run, e.g. model.device=cuda (repeatable)",
    )
    args = ap.parse_args()
    target = smollm2()
    head = smollm2_head(target)
    profile = smollm2_profile(target, head, args.k)
    runs, started = {}, time.time()
    for key in args.configs:
        t = time.time()
        runs[key] = run_config(
            key, args.shape, args.iterations, args.k, head, profile, Path(args.out), args.set
        )
        print(f"({key}) {CONFIGS[key][0]}: {time.time() - t:.0f}s", flush=True)
    s = summarize(runs)
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / f"e2e_{args.shape}.json").write_text(
        json.dumps({"hardware": hardware_name(), "summary": s, "args": vars(args)}, indent=1)
    )
    if set(args.configs) == set(CONFIGS):
        plot(args.shape, s)
        body = (
            f"## End-to-end GRPO, shape `{args.shape}` (SmolLM2-135M)\n\n"
            f"Measured with `python benchmarks/e2e_grpo.py --shape {args.shape} --iterations {args.iterations}"
            + "".join(f" --set {kv}" for kv in args.set)
            + f"` on {hardware_name()} in {time.time() - started:.0f}s.\n\n"
            + report(args.shape, s, args.iterations, args)
        )
        write_section(DOCS / "BENCHMARKS.md", f"e2e-{args.shape}", body)
        print(body)


if __name__ == "__main__":
    main()
