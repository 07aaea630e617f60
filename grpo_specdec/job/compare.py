"""The end-of-job comparison (`compare_at_end`): the next batch of prompts rolled out by
the job's first engine (its speculation, the final weights; and at each `compare.fixed_k`)
and by an engine without speculation serving the same weights, one after the other, each
from an empty prefix cache, side by side in a table.

`compare.shape: tail` rolls the next batch's prompts out as the tail shape
(`tasks/tail_shape.py`): each sample its own request with its own length budget, so that
few requests are left in flight for much of the rollout, as in real GRPO rollouts. There
the other rows make exactly the tokens each request made without speculation (EOS then
ignored): a speculative engine on CPU cannot follow per-request seeds, so left to chance
its longest answers, which set the makespan, would differ.

It lives in the job, not in benchmarks/, because `grpo-specdec train` (and `make demo`)
prints it from an installed package; benchmarks can import it from here.
"""

from __future__ import annotations

from pathlib import Path

import ray

from grpo_specdec.job.batches import Batch
from grpo_specdec.job.config import CompareSettings
from grpo_specdec.job.lifecycle import Roles
from grpo_specdec.tasks.tail_shape import tail_phase_s, with_budgets

NO_SPEC = "no speculation"


def requests_of(batch: Batch, cfg: CompareSettings, seed: int) -> tuple[list[str], dict, dict]:
    """(prompts, sampling, per-request settings) of the comparison's rollout."""
    if cfg.shape == "batch":
        return batch.prompts, batch.sampling, {"seeds": batch.seeds}
    cap, median = cfg.cap_and_median(batch.sampling["max_tokens"])
    shape = with_budgets(batch.prompts, batch.sampling["n"], cap, median, cfg.budget_sigma, seed)
    sampling = {**batch.sampling, "n": 1, "max_tokens": cap}
    return shape.prompts, sampling, {"seeds": shape.seeds, "max_tokens": shape.max_tokens}


def compare_rollout(
    roles: Roles,
    checkpoint: Path,
    batch: Batch,
    speculation: str,
    cfg: CompareSettings,
    seed: int = 0,
) -> dict[str, dict]:
    """Each rollout's summary, by row name. `checkpoint`: of the final weights (its
    policy folder is what the engine without speculation serves)."""
    prompts, sampling, per_request = requests_of(batch, cfg, seed)
    plain_cfg = {**roles.engine_cfg, "model": str(checkpoint / "policy"), "speculative": None}
    plain = roles.placement.actor("rollout", None).remote(plain_cfg, {})
    ray.get(plain.__ray_ready__.remote())  # start-up is not part of the comparison
    job_engine = roles.rollouts[0]
    rows = [(NO_SPEC, plain, None), (f"speculation: {speculation}", job_engine, None)]
    rows += [(f"fixed k = {k}", job_engine, k) for k in cfg.fixed_k]
    runs = {}
    try:
        for name, engine, fixed_k in rows:
            ray.get(engine.forget_caches.remote())
            runs[name] = ray.get(
                engine.rollout.remote(prompts, sampling, fixed_k=fixed_k, **per_request)
            )
            if name == NO_SPEC and cfg.shape == "tail":
                lengths = [len(samples[0]) for samples in runs[name].responses]
                per_request = {**per_request, "max_tokens": lengths}
                sampling = {**sampling, "ignore_eos": True}
    finally:
        ray.get(plain.shutdown.remote())
        ray.kill(plain)
    return {
        name: {**run.summary(), "tail_s": tail_phase_s(run.finished_s)}
        for name, run in runs.items()
    }


def comparison_table(runs: dict[str, dict], requests: str) -> str:
    """`compare_rollout`'s result, side by side. `requests`: what was rolled out."""
    base = runs[NO_SPEC]
    lines = [
        f"| rollout of {requests} | tokens | seconds | tokens/s | vs no speculation "
        "| tail phase s | mean acceptance length | steps per k |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in runs.items():
        ks = ", ".join(
            f"{k}: {n}" for k, n in sorted(v["k_steps"].items(), key=lambda kv: int(kv[0]))
        )
        ks = ks or "-"
        lines.append(
            f"| {name} | {v['tokens']} | {v['wall_s']:.1f} | {v['tokens_per_s']:.1f} | "
            f"{base['wall_s'] / v['wall_s']:.2f}x | {v['tail_s']:.1f} | "
            f"{v['mean_acceptance_length']:.2f} | {ks} |"
        )
    return "\n".join(lines)


def what_is_compared(cfg: CompareSettings, prompts: int, group: int, max_tokens: int) -> str:
    if cfg.shape == "batch":
        return f"the next {prompts} prompts x {group} samples"
    cap, median = cfg.cap_and_median(max_tokens)
    return (
        f"the next {prompts} prompts x {group} samples as the tail shape (each its own request, "
        f"budgets log-normal around {median} tokens, cap {cap})"
    )
