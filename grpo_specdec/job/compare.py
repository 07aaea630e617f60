"""The end-of-job comparison (`compare_at_end`): the next batch of prompts rolled out by
the job's first engine (its speculation, the final weights) and by an engine without
speculation serving the same weights, one after the other, side by side in a table.

It lives in the job, not in benchmarks/, because `grpo-specdec train` (and `make demo`)
prints it from an installed package; benchmarks can import it from here.
"""

from __future__ import annotations

from pathlib import Path

import ray

from grpo_specdec.job.batches import Batch
from grpo_specdec.job.lifecycle import Roles


def compare_rollout(
    roles: Roles, checkpoint: Path, batch: Batch, speculation: str
) -> dict[str, dict]:
    """Each engine's rollout summary, by row name. `checkpoint`: of the final weights (its
    policy folder is what the engine without speculation serves)."""
    plain_cfg = {**roles.engine_cfg, "model": str(checkpoint / "policy"), "speculative": None}
    plain = roles.placement.actor("rollout", None).remote(plain_cfg, {})
    ray.get(plain.__ray_ready__.remote())  # start-up is not part of the comparison
    try:
        runs = {
            "no speculation": ray.get(
                plain.rollout.remote(batch.prompts, batch.sampling, batch.seeds)
            ),
            f"speculation: {speculation}": ray.get(
                roles.rollouts[0].rollout.remote(batch.prompts, batch.sampling, batch.seeds)
            ),
        }
    finally:
        ray.get(plain.shutdown.remote())
        ray.kill(plain)
    return {name: run.summary() for name, run in runs.items()}


def comparison_table(runs: dict[str, dict], prompts: int, group: int) -> str:
    """`compare_rollout`'s result, side by side."""
    base = runs["no speculation"]["tokens_per_s"]
    lines = [
        f"| rollout of the next {prompts} prompts x {group} samples | tokens | seconds | "
        "tokens/s | vs no speculation | mean acceptance length | steps per k |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in runs.items():
        ks = ", ".join(
            f"{k}: {n}" for k, n in sorted(v["k_steps"].items(), key=lambda kv: int(kv[0]))
        )
        ks = ks or "-"
        lines.append(
            f"| {name} | {v['tokens']} | {v['wall_s']:.1f} | {v['tokens_per_s']:.1f} | "
            f"{v['tokens_per_s'] / base:.2f}x | {v['mean_acceptance_length']:.2f} | {ks} |"
        )
    return "\n".join(lines)
