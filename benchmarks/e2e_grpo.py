"""End-to-end GRPO speedup and ablation on SmolLM2-135M, the paper's table on our stack.

    python benchmarks/e2e_grpo.py [--shape SHAPE] [--iterations N] [--configs abcde]
        [--set model.device=cuda --set ray.rollout_gpus=1 ...]
    python benchmarks/e2e_grpo.py --shape SHAPE --report-only   # docs from the saved JSON

The same GRPO run (seed, data, iterations) in five configurations:
  (a) no speculation
  (b) fixed-k EAGLE, frozen draft            (common practice)
  (c) concurrency-aware, frozen draft
  (d) fixed k, online draft learning
  (e) full: concurrency-aware + online draft learning
Each is a real `grpo-specdec train` job (Ray, vLLM, hot-swaps). Each shape's results are
saved to docs/assets/e2e_SHAPE.json; docs/benchmarks/e2e_grpo.md is rewritten from every
shape saved there, with the time split and acceptance length per iteration.
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
    ROOT,
    load_json,
    parser,
    prose,
    protocol_args,
    pyplot,
    quiet_machine,
    smollm2,
    smollm2_head,
    smollm2_profile,
    table,
    write_study,
)
from grpo_specdec.config import load_yaml
from grpo_specdec.job.config import TrainConfig
from vllm_plugin.settings import hardware_name

CONFIGS = {  # key -> (name, overrides)
    key: (name, [f"rollout.speculation={speculation}", f"draft.online={online}"])
    for key, name, speculation, online in [
        ("a", "no speculation", "off", "false"),
        ("b", "fixed k, frozen draft", "fixed", "false"),
        ("c", "concurrency-aware, frozen draft", "concurrency_aware", "false"),
        ("d", "fixed k, online draft", "fixed", "true"),
        ("e", "full (concurrency-aware + online)", "concurrency_aware", "true"),
    ]
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
    # The tail shape (grpo_specdec/tasks/length_budgets.py) in every iteration: levels 1-4, each
    # sample its own log-normal budget (median 128) under a 512 cap, so that few requests are
    # left in flight for much of each rollout, as in real GRPO rollouts.
    "tail": [
        "data.levels=[1,2,3,4]",
        "rollout.max_tokens=512",
        "rollout.length_budget.median=128",
    ],
    # 4x the default learning rate: the policy moves within ~20 iterations, so a frozen draft
    # can go stale (at 5e-6 it barely moves, and frozen and online stay alike).
    "policy_drift": ["policy.lr=2e-5"],
    # 20x: far above a sensible GRPO rate, to see whether a frozen draft goes stale at all
    # once the policy does move in 20 iterations.
    "fast_drift": ["policy.lr=1e-4"],
}


def run_config(key: str, args: argparse.Namespace, head: str, profile: Path) -> list[dict]:
    """Configuration `key`'s GRPO job on `args.shape` (a finished run of the same settings
    under --out reused with --reuse); its metrics per iteration."""
    from grpo_specdec.job.run import Job

    out = Path(args.out) / args.shape / key
    overrides = [
        *SHAPES[args.shape],
        *CONFIGS[key][1],
        f"iterations={args.iterations}",
        f"checkpoint_every={args.iterations}",
        f"rollout.k={args.k}",
        f"model.draft={head}",
        f"rollout.controller.profile={profile}",
        f"out={out}",
        *args.set,
    ]
    saved = out / "overrides.json"  # a run of exactly these overrides that reached its end
    if args.reuse and saved.is_file() and json.loads(saved.read_text()) == overrides:
        if len(metrics := _metrics(out)) == args.iterations:
            print(f"({key}) reusing the finished run in {out}", flush=True)
            return metrics
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_yaml(TrainConfig, ROOT / "configs" / "smollm2_arith.yaml", overrides)
    job = Job(cfg)
    try:
        job.run()
    finally:
        job.shutdown()
    saved.write_text(json.dumps(overrides))
    return _metrics(out)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# The metrics (metrics.jsonl's names) whose mean per iteration each configuration reports.
MEANS = ("generation_s", "policy_update_s", "draft_train_s", "draft_wait_s", "sync_s")
MEANS += ("iteration_s", "accuracy", "tokens_per_s")


def shape_config(shape: str, sets: list[str]) -> TrainConfig:
    """The config the runs of this shape are run with, before each configuration's own."""
    return load_yaml(TrainConfig, ROOT / "configs" / "smollm2_arith.yaml", [*SHAPES[shape], *sets])


