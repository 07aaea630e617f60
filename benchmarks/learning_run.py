"""The learning run: the shipped recipe (configs/smollm2_arith.yaml) trained long enough to
learn, and speculation measured side by side as the policy sharpens.

    python benchmarks/learning_run.py                   # train (resuming a stopped run), measure, write
    python benchmarks/learning_run.py --report-only     # the study from the saved JSON

1. Training: `grpo-specdec train` on the shipped config with `--iterations`, a checkpoint at
   the middle and the end; per iteration from its metrics.jsonl: reward, accuracy, the
   policy's token entropy at T = 1, the online head's mean acceptance length (MAL) and its
   lag behind the policy; the held-out greedy accuracy from eval.jsonl.
2. At the start (SmolLM2 as shipped, the package's head), the middle and the end, that
   point's policy rolls out the tail shape side by side under the measurement protocol
   (`grpo_specdec/bench/measure.py`: warmed, order shuffled per round, --repeats rounds): no
   speculation, ours with the online head of that point (from nothing learnt each round, as
   at the job's first rollout, and warmed: from the state its warm-up rollout left, as at
   every later one), ours with the initial (frozen) head, and fixed k. Every configuration makes exactly the tokens each request made in a
   seeded rollout without speculation (EOS then ignored), so makespans compare equal work;
   then in rounds where each makes its own answers (natural EOS). The end point is measured
   again at T = 1, where the issue's acceptance goal is stated (the recipe samples at 0.7).
Each part is saved to docs/assets/learning_run.json as it finishes; a rerun skips what is
there (delete the file, or --fresh, to measure again).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import (
    ASSETS,
    ROOT,
    cli,
    command,
    fresh_controller,
    interval,
    ordered,
    parser,
    prose,
    protocol_args,
    pyplot,
    quiet_machine,
    table,
    warmed,
    write_study,
)
from grpo_specdec.checkpoint_pointer import latest_checkpoint

CONFIG = ROOT / "configs" / "smollm2_arith.yaml"
STUDY = "learning_run"  # --study: docs/benchmarks/STUDY.md, docs/assets/STUDY.json, .png
SAVED = ASSETS / f"{STUDY}.json"
# Earlier recipes, each one run of this script at the commit it names (their metrics.jsonl
# and eval.jsonl, as the job wrote them), beside the shipped recipe in the study.
ABLATION = ASSETS / "learning_ablation.json"
# The side-by-side rollout: the tail shape at the size the demo's comparison uses.
PROMPTS, GROUP, CAP, MEDIAN = 4, 8, 512, 128
FIXED_K = (2,)
NATURAL_REPEATS = 10  # the headline: lengths vary by chance from round to round
REWARD_PROMPTS, REWARD_SAMPLES = 64, 8  # the reward agreement check
# The held-out evaluation of the start and end policies by the CLI (its first 100 problems
# are the job's).
EVAL_EXAMPLES, EVAL_MAX_TOKENS, EVAL_DTYPES = 200, 128, ("float32", "bfloat16")
ROUNDED = "end, rounded to bfloat16"  # the end policy as its bf16 engine served it
END_AT_T1 = "end at T = 1"  # no comma: --points splits on commas
NO_SPEC, OURS = "no speculation", "ours, online head"  # OURS: nothing learnt at each round
# Ours from the state its first (warm-up) rollout left, as the job's engine after its first.
WARMED = "ours, online head, warmed"
POINTS = ("start", "middle", "end", END_AT_T1)  # the side-by-side rollouts, in the study's order
# The side-by-side configurations, in the study's order.
INITIAL, FIXED = "ours, initial head", [f"fixed k = {k}, online head" for k in FIXED_K]
CONFIGS = (NO_SPEC, OURS, WARMED, INITIAL, *FIXED)


def train(args, data: dict) -> None:
    out = Path(args.out)
    ckpt = latest_checkpoint(out / "checkpoints") if (out / "checkpoints").is_dir() else None
    start = time.time()
    cli(
        *("train", "--config", str(CONFIG), f"iterations={args.iterations}"),
        *(f"checkpoint_every={args.iterations // 2}", f"out={out}"),
        *(["--resume", str(out)] if ckpt else []),
    )
    data["training"] = {
        "records": [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()],
        "evals": [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()],
        "wall_s": time.time() - start,
        "resumed": ckpt is not None,
        "command": data["command"],
        "machine": data["machine"],
    }
    SAVED.write_text(json.dumps(data, indent=1))


def side_by_side(
    args, point: str, policy: str, online_head: str, initial_head: str, temperature: float
) -> dict:
    """The tail shape rolled out by `policy` at `temperature`: no speculation, ours with each
    head, fixed k."""
    from benchmarks.rollout_report import summarise
    from benchmarks.rollout_throughput import Config, replay_lengths, timed_rounds
    from grpo_specdec.config import load_yaml
    from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings
    from grpo_specdec.job.config import TrainConfig
    from grpo_specdec.job.engine_setup import engine_config, latency_profile, serving_dtype
    from grpo_specdec.job.models import resolve_model
    from grpo_specdec.tasks.arithmetic import make_problems
    from grpo_specdec.tasks.length_budgets import with_budgets
    from vllm_plugin.controller import FixedPolicy, profile_latency

    cfg = load_yaml(TrainConfig, CONFIG, [])
    base = resolve_model("smollm2")
    profile = latency_profile(cfg, base, initial_head, print)
    latency = profile_latency(json.loads(Path(profile).read_text()))
    questions = [p.question for lvl in (1, 2) for p in make_problems(PROMPTS // 2, 97, lvl)]
    shape = with_budgets(questions, GROUP, CAP, MEDIAN, 0.7, seed=5)

    def engine(head: str | None) -> Engine:
        # in the dtype the job served every point in (a checkpoint stores float32)
        fields = engine_config(cfg, policy, head, profile, serving_dtype(cfg, base))
        fields |= {"max_model_len": CAP + 256, "max_num_seqs": len(shape.prompts)}
        if head is None:
            fields["speculative"] = None
        return Engine(EngineConfig.model_validate(fields))

    plain, online, initial = engine(None), engine(online_head), engine(initial_head)
    try:
        sampling = SamplingSettings(temperature=temperature, max_tokens=CAP)
        workload = ("tail", "tail", "", shape.prompts, sampling)
        per_request = {"seeds": shape.seeds, "max_tokens": shape.max_tokens}
        endings: dict[str, int] = {}
        exact = replay_lengths(plain, (*workload, per_request), endings)
        n = len(shape.prompts)

        def ours(e: Engine) -> Config:
            return Config(e, fresh_controller(e.scheduler(), latency, n))

        configs = {
            NO_SPEC: Config(plain),
            OURS: ours(online),
            # as the job's engine starts every rollout after its first
            WARMED: Config(online, warmed(fresh_controller(online.scheduler(), latency, n))),
            INITIAL: ours(initial),
            **{f"fixed k = {k}, online head": Config(online, FixedPolicy(k)) for k in FIXED_K},
        }

        # Equal tokens: each request made as long as the reference made it, EOS ignored.
        label = f"{point}, equal tokens"
        equal = timed_rounds(configs, exact, args.repeats, args.order_seed, label)
        # Natural EOS: each configuration's own answers, under the same budgets and no
        # per-request seeds (under one seed the engines would still draw differently), so every
        # round of every configuration samples afresh; more rounds, as lengths vary.
        budgets = (*workload, {"max_tokens": shape.max_tokens})
        seed, label = args.order_seed + 1, f"{point}, natural EOS"
        natural = timed_rounds(configs, budgets, args.natural_repeats, seed, label)
        rewards = reward_agreement(cfg, plain, configs[OURS], temperature)
    finally:
        for e in (plain, online, initial):
            e.shutdown()
    return {
        "policy": policy,
        "temperature": temperature,
        "online_head": online_head,
        "endings": endings,
        "orders": equal.orders,
        "configs": summarise(equal, "tail", NO_SPEC),
        "natural": {"orders": natural.orders, "configs": summarise(natural, "tail", NO_SPEC)},
        "rewards": rewards,
    }


def reward_agreement(cfg, plain, ours, temperature: float) -> dict:
    """Does speculation change what the policy samples? Both engines answer the same
    REWARD_PROMPTS held-out problems REWARD_SAMPLES times at `temperature`;
    each prompt's mean reward is paired over prompts (|t| < 2: within sampling noise)."""
    from benchmarks.e2e_grpo import paired_t
    from grpo_specdec.engine import SamplingSettings
    from grpo_specdec.evaluate import arithmetic_eval_set
    from grpo_specdec.tasks.rewards import reward

    examples = arithmetic_eval_set(cfg.data.seed, cfg.data.levels, REWARD_PROMPTS)
    sampling = SamplingSettings(
        n=REWARD_SAMPLES, temperature=temperature, max_tokens=cfg.rollout.max_tokens
    )
    ours.engine.scheduler().set_policy(ours.policy())

    def prompt_means(engine) -> list[float]:
        engine.llm.reset_prefix_cache()
        groups = engine.generate([e.question for e in examples], sampling).outputs
        return [
            statistics.mean(
                reward(s.text, e.answer, cfg.reward.kind, cfg.reward.format_bonus) for s in group
            )
            for group, e in zip(groups, examples, strict=True)
        ]

    means = {NO_SPEC: prompt_means(plain), OURS: prompt_means(ours.engine)}
    return {
        "prompts": REWARD_PROMPTS,
        "samples": REWARD_SAMPLES,
        "prompt_means": means,
        "paired_t": paired_t(means[OURS], means[NO_SPEC]),
    }


