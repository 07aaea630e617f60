"""Each iteration's prompts: drawn in order from the data source at the job's cursor, with
the sampling settings of the rollout and, when seeded, each prompt's seed."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_specdec.job.config import DataSettings, RolloutSettings
from grpo_specdec.tasks.datasets import ArithmeticSource, JsonlSource


def prompt_source(cfg: DataSettings):
    return (
        JsonlSource(cfg.path) if cfg.source == "jsonl" else ArithmeticSource(cfg.seed, cfg.levels)
    )


@dataclass
class Batch:
    examples: list  # each with .question and .answer
    sampling: dict  # SamplingSettings fields
    seeds: list[int] | None  # one per prompt, with rollout.seeded

    @property
    def prompts(self) -> list[str]:
        return [e.question for e in self.examples]


def batch_at(source, cursor: int, rollout: RolloutSettings, job_seed: int) -> Batch:
    """The batch of examples cursor, cursor + 1, ...; the cursor moves on only once an
    iteration has used it."""
    examples = [source.get(cursor + i) for i in range(rollout.prompts_per_iteration)]
    sampling = {
        "n": rollout.group_size,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "max_tokens": rollout.max_tokens,
    }
    seeds = None
    if rollout.seeded:  # vLLM seeds a prompt's samples seed, seed + 1, ...: keep them apart
        seeds = [(job_seed << 32) + (cursor + i) * rollout.group_size for i in range(len(examples))]
    return Batch(examples, sampling, seeds)
