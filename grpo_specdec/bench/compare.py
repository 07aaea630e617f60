"""The end-of-job comparison (`compare_at_end`): the next batch of prompts rolled out by
the job's first engine (its speculation, the final weights; and at each `compare.fixed_k`)
and by an engine without speculation serving the same weights, side by side in a table,
under the measurement protocol (`grpo_specdec/bench/measure.py`): every configuration warmed on
the workload, then `compare.repeats` rounds in a seeded shuffled order, each from an empty
prefix cache; each ratio is the median over rounds with a 95% interval.

`compare.shape: tail` rolls the next batch's prompts out as the tail shape
(`tasks/length_budgets.py`): each sample its own request with its own length budget, so that
few requests are left in flight for much of the rollout, as in real GRPO rollouts. There
every timed run makes exactly the tokens each request made in the warm-up run without
speculation (EOS then ignored): a speculative engine samples with other random draws than
the plain one, so even under the same seeds its longest answers, which set the makespan,
would differ. That text runs
on past EOS, where a draft is accepted less (measured on a trained policy: 0.2-0.5 at the
first position against 0.7-0.8 on real text), and a speculative configuration that drafts
only in the tail drafts mostly there; `compare.natural_repeats` adds rows (named
"natural EOS: ...") in which each configuration makes its own answers under the same
budgets, more rounds as their lengths vary by chance.

It lives in the package, not in benchmarks/, because `grpo-specdec train` (and `make demo`)
prints it from an installed package; benchmarks can import it from here. It builds on the
job (its roles, batches and settings); the job runs it as the `RolloutComparison` the CLI
hands it (`Job.compare_rollout`), importing nothing of it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import ray

from grpo_specdec.bench.measure import run_protocol, speedup
from grpo_specdec.bench.tail_shape import tail_phase_s
from grpo_specdec.job.batches import Batch
from grpo_specdec.job.config import CompareSettings
from grpo_specdec.job.roles import Roles
from grpo_specdec.tasks.length_budgets import with_budgets

NO_SPEC = "no speculation"
NATURAL = "natural EOS: "  # the rows of the natural-EOS rounds


def requests_of(batch: Batch, cfg: CompareSettings, seed: int) -> tuple[list[str], dict, dict]:
    """(prompts, sampling, per-request settings) of the comparison's rollout."""
    if cfg.shape == "batch":
        return batch.prompts, batch.sampling, {"seeds": batch.seeds}
    cap, median = cfg.cap_and_median(batch.sampling["max_tokens"])
    shape = with_budgets(batch.prompts, batch.sampling["n"], cap, median, cfg.budget_sigma, seed)
    sampling = {**batch.sampling, "n": 1, "max_tokens": cap}
    return shape.prompts, sampling, {"seeds": shape.seeds, "max_tokens": shape.max_tokens}


def started(actor, timeout_s: float, ray_cfg, wait=ray.wait, kill=ray.kill) -> None:
    """Wait for the comparison's engine to start, at most `timeout_s`."""
    ready = actor.__ray_ready__.remote()
    done, _ = wait([ready], timeout=timeout_s)
    if not done:
        kill(actor)
        raise RuntimeError(
            f"the comparison's engine without speculation did not start within {timeout_s:.0f} s "
            f"(compare.start_timeout_s): it needs ray.rollout_cpus={ray_cfg.rollout_cpus}, "
            f"ray.rollout_gpus={ray_cfg.rollout_gpus} beside the job's own engines, which the "
            "cluster may not have free; the run's checkpoints are complete"
        )
    ray.get(ready)  # a start that failed raises its error here


def compare_rollout(
    roles: Roles,
    checkpoint: Path,
    batch: Batch,
    speculation: str,
    cfg: CompareSettings,
    seed: int = 0,
    log=print,
) -> dict[str, dict]:
    """Each configuration's summary, by row name: medians over the repeats, the speedup
    over no speculation with its interval, every repeat's figures and the CPU share other
    processes took during each. `checkpoint`: of the final weights (its policy folder is
    what the engine without speculation serves)."""
    prompts, sampling, per_request = requests_of(batch, cfg, seed)
    plain_cfg = roles.plain_engine_config(str(checkpoint / "policy"))
    plain = roles.placement.actor("rollout", None).remote(plain_cfg, {})
    # Start-up is not part of the comparison; it must end, though: outside the job's
    # placement groups, Ray waits for room for this engine for as long as it takes.
    started(plain, cfg.start_timeout_s, roles.placement.cfg)
    job_engine = roles.rollouts[0]
    # Every round of the job's own speculation starts from its controller as training left
    # it (what it learnt of this engine's costs and the head's acceptance), not from what
    # its earlier rounds, or the fixed-k rounds between them, taught it.
    saved = ray.get(job_engine.save_controller.remote())
    rows = {NO_SPEC: (plain, {}), f"speculation: {speculation}": (job_engine, {})}
    if saved:
        rows[f"speculation: {speculation}"] = (job_engine, {"saved_controller": True})
    rows |= {f"fixed k = {k}": (job_engine, {"fixed_k": k}) for k in cfg.fixed_k}
    workload = {"sampling": sampling, "per_request": per_request}

    def roll_out(name: str):
        engine, how = rows[name]
        ray.get(engine.forget_caches.remote())
        return ray.get(
            engine.rollout.remote(prompts, workload["sampling"], **how, **workload["per_request"])
        )

    def warm(name: str) -> None:
        if name != NO_SPEC:  # warmed first, below
            roll_out(name)

    try:
        # No speculation's warm-up; on the tail shape it fixes every later run's lengths.
        reference = roll_out(NO_SPEC)
        if cfg.shape == "tail":
            lengths = [len(samples[0]) for samples in reference.responses]
            workload["per_request"] = {**per_request, "max_tokens": lengths}
            workload["sampling"] = {**sampling, "ignore_eos": True}
        timed = run_protocol(
            {name: (lambda name=name: roll_out(name)) for name in rows},
            warm,
            cfg.repeats,
            seed,
            lambda msg: log(f"comparison: {msg}"),
        )
        out = summaries(timed, seed)
        if cfg.natural_repeats:
            workload["per_request"] = {"max_tokens": per_request["max_tokens"]}
            workload["sampling"] = sampling
            natural = run_protocol(
                {name: (lambda name=name: roll_out(name)) for name in rows},
                lambda _: None,  # every engine is warm on these prompts
                cfg.natural_repeats,
                seed + 1,
                lambda msg: log(f"comparison, natural EOS: {msg}"),
            )
            out |= {f"{NATURAL}{name}": v for name, v in summaries(natural, seed).items()}
    finally:
        ray.get(plain.shutdown.remote())
        ray.kill(plain)
    return out


