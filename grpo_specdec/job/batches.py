"""Each iteration's prompts: drawn in order from the data source at the job's cursor, with
the sampling settings of the rollout and, when seeded, each prompt's seed; with
rollout.length_budget, each sample's own max_tokens."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_specdec.job.config import DataSettings, RolloutSettings
from grpo_specdec.tasks.datasets import ArithmeticSource, FileSource, PromptTemplate, file_kind
from grpo_specdec.tasks.length_budgets import with_budgets
from grpo_specdec.tasks.rewards import RewardKind


def prompt_source(cfg: DataSettings, reward_kind: RewardKind, path: str | None = None):
    """The job's problems: the arithmetic task, or the file at `path` (default data.path) in
    data.source's format and fields (held-out problems beside the arithmetic task: in the
    format their name says, with its default fields); all with the config's prompt template."""
    template = PromptTemplate(cfg.system_prompt, cfg.instruction)
    if cfg.source == "arithmetic" and path is None:
        return ArithmeticSource(cfg.seed, cfg.levels, template)
    if cfg.source == "arithmetic":
        return FileSource(path, file_kind(path), reward_kind=reward_kind, template=template)
    return FileSource(
        path or cfg.path,
        cfg.source,
        cfg.question_field,
        cfg.answer_field,
        reward_kind,
        template,
    )


@dataclass
class Batch:
    examples: list  # each with .question and .answer
    sampling: dict  # SamplingSettings fields
    seeds: list[int] | None  # one per prompt, with rollout.seeded
    budgets: list[list[int]] | None = None  # [prompt][sample] max_tokens, with length_budget

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
    budgets = None
    if rollout.length_budget:
        flat = with_budgets(
            [e.question for e in examples],
            rollout.group_size,
            rollout.max_tokens,
            rollout.length_budget.median,
            rollout.length_budget.sigma,
            seed=(job_seed << 32) + cursor,
        ).max_tokens
        g = rollout.group_size
        budgets = [flat[i * g : (i + 1) * g] for i in range(len(examples))]
    return Batch(examples, sampling, seeds, budgets)