def measure(args, data: dict) -> None:
    """The side-by-side rollouts not saved yet, of the points `name -> (iteration, policy,
    its online head, temperature)`: at the start, middle and end at the recipe's
    temperature, and at the end at T = 1."""
    from grpo_specdec.config import load_yaml
    from grpo_specdec.job.config import TrainConfig
    from grpo_specdec.job.models import resolve_model

    recipe_t = load_yaml(TrainConfig, CONFIG, []).rollout.temperature
    ckpts = Path(args.out) / "checkpoints"
    middle, end = args.iterations // 2, args.iterations
    end_policy = str(ckpts / f"iter_{end:06d}" / "policy")
    initial = resolve_model("smollm2-arith")
    points = {
        "start": (0, resolve_model("smollm2"), initial, recipe_t),
        "middle": (middle, str(ckpts / f"iter_{middle:06d}" / "policy"), "", recipe_t),
        "end": (end, end_policy, "", recipe_t),
        END_AT_T1: (end, end_policy, "", 1.0),
    }
    for name, (iteration, policy, head, temperature) in points.items():
        if name in data.get("points", {}) or name not in args.points.split(","):
            continue
        head = head or str(Path(policy).parent / "draft")
        result = side_by_side(args, name, policy, head, initial, temperature)
        data.setdefault("points", {})[name] = {
            "iteration": iteration,
            **result,
            "command": data["command"],
            "machine": data["machine"],
        }
        SAVED.write_text(json.dumps(data, indent=1))


