"""Where each iteration's record goes: metrics.jsonl (one line per iteration, each
iteration once), TensorBoard and the progress bar; and the record itself, and the
first-vs-last summary printed at the end."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from grpo_specdec.atomic_file import write_atomic
from grpo_specdec.draft.learner import DraftRound
from grpo_specdec.job.learners import PolicyRound
from grpo_specdec.job.roles import Published
from grpo_specdec.job.rollout_worker import Rollout


@dataclass
class RolloutRound:
    """One iteration's rollout, scored; with dynamic sampling (rollout.max_gen_batches > 1)
    every batch it took, in order."""

    examples: list
    rollout: Rollout  # the engines' rollouts gathered
    per_engine: list[Rollout]  # each engine's, its batches chained
    rewards: torch.Tensor  # [prompt, sample]
    correct: torch.Tensor  # [prompt, sample]: 1.0 where the answer is right


@dataclass
class IterationRounds:
    """What one iteration did, phase by phase: its record is made from it."""

    rolled: RolloutRound
    informative: torch.Tensor  # [prompt]: the groups the policy learnt from
    policy: PolicyRound
    draft: DraftRound | None  # None where no draft learns online
    published: Published
    seconds: dict[str, float]  # by phase: generation, policy_update, draft_wait, sync
    versions: dict[str, int]  # by role: the weights the engines serve after it


def iteration_record(iteration: int, rounds: IterationRounds) -> dict:
    """One iteration's metrics."""
    rolled, seconds, versions = rounds.rolled, rounds.seconds, rounds.versions
    rollout, rewards = rolled.rollout, rolled.rewards
    draft, published = rounds.draft, rounds.published
    n_tokens = sum(len(x) for g in rollout.responses for x in g)
    record = {
        "iteration": iteration,
        "reward_mean": float(rewards.mean()),
        "rewards": [round(float(x), 4) for x in rewards.flatten()],
        "accuracy": float(rolled.correct.mean()),
        "informative_groups": int(rounds.informative.sum()),
        "response_length": n_tokens / rewards.numel(),
        "generation_s": seconds["generation"],
        "policy_update_s": seconds["policy_update"],
        "draft_train_s": draft.seconds if draft is not None else 0.0,
        "draft_wait_s": seconds["draft_wait"],
        "sync_s": seconds["sync"],
        "iteration_s": sum(seconds.values()),
        "tokens_per_s": n_tokens / rollout.wall_s,
        "acceptance_rate": rollout.spec["acceptance_rate"],
        "mean_acceptance_length": rollout.spec["mean_acceptance_length"],
        "per_position_acceptance": rollout.spec["per_position_acceptance"],
        "k_steps": {str(k): v for k, v in sorted(rollout.k_steps.items())},
        **(rollout.sources or {}),
        "engine_policy_version": versions["policy"],
        "engine_draft_version": versions["draft"],
        "draft_rollbacks": [r.describe() for r in rollout.draft_rollbacks],
        **rounds.policy.record(),
        **(draft.record() if draft is not None else {}),
    }
    if len(rolled.per_engine) > 1:
        record["engines"] = [part.summary() for part in rolled.per_engine]
    if published.draft_trained_on_policy is not None:
        record["draft_trained_on_policy"] = published.draft_trained_on_policy
        record["draft_policy_lag"] = versions["policy"] - published.draft_trained_on_policy
    if published.draft_swap_error is not None:
        record["draft_swap_error"] = published.draft_swap_error
    record["policy_sync_s"] = published.sync.get("policy", {}).get("total_s", 0.0)
    record["draft_sync_s"] = published.sync.get("draft", {}).get("total_s", 0.0)
    return record


def truncate_records(path: Path, iteration: int) -> None:
    """Keep the records of iterations up to `iteration` (a resume or restart point), so that
    none is counted twice; those after it are appended to `<name>.after_iteration_<iteration>.jsonl`
    beside, not lost. A last line cut off mid-append (the job was killed writing it) is
    dropped; any other line that is not JSON is an error naming it. Rewritten atomically."""
    if not path.is_file():
        return
    lines = path.read_text().split("\n")
    keep, later = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # no newline after it: torn, never a whole record
                continue
            raise ValueError(f"{path} line {lineno}: not a JSON record") from None
        (keep if record["iteration"] <= iteration else later).append(line)
    if later:
        aside = path.with_name(f"{path.stem}.after_iteration_{iteration}.jsonl")
        with open(aside, "a") as f:
            f.write("".join(line + "\n" for line in later))
    write_atomic(path, "".join(line + "\n" for line in keep))