def summaries(timed, seed: int) -> dict[str, dict]:
    """Per row: medians over the repeats, the speedup over no speculation paired by repeat
    with its interval, every repeat's figures, the others' CPU share during each."""
    base_s = [run.wall_s for run in timed.runs[NO_SPEC]]
    out = {}
    for name, runs in timed.runs.items():
        per_run = [{**run.summary(), "tail_s": tail_phase_s(run.finished_s)} for run in runs]
        out[name] = {
            **{
                key: statistics.median(s[key] for s in per_run)
                for key in ("tokens", "wall_s", "tokens_per_s", "tail_s", "mean_acceptance_length")
            },
            "k_steps": per_run[-1]["k_steps"],
            "k_by_batch": per_run[-1].get("k_by_batch", {}),
            "speedup": speedup(base_s, [run.wall_s for run in runs], seed=seed).to_dict(),
            "repeats": per_run,
            "others_cpu_share": timed.busy[name],
        }
    out[NO_SPEC]["orders"] = timed.orders
    return out


def comparison_table(runs: dict[str, dict], requests: str) -> str:
    """`compare_rollout`'s result, side by side. `requests`: what was rolled out."""
    lines = [
        f"| rollout of {requests} | tokens | seconds | tokens/s | vs no speculation "
        "| tail phase s | mean acceptance length | steps per k | 95% interval | verdict "
        "| others' CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in runs.items():
        ks = ", ".join(
            f"{k}: {n}" for k, n in sorted(v["k_steps"].items(), key=lambda kv: int(kv[0]))
        )
        ratio = v["speedup"]
        busy = [s for s in v["others_cpu_share"] if s is not None]
        lines.append(
            f"| {name} | {v['tokens']:.0f} | {v['wall_s']:.1f} | {v['tokens_per_s']:.1f} | "
            f"{ratio['median']:.2f}x | {v['tail_s']:.1f} | {v['mean_acceptance_length']:.2f} | "
            f"{ks or '-'} | [{ratio['low']:.2f}, {ratio['high']:.2f}] | "
            f"{'-' if name in (NO_SPEC, NATURAL + NO_SPEC) else ratio['verdict']} | "
            f"{f'{max(busy):.0%}' if busy else 'not measured'} |"
        )
    lines.append("\nSteps per k by running requests (B), in each row's last round:")
    for name, v in runs.items():
        if v.get("k_by_batch") and name not in (NO_SPEC, NATURAL + NO_SPEC):
            lines.append(f"- {name}: {k_by_batch_text(v['k_by_batch'])}")
    repeats = len(runs[NO_SPEC]["repeats"])
    lines.append(
        f"\nMedians of {repeats} repeats, each configuration warmed on this workload first and "
        "the order shuffled each repeat; the speedup's 95% interval is a bootstrap over the "
        "paired repeats, and a gain or loss is called only when it excludes 1.0. Others' "
        "CPU: the most that other processes took of the machine during one of the row's runs."
    )
    if NATURAL + NO_SPEC in runs:
        lines.append(
            f"'{NATURAL.removesuffix(': ')}' rows: {len(runs[NATURAL + NO_SPEC]['repeats'])} more repeats "
            "in which each configuration makes its own answers under the same budgets (no text "
            "past EOS; lengths, and so tokens, differ by chance), against no speculation's "
            "natural-EOS run of the same repeat."
        )
    return "\n".join(lines)


def k_by_batch_text(k_by_batch: dict[str, dict[str, int]]) -> str:
    """ "B 32-63: k=0 x3, k=2 x11; B 1: ..." from largest B to smallest."""
    ranges = sorted(k_by_batch.items(), key=lambda kv: -int(kv[0].split("-")[0]))
    return "; ".join(
        f"B {b}: " + ", ".join(f"k={k} x{n}" for k, n in ks.items()) for b, ks in ranges
    )


def what_is_compared(cfg: CompareSettings, prompts: int, group: int, max_tokens: int) -> str:
    if cfg.shape == "batch":
        return f"the next {prompts} prompts x {group} samples"
    cap, median = cfg.cap_and_median(max_tokens)
    return (
        f"the next {prompts} prompts x {group} samples as the tail shape (each its own request, "
        f"budgets log-normal around {median} tokens, cap {cap})"
    )