def held_out(args, data: dict) -> None:
    """The start and end policies by `grpo-specdec eval`, side by side in one engine
    configuration, in float32 and in bfloat16: the job's own evaluations run in the
    engine it rolls out with, whose batch shapes move bfloat16 greedy decoding."""
    import tempfile

    evals = data.setdefault("held_out", {})
    # (point, its policy, engine dtype): the start and end in each dtype, and the end's
    # weights rounded to bfloat16 served in float32.
    runs = [(p, m, d) for d in EVAL_DTYPES for p, m in (("start", "smollm2"), ("end", args.out))]
    runs.append((ROUNDED, args.out, "float32"))
    for point, model, dtype in runs:
        key = f"{point}/{dtype}"
        if key in evals:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            if point == ROUNDED:
                model = rounded_to_bfloat16(model, Path(tmp) / "policy")
            report = Path(tmp) / "eval.json"
            cli(
                "eval",
                *("--model", model, "--num", str(EVAL_EXAMPLES), "--dtype", dtype),
                *("--max-tokens", str(EVAL_MAX_TOKENS), "--json", str(report)),
            )
            evals[key] = json.loads(report.read_text())
        SAVED.write_text(json.dumps(data, indent=1))


def rounded_to_bfloat16(run: str, out: Path) -> str:
    """A copy of the run's last policy with every weight rounded to bfloat16 (and stored
    as float32): the weights a bfloat16 engine serves, and a bf16-autocast learner computes
    with, given the float32 weights the checkpoint keeps for the optimiser."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from grpo_specdec.evaluate import policy_folder

    source = Path(policy_folder(run))
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in source.glob("*.safetensors"):
        weights = load_file(file)
        rounded = {k: v.to(torch.bfloat16).to(v.dtype) for k, v in weights.items()}
        save_file(rounded, out / file.name, metadata={"format": "pt"})
    return str(out)


def held_out_lines(evals: dict) -> list[str]:
    rows = [(dtype, f"start/{dtype}", f"end/{dtype}") for dtype in EVAL_DTYPES]
    rows.append((f"float32, the end's weights {ROUNDED.split(', ')[1]}", "start/float32"))
    rows[-1] += (f"{ROUNDED}/float32",)
    fields = {"examples": EVAL_EXAMPLES, "max_tokens": EVAL_MAX_TOKENS}
    return [
        prose("learning_run", "held_out", **fields),
        "",
        *table(
            ["engine dtype", "start", "end", "end / start", "points"],
            (
                [label, _accuracy(start), _accuracy(end)]
                + [f"{end['accuracy'] / max(start['accuracy'], 1e-9):.2f}x"]
                + [f"{100 * (end['accuracy'] - start['accuracy']):+.1f}"]
                for label, start, end in ((r[0], evals.get(r[1]), evals.get(r[2])) for r in rows)
                if start and end
            ),
        ),
    ]


def _accuracy(e: dict) -> str:
    return f"{e['accuracy']:.3f} [{e['interval'][0]:.3f}, {e['interval'][1]:.3f}]"


def _slope(ys: list[float], boot: int = 4000) -> tuple[float, float, float]:
    """Least-squares slope per iteration, and its 95% interval from a bootstrap over the
    iterations (pairs resampled with replacement)."""
    import random

    def fit(points: list[tuple[int, float]]) -> float:
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0

    points = list(enumerate(ys, 1))
    rng = random.Random(0)
    slopes = sorted(fit(rng.choices(points, k=len(points))) for _ in range(boot))
    return fit(points), slopes[int(0.025 * (boot - 1))], slopes[int(0.975 * (boot - 1))]


def report(data: dict) -> str:
    from grpo_specdec.bench.compare import k_by_batch_text

    training = data["training"]
    records, evals = training["records"], training["evals"]
    first, last = evals[0], evals[-1]
    slope, low, high = _slope([r["reward_mean"] for r in records])
    learning = prose(
        "learning_run",
        "learning",
        command=training["command"],
        hardware=data["hardware"],
        note=training["machine"]["note"],
        iterations=len(records),
        minutes=f"{training['wall_s'] / 60:.0f}",
        resumed=" (resumed once)" if training["resumed"] else "",
        examples=first["examples"],
        first=_accuracy(first),
        last=_accuracy(last),
        last_iteration=last["iteration"],
        ratio=f"{last['accuracy'] / max(first['accuracy'], 1e-9):.2f}",
        points=f"{100 * (last['accuracy'] - first['accuracy']):+.1f}",
        slope=f"{slope:+.4f}",
        low=f"{low:+.4f}",
        high=f"{high:+.4f}",
    )
    lines = [
        learning,
        "",
        *(held_out_lines(data["held_out"]) + [""] if data.get("held_out") else []),
    ]
    header = ["iteration", "reward", "accuracy (train samples)", "entropy at T=1"]
    header += ["MAL in the rollout (online head)", "head's top-1 on the rollout", "draft lag"]
    by_eval = {e["iteration"]: e for e in evals}

    def row(r: dict) -> list:
        e = by_eval.get(r["iteration"])
        drafted = any(int(k) > 0 for k in r["k_steps"])
        mal = f"{r['mean_acceptance_length']:.2f}" if drafted else "none drafted (k = 0)"
        cells = [r["iteration"], f"{r['reward_mean']:.3f}", f"{r['accuracy']:.3f}"]
        cells += [f"{r['policy_entropy']:.3f}", mal, f"{r['draft_top1']:.3f}"]
        return [*cells, r["draft_policy_lag"], f"{e['accuracy']:.3f}" if e else ""]

    learning_table = table([*header, "held-out greedy accuracy"], map(row, records))
    if 0 in by_eval:  # before training: the held-out accuracy alone
        learning_table.insert(2, f"| 0 | | | | | | | {by_eval[0]['accuracy']:.3f} |")
    lines += learning_table
    points = data.get("points", {})
    # the points in a stable order: by iteration, then as POINTS lists them
    names = sorted(ordered(points, POINTS), key=lambda n: points[n]["iteration"])
    measured = [
        f"The {n} point measured with `{points[n]['command']}` ({rounds(points[n]['configs'])} "
        f"rounds, {rounds(points[n]['natural']['configs'])} with natural EOS). "
        + points[n]["machine"]["note"]
        for n in names
    ]
    fields = {"prompts": PROMPTS, "group": GROUP, "median": MEDIAN, "cap": CAP, "t1": END_AT_T1}
    lines += ["", prose("learning_run", "side_by_side", **fields), "", *measured, ""]
    lines += [prose("learning_run", "after_eos"), ""]

    def rows(configs_of) -> list[tuple[str, str, dict]]:
        """(point, config, its summary) of every point's rounds, in a stable order."""
        return [
            (n, c, configs_of(points[n])[c])
            for n in names
            for c in ordered(configs_of(points[n]), CONFIGS)
        ]

    def compared(n: str, c: str, v: dict, makespan: str) -> list:
        verdict = "-" if c == NO_SPEC else v["speedup"]["verdict"]
        sp = interval(v, verdict=False)
        return [n, points[n]["iteration"], c, makespan, sp, verdict, f"{v['mal']:.2f}"]

    header = ["point", "iteration", "config", "makespan s", "speedup [95% interval]", "verdict"]
    lines += table(
        [*header, "MAL", "MAL before EOS", "after EOS"],
        (
            compared(n, c, v, f"{v['makespan_s']:.1f}")
            + [f"{v['mal_before_eos']:.2f}", f"{v['tokens_after_eos']:.0f} of {v['tokens']}"]
            for n, c, v in rows(lambda p: p["configs"])
        ),
    )

    def natural_row(n: str, c: str, v: dict) -> list:
        runs, ks = v["makespan_s_runs"], v["k_steps"]
        steps = sum(sum(h.values()) for h in ks)
        drafted = sum(m for h in ks for k, m in h.items() if int(k) > 0)
        makespan = f"{v['makespan_s']:.2f} [{min(runs):.2f}, {max(runs):.2f}]"
        tokens = f"{statistics.median(v['tokens_runs']):.0f}"
        return compared(n, c, v, makespan) + [tokens, f"{drafted / steps:.0%}" if steps else "-"]

    natural = rows(lambda p: p["natural"]["configs"])
    header = ["point", "iteration", "config", "makespan s, median [min, max]"]
    header += ["speedup [95% interval]", "verdict", "MAL", "tokens, median"]
    lines += ["", prose("learning_run", "natural"), ""]
    lines += table([*header, "steps with k > 0"], (natural_row(*r) for r in natural))
    histograms = [
        f"- {n}, {c}: {k_by_batch_text(v['k_by_batch'])}"
        for n, c, v in natural
        if v.get("k_by_batch") and c != NO_SPEC
    ]
    if histograms:
        lines += ["", "Steps per k by range of running requests B, all natural-EOS rounds:"]
        lines += ["", *histograms]

    def agreement(n: str) -> list:
        r = points[n]["rewards"]
        means = (f"{statistics.mean(r['prompt_means'][c]):.3f}" for c in (NO_SPEC, OURS))
        return [n, f"{r['prompts']} x {r['samples']}", *means, f"{r['paired_t']:+.2f}"]

    header = ["point", "prompts x samples", "reward, no speculation", "reward, ours", "paired t"]
    lines += ["", prose("learning_run", "rewards"), "", *table(header, map(agreement, names))]
    lines += ["", f"![learning curve and speedup](../assets/{STUDY}.png)"]
    if ABLATION.is_file():
        lines += ["", *ablation_table(json.loads(ABLATION.read_text())["arms"], data)]
    return "\n".join(lines)


