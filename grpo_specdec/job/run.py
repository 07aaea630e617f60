"""`grpo-specdec train`: GRPO with speculative rollouts and an online-learned draft, on Ray.

Per iteration: rollout (vLLM engines, concurrency-aware speculation, prompt groups split
across them) -> rule rewards and group advantages -> the policy ranks' forward (log-probs +
hidden states, a shard each) -> data-parallel policy update and draft training side by
side -> new policy and draft weights hot-swapped into every running engine -> metrics; a
checkpoint every N iterations and at the end.

The pieces: `roles.Roles` (the actors), `weight_sync` (all-or-none swaps),
`draft_guard.DraftGuard` (draft rollbacks and declines), `checkpoints.Checkpointer`,
`metrics.MetricsSink`, `batches` (the data cursor) and `logs` (vLLM's messages to the run's
vllm.log); the end-of-run comparison (compare_at_end) is the benchmark library's, handed in
as a `RolloutComparison`.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import ray
import torch

from grpo_specdec.draft.formats import ready_head
from grpo_specdec.evaluate import arithmetic_eval_set, evaluate, report_line
from grpo_specdec.grpo.core import first_informative, group_advantages
from grpo_specdec.job.actors import start_ray
from grpo_specdec.job.batches import Batch, batch_at, prompt_source
from grpo_specdec.job.checkpoints import Checkpointer, read_state
from grpo_specdec.job.config import CompareSettings, RewardSettings, TrainConfig
from grpo_specdec.job.draft_guard import DraftGuard
from grpo_specdec.job.engine_setup import check_context_length, serving_dtype
from grpo_specdec.job.learners import PolicyBatch
from grpo_specdec.job.logs import VllmLog, check_private
from grpo_specdec.job.metrics import (
    IterationRounds,
    MetricsSink,
    RolloutRound,
    iteration_record,
    truncate_records,
)
from grpo_specdec.job.models import resolve_model
from grpo_specdec.job.restarts import CallPastDeadline, RestartBudget
from grpo_specdec.job.roles import Roles
from grpo_specdec.job.rollout_worker import Rollout
from grpo_specdec.job.run_lock import RunFolderLock
from grpo_specdec.modelcheck import check_draft_matches_target
from grpo_specdec.tasks.rewards import GRADERS, has_answer_format, overlong_penalty


class RolloutComparison(Protocol):
    """The end-of-run comparison (`compare_at_end`): the next batch rolled out by the job's
    engines and by one without speculation, from `checkpoint`'s weights; -> each row's
    summary, by name. The benchmark library implements it (grpo_specdec/bench/compare.py)
    and the CLI hands it to `Job.compare_rollout`: the benchmarks build on the job, so the
    job imports nothing of theirs."""

    def __call__(
        self,
        roles: Roles,
        checkpoint: Path,
        batch: Batch,
        speculation: str,
        cfg: CompareSettings,
        seed: int,
        log: Callable[[str], None],
    ) -> dict[str, dict]: ...


class Job:
    def __init__(self, cfg: TrainConfig, resume: str | None = None, log=print):
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.out)
        base_policy = resolve_model(cfg.model.policy)
        base_draft = cfg.model.draft and resolve_model(cfg.model.draft)
        if base_draft and cfg.rollout.speculation != "off":
            try:  # the learner and the engines would each fail on it inside their actors
                base_draft = ready_head(base_draft, base_policy, "draft", log)
                check_draft_matches_target(base_draft, base_policy)
            except ValueError as err:
                raise ValueError(f"model.draft: {err}") from None
        check_context_length(cfg, base_policy, base_draft)
        # Everything that reads input is checked before a resume moves any checkpoint.
        data, kind = cfg.data, cfg.reward.kind
        self.source = prompt_source(data, kind)
        self.eval_examples = (
            prompt_source(data, kind, data.eval_path).examples[: cfg.eval.examples]
            if data.eval_path
            else arithmetic_eval_set(
                data.seed, data.levels, cfg.eval.examples, self.source.template
            )
        )
        self.out.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_private(self.out)
        self.lock = RunFolderLock(self.out)  # held until shutdown, or the process's end
        try:
            self._open(resume, base_policy, base_draft)
        except BaseException:
            if getattr(self, "roles", None) is not None:  # a start that failed or hung
                self.roles.kill()
                self.roles.placement.remove()
            if getattr(self, "vllm_log", None) is not None:  # vLLM's logging as it was
                self.vllm_log.close()
            self.lock.release()
            raise

    def _open(self, resume: str | None, base_policy: str, base_draft: str | None) -> None:
        cfg, log = self.cfg, self.log
        self.checkpointer = Checkpointer(self.out / "checkpoints", log, cfg.data.path)
        self.restart_budget = RestartBudget(cfg.restarts.per_checkpoint, cfg.restarts.total)
        ckpt = self.checkpointer.start_point(resume, cfg.model_dump())
        self.vllm_log = VllmLog(self.out, os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
        self.log(f"vLLM's messages go to {self.vllm_log.path} (errors also here)")
        start_ray(cfg.ray, self.vllm_log.worker_env)
        self.roles = Roles(
            cfg, base_policy, base_draft, self.out, serving_dtype(cfg, base_policy), log
        )
        self._start(ckpt)

    # The actors by role, as tests and benchmarks reach them.
    rollouts = property(lambda self: self.roles.rollouts)
    policies = property(lambda self: self.roles.policies)
    draft = property(lambda self: self.roles.draft)
    _engine_cfg = property(lambda self: self.roles.engine_cfg)

    def _start(self, ckpt: Path | None) -> None:
        """Every role from checkpoint `ckpt` (and the job's place in the data and its RNG),
        or from the configured models."""
        if ckpt is not None:
            self.iteration, self.cursor = self.checkpointer.restore(ckpt)
            self.log(f"starting from checkpoint {ckpt} at iteration {self.iteration}")
        else:
            self.iteration, self.cursor = 0, 0
            random.seed(self.cfg.seed)
        self.draft_version = self.roles.start(ckpt)  # the newest draft version issued
        self.draft_guard = DraftGuard(self.roles, self.log)
        truncate_records(self.out / "metrics.jsonl", self.iteration)
        truncate_records(self.out / "eval.jsonl", self.iteration)

    def _restart(self, reason: str) -> None:
        """An actor died: rebuild every role from the newest checkpoint (or the start) and
        redo the iterations since; their metrics records are dropped first."""
        ckpt = self.checkpointer.latest()
        self.log(f"{reason}; restarting all roles from {ckpt or 'the initial models'}")
        self.roles.kill()
        self._start(ckpt)

    def step(self) -> dict:
        """One GRPO iteration: roll out, reward, advantages, learn, sync the engines."""
        seconds, lap = {}, _stopwatch()
        rolled = self._roll_out()
        seconds["generation"] = lap()
        watched = self.draft_guard.rolled_out(rolled.rollout, self.iteration + 1)

        advantages, informative = group_advantages(rolled.rewards)
        informative = first_informative(informative, self.cfg.rollout.prompts_per_iteration)
        learning = self.roles.learn(
            PolicyBatch.of(rolled.rollout, advantages, informative, self.cfg.rollout.temperature),
            self.draft_version,
        )
        policy = learning.policy()
        seconds["policy_update"] = lap()
        draft = learning.draft(self.iteration + 1)
        if draft is not None:
            self.draft_version = draft.version
        seconds["draft_wait"] = lap()

        published = self.roles.publish(policy, draft, self.iteration + 1)
        self.draft_guard.published(published)
        seconds["sync"] = lap()

        rounds = IterationRounds(
            rolled, informative, policy, draft, published, seconds, self.roles.weights.versions()
        )
        batches = len(rolled.examples) // self.cfg.rollout.prompts_per_iteration
        self.cursor += len(rolled.examples)
        self.iteration += 1
        return iteration_record(self.iteration, rounds) | {"gen_batches": batches} | watched

    def _roll_out(self) -> RolloutRound:
        """This iteration's batch rolled out and scored, and with rollout.max_gen_batches > 1
        (DAPO's dynamic sampling) the next ones too until prompts_per_iteration groups have
        reward variance."""
        cfg = self.cfg.rollout
        examples, rounds, gathered, rewards, correct = [], [], [], [], []
        while len(rounds) < cfg.max_gen_batches:
            batch = batch_at(self.source, self.cursor + len(examples), cfg, self.cfg.seed)
            rounds.append(self.roles.roll_out(batch))
            gathered.append(Rollout.gather(rounds[-1]))
            scores = _rewards(batch.examples, gathered[-1], self.cfg.reward, cfg.max_tokens)
            examples += batch.examples
            rewards.append(scores[0])
            correct.append(scores[1])
            if group_advantages(torch.cat(rewards))[1].sum() >= cfg.prompts_per_iteration:
                break
        per_engine = [Rollout.chain(list(parts)) for parts in zip(*rounds, strict=True)]
        return RolloutRound(
            examples, Rollout.chain(gathered), per_engine, torch.cat(rewards), torch.cat(correct)
        )

    def evaluate(self) -> dict:
        """Held-out accuracy of the policy the engines serve now (`grpo_specdec/evaluate.py`),
        greedy, spread over the engines; drafting is off for it, so that the controllers'
        acceptance estimates stay those of the rollouts' temperature."""
        e = self.cfg.eval
        fixed_k = 0 if self.cfg.rollout.speculation == "concurrency_aware" else None

        def generate(prompts: list[str], sampling: dict) -> list[list[str]]:
            batch = Batch(self.eval_examples, {**sampling, "top_p": 1.0}, None)
            return Rollout.gather(self.roles.roll_out(batch, fixed_k)).texts

        max_tokens = e.max_tokens or self.cfg.rollout.max_tokens
        report = evaluate(
            generate, self.eval_examples, max_tokens, e.samples, kind=self.cfg.reward.kind
        )
        return {"iteration": self.iteration, **report}

    def _evaluate_now(self) -> bool:
        every = self.cfg.eval.every
        return every > 0 and (self.iteration % every == 0 or self.iteration == self.cfg.iterations)

    def checkpoint(self) -> Path:
        return self.checkpointer.write(
            self.iteration, self.cursor, self.cfg.model_dump(), self.roles.save
        )

    def run(self) -> list[dict]:
        records = []
        with MetricsSink(self.out, self.iteration, self.cfg.iterations) as metrics:
            if self.iteration == 0 and self._evaluate_now():  # before training
                truncate_records(self.out / "eval.jsonl", -1)  # an earlier start's
                self._log_eval(metrics, self.evaluate())
            while self.iteration < self.cfg.iterations:
                # An actor that dies, or hangs past ray.call_timeout_s, in the step, the
                # evaluation or the checkpoint: every role restarts from the newest checkpoint
                # and the iterations since run again.
                running = self.iteration + 1
                try:
                    record = self.step()
                    if self._evaluate_now():
                        report = self.evaluate()
                        self._log_eval(metrics, report)
                        record |= {f"eval_{k}": v for k, v in report.items() if k != "iteration"}
                    records.append(record)
                    metrics.write(record)
                    if (
                        self.iteration % self.cfg.checkpoint_every == 0
                        or self.iteration == self.cfg.iterations
                    ):
                        self.checkpoint()
                except (ray.exceptions.RayActorError, CallPastDeadline) as err:
                    why = (
                        str(err)
                        if isinstance(err, CallPastDeadline)
                        else f"an actor died ({type(err).__name__})"
                    )
                    fault = f"iteration {running}: {why}"
                    self.restart_budget.spend(self.checkpointer.latest(), fault)
                    self._restart(fault)
                    # The iterations since the checkpoint run again: keep each record once.
                    records = [r for r in records if r["iteration"] <= self.iteration]
                    metrics.rewind(self.iteration)
        return records

    def _log_eval(self, metrics: MetricsSink, report: dict) -> None:
        metrics.write_eval(report)
        self.log(report_line(report, f"iteration {report['iteration']}: held-out"))

    def compare_rollout(self, compare: RolloutComparison) -> dict[str, dict]:
        """The next batch rolled out with and without speculation by `compare`, from a
        checkpoint of the final weights."""
        ckpt = self.checkpointer.latest()
        if ckpt is None or read_state(ckpt)["iteration"] != self.iteration:
            ckpt = self.checkpoint()
        batch = batch_at(self.source, self.cursor, self.cfg.rollout, self.cfg.seed)
        return compare(
            self.roles,
            ckpt,
            batch,
            self.cfg.rollout.speculation,
            self.cfg.compare,
            self.cfg.seed,
            self.log,
        )

    def shutdown(self) -> None:
        try:
            self.roles.shutdown()
            ray.shutdown()
            self.vllm_log.close()
        finally:
            self.lock.release()


def _rewards(
    examples: list, rollout: Rollout, cfg: RewardSettings, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[prompt, sample] rewards (`reward.kind`'s grade, the format bonus and the overlong
    penalty), and whether each answer is right."""
    is_correct = GRADERS[cfg.kind]
    pairs = list(zip(examples, rollout.texts, rollout.responses, strict=True))
    correct = torch.tensor([[float(is_correct(t, e.answer)) for t in ts] for e, ts, _ in pairs])
    rewards = correct + torch.tensor(
        [[cfg.format_bonus * has_answer_format(t) for t in ts] for _, ts, _ in pairs]
    )
    if cfg.overlong:
        o = cfg.overlong
        rewards += torch.tensor(
            [
                [overlong_penalty(len(r), max_tokens, o.buffer, o.penalty) for r in rs]
                for *_, rs in pairs
            ]
        )
    return rewards, correct


def _stopwatch():
    """A function returning the seconds since it was last called (or made)."""
    last = [time.perf_counter()]

    def lap() -> float:
        now = time.perf_counter()
        seconds, last[0] = now - last[0], now
        return seconds

    return lap