class MetricsSink:
    """One `Job.run`'s outputs: records appended to metrics.jsonl and TensorBoard as they
    come, and a progress bar from `first` to `last` iteration."""

    def __init__(self, out: Path, first: int, last: int):
        self.path = out / "metrics.jsonl"
        self.tensorboard = self._tensorboard(first)
        self.bar = tqdm(initial=first, total=last, desc="GRPO", unit="iter")

    def _tensorboard(self, iteration: int):
        """A writer continuing from `iteration`: TensorBoard hides what earlier writers
        logged past it (a resume or restart runs those iterations again)."""
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=iteration + 1)

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *_) -> None:
        self.bar.close()
        self.tensorboard.close()

    def write(self, record: dict) -> None:
        step = record["iteration"]
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        tb = self.tensorboard
        for key, value in record.items():
            if isinstance(value, int | float):
                tb.add_scalar(key, value, step)
        for i, p in enumerate(record["per_position_acceptance"]):
            tb.add_scalar(f"per_position_acceptance/{i}", p, step)
        for i, engine in enumerate(record.get("engines", [])):
            for key in ("tokens_per_s", "mean_acceptance_length", "wall_s"):
                tb.add_scalar(f"engine{i}/{key}", engine[key], step)
        ks = [int(k) for k, n in record["k_steps"].items() for _ in range(n)]
        if ks:
            tb.add_histogram("k_chosen", torch.tensor(ks), step)
        self.bar.update(1)
        self.bar.set_postfix(
            reward=f"{record['reward_mean']:.2f}",
            mal=f"{record['mean_acceptance_length']:.2f}",
            tok_s=f"{record['tokens_per_s']:.0f}",
        )

    def write_eval(self, report: dict) -> None:
        """A held-out evaluation (`Job.evaluate`): a line of eval.jsonl, and TensorBoard."""
        with (self.path.parent / "eval.jsonl").open("a") as f:
            f.write(json.dumps(report) + "\n")
        for key in ("accuracy", "mean_at_g", "answer_format"):
            if key in report:
                self.tensorboard.add_scalar(f"eval/{key}", report[key], report["iteration"])
        self.bar.clear()  # the progress bar redraws below the message the job prints next

    def rewind(self, iteration: int) -> None:
        """The job went back to `iteration` (a restart): the bar and TensorBoard show it."""
        self.tensorboard.close()
        self.tensorboard = self._tensorboard(iteration)
        self.bar.n = iteration
        self.bar.refresh()


def summary_table(records: list[dict]) -> str:
    """Reward, acceptance length and generation tokens/s: first vs last iterations."""
    if not records:
        return "no iterations ran"
    n = max(1, min(3, len(records) // 2))
    first, last = records[:n], records[-n:]

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs)

    rows = [
        ("reward mean", "reward_mean", ".3f"),
        ("accuracy", "accuracy", ".3f"),
        ("mean acceptance length", "mean_acceptance_length", ".2f"),
        ("generation tokens/s", "tokens_per_s", ".1f"),
        ("iteration seconds", "iteration_s", ".1f"),
    ]
    lines = [f"| metric | first {n} iterations | last {n} iterations |", "|---|---|---|"]
    lines += [
        f"| {name} | {mean(first, k):{fmt}} | {mean(last, k):{fmt}} |" for name, k, fmt in rows
    ]
    lines += [
        "",
        "| iteration | reward mean | accuracy | token entropy | mean acceptance length "
        "| held-out accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        entropy = f"{r['policy_entropy']:.3f}" if "policy_entropy" in r else "-"
        held_out = f"{r['eval_accuracy']:.3f}" if "eval_accuracy" in r else ""
        lines.append(
            f"| {r['iteration']} | {r['reward_mean']:.3f} | {r['accuracy']:.3f} | {entropy} "
            f"| {r['mean_acceptance_length']:.2f} | {held_out} |"
        )
    return "\n".join(lines)


def held_out_line(evals: list[dict]) -> str:
    """Held-out greedy accuracy before and after, from the run's evaluations."""
    if not evals:
        return "no held-out evaluation ran (eval.every=0)"
    first, last = evals[0], evals[-1]
    text = (
        f"held-out greedy accuracy ({first['examples']} problems): iteration "
        f"{first['iteration']} {first['accuracy']:.3f} [{first['interval'][0]:.3f}, "
        f"{first['interval'][1]:.3f}]"
    )
    if last is not first:
        text += (
            f" -> iteration {last['iteration']} {last['accuracy']:.3f} "
            f"[{last['interval'][0]:.3f}, {last['interval'][1]:.3f}]"
        )
    return text