def rounds(configs: dict) -> int:
    return len(next(iter(configs.values()))["makespan_s_runs"])


def ablation_table(arms: list[dict], data: dict) -> list[str]:
    """One row per recipe: what it changed and how its run went."""
    shipped = {
        "name": "shipped recipe",
        "change": "no format bonus; rollouts at T = 0.7, log-probabilities at T = 0.7; lr 3e-5; "
        "8 prompts x 8 per iteration",
        "stopped": None,
        **data["training"],
    }

    def row(arm: dict) -> list:
        records, evals = arm["records"], arm["evals"]
        slope, low, high = _slope([r["reward_mean"] for r in records])
        stopped = f" ({arm['stopped']})" if arm["stopped"] else ""
        return [
            arm["name"],
            arm["change"],
            f"{len(records)}{stopped}",
            ", ".join(f"{e['iteration']}: {e['accuracy']:.2f}" for e in evals),
            f"{slope:+.4f} [{low:+.4f}, {high:+.4f}]",
            f"{records[0]['policy_entropy']:.2f} -> {records[-1]['policy_entropy']:.2f}",
            f"{records[0]['response_length']:.0f} -> {records[-1]['response_length']:.0f}",
        ]

    header = ["recipe", "what differs", "iterations", "held-out greedy accuracy by iteration"]
    header += ["reward slope [95%]", "entropy at T=1, first -> last"]
    return [
        "### Ablation: the recipes tried, one run each on this machine",
        "",
        *table([*header, "response tokens, first -> last"], map(row, [*arms, shipped])),
        "",
        "Commands: " + "; ".join(f"{a['name']}: `{a['command']}`" for a in arms),
    ]