def prompt_means(rewards: list[list[float]], group: int) -> list[float]:
    """Mean reward of each prompt's group of samples, in the order the prompts were drawn.

    `rewards` holds one flat list per iteration, prompt-major (the group of prompt 0 first).
    """
    flat = [x for iteration in rewards for x in iteration]
    return [statistics.mean(flat[i : i + group]) for i in range(0, len(flat), group)]


def paired_t(x: list[float], y: list[float]) -> float:
    """Paired t statistic of mean(x - y) over matched units (|t| < 2: within sampling noise)."""
    d = [a - b for a, b in zip(x, y, strict=True)]
    m, sd = statistics.mean(d), statistics.stdev(d)
    if sd == 0:
        return 0.0 if m == 0 else math.copysign(math.inf, m)
    return m / (sd / math.sqrt(len(d)))


def trend(values: list[float]) -> tuple[float, float, float]:
    """(mean of the first quarter, mean of the last quarter, least-squares slope per iteration)."""
    q = max(1, len(values) // 4)
    slope = (
        statistics.linear_regression(range(len(values)), values).slope if len(values) > 1 else 0.0
    )
    return statistics.mean(values[:q]), statistics.mean(values[-q:]), slope


def report(shape: str, s: dict, iterations: int, group: int) -> str:
    keys = [k for k in CONFIGS if k in s]
    a = s.get("a")
    ref = keys[0]  # rewards are compared with (a) when it ran
    ref_means = prompt_means(s[ref]["rewards"], group)
    reward_per_iteration = {k: [statistics.mean(it) for it in s[k]["rewards"]] for k in keys}
    lines = [f"{iterations} iterations per configuration, the same seed and data in each.", ""]
    if a:
        share = a["generation_s"] / a["iteration_s"]
        lines += [f"Generation is {100 * share:.0f}% of an iteration without speculation.", ""]
    columns = ["config", "generation s/iter", "policy update s", "draft train s", "sync s"]
    columns += ["iteration s"]
    if a:
        columns += ["generation speedup vs (a)", "end-to-end speedup vs (a)"]
    columns += ["reward", f"paired t vs ({ref})"]

    def row(key: str) -> list:
        r = s[key]
        cells = [f"({key}) {CONFIGS[key][0]}", f"{r['generation_s']:.1f}"]
        cells += [f"{r['policy_update_s']:.1f}", f"{r['draft_train_s']:.1f}", f"{r['sync_s']:.2f}"]
        cells += [f"{r['iteration_s']:.1f}"]
        if a:
            cells += [f"{a[f] / r[f]:.2f}x" for f in ("generation_s", "iteration_s")]
        means = prompt_means(r["rewards"], group)
        return cells + [
            f"{r['reward']:.3f}",
            "-" if key == ref else f"{paired_t(means, ref_means):+.2f}",
        ]

    lines += table(columns, map(row, keys))
    if len(keys) > 1:
        fields = {"ref": ref, "group": group, "prompts": len(ref_means)}
        lines += ["", prose("e2e_grpo", "paired_t", **fields, freedom=len(ref_means) - 1)]

    def trends(key: str) -> list:
        r = s[key]
        rf, rl, rs = trend(reward_per_iteration[key])
        mf, ml, ms = trend(r["mal"])
        if "draft_policy_lag" in r:
            lags = sorted({lag for lag in r["draft_policy_lag"] if lag is not None})
            lag = ", ".join(map(str, lags)) or "-"
        else:  # saved before the job logged the lag
            lag = "not recorded"
        cells = [f"({key})", f"{rf:.3f} → {rl:.3f}", f"{rs:+.4f}", f"{mf:.2f} → {ml:.2f}"]
        return [*cells, f"{ms:+.4f}", lag]

    header = ["config", "reward first → last", "reward slope"]
    header += ["mean acceptance length first → last", "acceptance length slope"]
    lines += ["", prose("e2e_grpo", "trends", quarter=max(1, iterations // 4)), ""]
    lines += table([*header, "draft lag (policy versions)"], map(trends, keys))
    lines += ["", "Per iteration (reward mean / mean acceptance length):", ""]
    lines += table(
        ["iteration", *(f"({k})" for k in keys)],
        (
            [i + 1, *(f"{reward_per_iteration[k][i]:.3f} / {s[k]['mal'][i]:.2f}" for k in keys)]
            for i in range(iterations)
        ),
    )
    if set(keys) == set(CONFIGS):
        e = s["e"]
        fields = {f"over_{k}": f"{s[k]['iteration_s'] / e['iteration_s']:.2f}x" for k in "ab"}
        generation = (f"{s[k]['generation_s'] / e['generation_s']:.2f}x" for k in "bcd")
        lines += ["", prose("e2e_grpo", "full", **fields, generation=", ".join(generation))]
    lines += ["", prose("e2e_grpo", "plots", shape=shape)]
    return "\n".join(lines)


def plot(shape: str, s: dict) -> None:
    plt = pyplot()

    keys = [k for k in CONFIGS if k in s]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in (k for k in keys if k != "a"):
        mal = s[key]["mal"]
        ax.plot(range(1, len(mal) + 1), mal, "-o", label=f"({key}) {CONFIGS[key][0]}")
    title = f"Acceptance length ({shape})"
    ax.set(xlabel="GRPO iteration", ylabel="mean acceptance length", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ASSETS / f"e2e_{shape}_acceptance.png", dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4))
    parts = ["generation_s", "policy_update_s", "draft_wait_s", "sync_s"]
    bottom = [0.0] * len(keys)
    for part in parts:
        vals = [s[k][part] for k in keys]
        label = part.removesuffix("_s").replace("_", " ")
        ax.bar([f"({k})" for k in keys], vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set(ylabel="seconds per iteration", title=f"Iteration time split ({shape})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ASSETS / f"e2e_{shape}_split.png", dpi=120)


def measure(args: argparse.Namespace) -> dict:
    """Run the configurations; their results as saved in docs/assets/e2e_SHAPE.json: per
    configuration the mean of MEANS per iteration, and its rewards, mean acceptance length
    and draft lag in each."""
    target = smollm2()
    head = smollm2_head(target)
    # Timed as the runs draft: greedily or sampling (the config's rollout.draft_sampling).
    drafting = shape_config(args.shape, args.set).rollout.draft_sampling
    profile = smollm2_profile(target, head, args.k, drafting)
    summary, started = {}, time.time()
    for key in args.configs:
        t = time.time()
        recs = run_config(key, args, head, profile)
        print(f"({key}) {CONFIGS[key][0]}: {time.time() - t:.0f}s", flush=True)
        v = summary[key] = {f: statistics.mean(r[f] for r in recs) for f in MEANS}
        v["reward"] = statistics.mean(r["reward_mean"] for r in recs)
        v["mal"] = [r["mean_acceptance_length"] for r in recs]
        v["rewards"] = [r["rewards"] for r in recs]
        v["draft_policy_lag"] = [r.get("draft_policy_lag") for r in recs]
    return {
        "hardware": hardware_name(),
        "summary": summary,
        "args": vars(args),
        "wall_s": time.time() - started,
    }


def section(data: dict, rebuilt: bool) -> str:
    """The study file's part for one shape's saved results."""
    args = data["args"]
    shape, sets = args["shape"], args.get("set", [])
    command = (
        f"python benchmarks/e2e_grpo.py --shape {shape} --iterations {args['iterations']}"
        f" --configs {args['configs']}" + "".join(f" --set {kv}" for kv in sets)
    )
    measured = f"Measured with `{command}` on {data['hardware']}"
    if "wall_s" in data:
        measured += f" in {data['wall_s']:.0f}s"
    if args.get("reuse"):
        measured += " (finished configurations reused)"
    if rebuilt:
        measured += prose("e2e_grpo", "rebuilt", shape=shape)
    if "machine" in data:
        measured += f". {data['machine']['note'].removesuffix('.')}"
    return f"### Shape `{shape}`\n\n{measured}.\n\n" + report(
        shape, data["summary"], args["iterations"], shape_config(shape, sets).rollout.group_size
    )


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=list(SHAPES), default="default")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--configs", default="abcde")
    ap.add_argument("--out", default=str(ROOT / "runs" / "e2e"))
    what = "keep configurations that already finished with the same settings under --out"
    ap.add_argument("--reuse", action="store_true", help=what)
    what = "run nothing: rebuild docs/benchmarks/e2e_grpo.md from the saved "
    what += "docs/assets/e2e_SHAPE.json files"
    ap.add_argument("--report-only", action="store_true", help=what)
    what = "config override for every run, e.g. model.device=cuda (repeatable)"
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=what)
    protocol_args(ap, repeats=False)
    args = ap.parse_args()
    saved = ASSETS / f"e2e_{args.shape}.json"
    if args.report_only:
        data = load_json(saved)
    else:
        machine = quiet_machine(args)
        data = {**measure(args), "machine": machine}
        ASSETS.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(data, indent=1))
        plot(args.shape, data["summary"])
    own = section(data, rebuilt=args.report_only)
    print(own)
    parts = [
        own if shape == args.shape else section(load_json(path), rebuilt=True)
        for shape, path in ((s, ASSETS / f"e2e_{s}.json") for s in SHAPES)
        if shape == args.shape or path.is_file()
    ]
    write_study("e2e_grpo", "End-to-end GRPO (SmolLM2-135M)", "\n\n".join(parts), "e2e_grpo.py")


if __name__ == "__main__":
    main()