def plot(data: dict) -> None:
    plt = pyplot()

    records, evals = data["training"]["records"], data["training"]["evals"]
    its = [r["iteration"] for r in records]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    at = [e["iteration"] for e in evals]
    axes[0].plot(at, [e["accuracy"] for e in evals], "o-")
    low, high = [e["interval"][0] for e in evals], [e["interval"][1] for e in evals]
    axes[0].fill_between(at, low, high, alpha=0.2)
    axes[0].plot(its, [r["reward_mean"] for r in records], ":", label="reward (train)")
    axes[0].set(title="held-out greedy accuracy", xlabel="iteration")
    axes[0].legend()
    axes[1].plot(its, [r.get("policy_entropy", float("nan")) for r in records])
    axes[1].set(title="token entropy at T = 1", xlabel="iteration")
    drafted = [any(int(k) > 0 for k in r["k_steps"]) for r in records]
    mal = [r["mean_acceptance_length"] if d else float("nan") for r, d in zip(records, drafted)]
    axes[2].plot(its, mal, "o-", label="MAL in the rollout (where it drafted)")
    axes[2].plot(its, [r.get("draft_top1", float("nan")) for r in records], label="head top-1")
    axes[2].set(title="the online head", xlabel="iteration")
    axes[2].legend(fontsize=7)
    for config in (OURS, INITIAL, *FIXED):
        # The rollouts as a rollout makes them (natural EOS).
        pts = [
            (p["iteration"], p["natural"]["configs"][config])
            for name, p in data.get("points", {}).items()
            if name != END_AT_T1
        ]
        if pts:
            at, sp = [i for i, _ in pts], [v["speedup"] for _, v in pts]
            yerr = [[s["median"] - s["low"] for s in sp], [s["high"] - s["median"] for s in sp]]
            median = [s["median"] for s in sp]
            axes[3].errorbar(at, median, yerr=yerr, marker="o", capsize=3, label=config)
    axes[3].axhline(1.0, color="grey", lw=0.8)
    axes[3].set(title="speedup vs no spec., natural EOS", xlabel="iteration")
    if data.get("points"):
        axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ASSETS / f"{STUDY}.png", dpi=110)
    plt.close(fig)


def main() -> None:
    global STUDY, SAVED
    ap = parser(__doc__)
    ap.add_argument("--iterations", type=int, default=25)
    ap.add_argument("--out", default=str(ROOT / "runs" / "learning"))
    ap.add_argument("--report-only", action="store_true", help="the study from the saved JSON")
    ap.add_argument("--fresh", action="store_true", help="measure everything again")
    what = "which side-by-side rollouts to measure"
    ap.add_argument("--points", default=",".join(POINTS), help=what)
    protocol_args(ap)
    what = "timed natural-EOS rounds per point (at least --repeats)"
    ap.add_argument("--natural-repeats", type=int, default=NATURAL_REPEATS, help=what)
    what = "the study's name: docs/benchmarks/NAME.md and docs/assets/NAME.json, NAME.png"
    ap.add_argument("--study", default=STUDY, help=what)
    args = ap.parse_args()
    args.natural_repeats = max(args.natural_repeats, args.repeats)
    STUDY, SAVED = args.study, ASSETS / f"{args.study}.json"
    if args.report_only:
        data = json.loads(SAVED.read_text())
    else:
        from vllm_plugin.settings import hardware_name

        data = {} if args.fresh or not SAVED.is_file() else json.loads(SAVED.read_text())
        data |= {
            "machine": quiet_machine(args),
            "hardware": hardware_name(),
            "args": vars(args),
            "command": command(),
        }
        ASSETS.mkdir(parents=True, exist_ok=True)
        if "training" not in data:
            train(args, data)
        measure(args, data)
        held_out(args, data)
    plot(data)
    text = report(data)
    write_study(STUDY, "The learning run (SmolLM2-135M, CPU)", text, "learning_run.py")
    print(text)


if __name__ == "__main__":
    main()
