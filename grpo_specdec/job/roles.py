"""The job's roles as Ray actors, and their lifecycle: placed once, started from a
checkpoint or the configured models, killed and started again after a failure; and what
the job asks of them each iteration (roll out, learn, publish the weights, save).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from grpo_specdec.draft.head import aux_layers_of
from grpo_specdec.draft.learner import DraftRound
from grpo_specdec.engine_config import EngineConfig
from grpo_specdec.job.actors import Placement
from grpo_specdec.job.batches import Batch
from grpo_specdec.job.checkpoints import replace_dir
from grpo_specdec.job.config import TrainConfig
from grpo_specdec.job.engine_setup import (
    engine_config,
    engine_seed,
    engine_start_folder,
    latency_profile,
    stored_dtype,
)
from grpo_specdec.job.learners import PolicyBatch, PolicyRound
from grpo_specdec.job.restarts import CallPastDeadline
from grpo_specdec.job.rollout_worker import Rollout
from grpo_specdec.job.sharding import shard
from grpo_specdec.job.weight_sync import WeightSync
from grpo_specdec.modelcheck import read_config


class Roles:
    """N engines (`rollouts`), N policy ranks (`policies`, rank 0 publishes) and, when the
    draft trains online or is new, a draft learner (`draft`)."""

    def __init__(
        self,
        cfg: TrainConfig,
        base_policy: str,
        base_draft: str | None,
        out: Path,
        engine_dtype: str,
        log=print,
    ):
        self.cfg, self.out, self.engine_dtype, self.log = cfg, out, engine_dtype, log
        self.base_policy, self.base_draft = base_policy, base_draft
        self.starts = 0  # how many times the roles started in this process (restarts + 1)
        self.checkpoints = out / "checkpoints"
        self.placement = Placement(cfg.ray, draft=self._has_draft_learner(cfg.model.draft))
        self.rollouts, self.policies, self.draft = [], [], None
        self.engine_cfg: EngineConfig | None = None  # the engines', checked here, before Ray
        self.profile: str | None = None
        self.weights: WeightSync | None = None

    def _has_draft_learner(self, draft_dir: str | None) -> bool:
        """A learner when the draft trains online, or to create a new head for the engine."""
        cfg = self.cfg
        return cfg.rollout.speculation != "off" and (cfg.draft.online or not draft_dir)

    def start(self, ckpt: Path | None) -> int:
        """Start every role from checkpoint `ckpt`, or from the configured models; returns
        the newest draft version issued."""
        cfg, place = self.cfg, self.placement
        policy_dir = engine_start_folder(self.base_policy, self.engine_dtype, self.out)
        draft_dir = self.base_draft
        if ckpt is not None:
            policy_dir, draft_dir = str(ckpt / "policy"), str(ckpt / "draft")
        if self._has_draft_learner(draft_dir):
            self.draft = place.actor("draft", max_restarts=-1).remote(
                self.base_policy,
                draft_dir,
                cfg.draft.train,
                cfg.model.device,
                cfg.seed,
                str(self.checkpoints),
                cfg.draft.new_head,
            )
            if not draft_dir:  # a new head: the engine needs it on disk to start
                draft_dir = self.base_draft = self._save_initial_head()
        # The policy's forward captures the layers the head learns from.
        aux = aux_layers_of(read_config(draft_dir, "draft")) if self.draft is not None else None
        self.policies = [
            place.actor("policy", rank).remote(
                self.base_policy,
                cfg.policy,
                cfg.model.device,
                cfg.model.train_dtype,
                cfg.seed,
                aux or (),
            )
            for rank in range(cfg.ray.policy_workers)
        ]
        if len(self.policies) > 1:
            address = self.wait("a policy rank's start", [self.policies[0].rendezvous.remote()])[0]
            world = len(self.policies)
            self.wait(
                "a policy rank's join",
                [p.join.remote(address, rank, world) for rank, p in enumerate(self.policies)],
            )
        if ckpt is not None:
            self.wait("a checkpoint load", [p.load.remote(ckpt) for p in self.policies])
        # A missing profile is not measured here: it would take most of a short run on a CPU
        # (14.5 min for SmolLM2 on a 2-core EPYC), and the controller learns the prices itself.
        self.profile = self.profile or latency_profile(
            cfg, self.base_policy, draft_dir, self.log, measure=False
        )
        self.engine_cfg = EngineConfig.model_validate(
            engine_config(cfg, policy_dir, draft_dir, self.profile, self.engine_dtype)
        )
        # A resumed run's engines start from a checkpoint's float32 folder, a fresh one's from
        # the base's (bfloat16 for SmolLM2): each checks updates against its own folder.
        self.publish_dtype = stored_dtype(policy_dir)
        # The engines start from the weights the learners hold now: they report their versions.
        learners = {"policy": self.policies[0], "draft": self.draft}
        learners = {role: a for role, a in learners.items() if a is not None}
        status = self.wait("a learner's start", [a.status.remote() for a in learners.values()])
        versions = {role: s["version"] for role, s in zip(learners, status, strict=True)}
        started_at = versions.get("policy", 0)
        self.rollouts = [
            place.actor("rollout", i).remote(
                self.engine_cfg.model_copy(
                    update={"seed": engine_seed(cfg.seed, i, started_at, self.starts)}
                ),
                versions,
            )
            for i in range(cfg.ray.rollout_workers)
        ]
        self.starts += 1
        # Start-up (model loads, engine compile) must not count in the first iteration's times.
        self.wait("a role's start", [a.__ray_ready__.remote() for a in self.actors()])
        self.weights = WeightSync(
            self.rollouts, self._served_at_start(versions), self.log, get=self._await_loads
        )
        return versions.get("draft", 0)

    def plain_engine_config(self, policy_dir: str) -> EngineConfig:
        """The config of an engine as the job's, without speculation, serving `policy_dir`
        (the end-of-run comparison's): its context length is resolved for that model alone."""
        fields = engine_config(self.cfg, policy_dir, None, None, self.engine_dtype)
        return EngineConfig.model_validate({**fields, "speculative": None})

    def _save_initial_head(self) -> str:
        head = self.out / "initial_draft"
        staging = self.out / "initial_draft_state"
        shutil.rmtree(staging, ignore_errors=True)
        self.wait("the initial head's save", [self.draft.save.remote(staging)])
        replace_dir(staging / "draft", head)  # e.g. an earlier run's head
        shutil.rmtree(staging)
        return str(head)

    def _served_at_start(self, versions: dict[str, int]) -> dict:
        """role -> (weights in the object store, version, metadata) the engines start with,
        for a failed swap to put back; with one engine there is nothing to put back."""
        if len(self.rollouts) == 1:
            return {}
        served = {"policy": (self.policy_weights(), versions["policy"], None)}
        if self.draft is not None and self.cfg.draft.online:
            weights, meta, _, _ = self.draft.export.options(num_returns=4).remote()
            served["draft"] = (weights, versions["draft"], self.wait("a draft export", [meta])[0])
        return served

    def policy_weights(self):
        """The whole policy, as rank 0 exports it into the object store: every rank takes
        part in gathering it, and one that dies meanwhile fails the export at once."""
        refs = [rank.export_weights.remote(self.publish_dtype) for rank in self.policies]
        self.wait("a policy export", refs[1:])  # the other ranks return None
        return refs[0]

    def actors(self) -> list:
        return [*self.rollouts, *self.policies, *([self.draft] if self.draft else [])]

    def wait(self, what: str, refs: list) -> list:
        """The results of an iteration's remote calls, within `ray.call_timeout_s`."""
        return get_failing_fast(refs, self.cfg.ray.call_timeout_s, what)

    def _await_loads(self, refs):
        """ray.get as WeightSync calls it (one ref or a list), within the deadline."""
        if isinstance(refs, list):
            return self.wait("a weight load", refs)
        return self.wait("a weight load", [refs])[0]

    def kill(self) -> None:
        for actor in self.actors():
            ray.kill(actor, no_restart=True)
        self.rollouts, self.policies, self.draft = [], [], None

    # ---- each iteration --------------------------------------------------------------
    def roll_out(self, batch: Batch, fixed_k: int | None = None) -> list[Rollout]:
        """Consecutive prompt groups to each engine, side by side; their rollouts in order.
        `fixed_k`: every engine drafts exactly that (0: none), its own policy put back after."""
        prompts, seeds, budgets = batch.prompts, batch.seeds, batch.budgets
        n = len(self.rollouts)
        parts = [shard(len(prompts), i, n) for i in range(n)]
        return self.wait(
            "a rollout",
            [
                engine.rollout.remote(
                    [prompts[i] for i in part],
                    batch.sampling,
                    seeds and [seeds[i] for i in part],
                    budgets and [budgets[i] for i in part],
                    fixed_k,
                )
                for engine, part in zip(self.rollouts, parts, strict=True)
            ],
        )

    def return_draft_to(self, version: int) -> bool:
        """The draft learner back on head `version`, where an engine went back to it; False
        where no learner trains the draft or it no longer holds that head."""
        if self.draft is None:
            return False
        return self.wait("a draft return", [self.draft.return_to.remote(version)])[0]

    def learn(self, batch: PolicyBatch, draft_version: int) -> Learning:
        """Both learners start on one rollout: the policy ranks' forward and update, and
        beside them the draft's training on the hidden states of that forward."""
        batch = ray.put(batch)  # once, for every rank
        shards = [p.prepare.remote(batch) for p in self.policies]
        updates = [p.update.remote() for p in self.policies]
        online = self.draft is not None and self.cfg.draft.online
        draft_job = (
            self.draft.train.remote(*shards, after_version=draft_version) if online else None
        )
        return Learning(self, shards, updates, draft_job, draft_version)

    def publish(self, policy: PolicyRound, draft: DraftRound | None, iteration: int) -> Published:
        """The learners' new weights into every engine."""
        done = Published()
        if policy.steps:
            weights = self.policy_weights()
            done.sync["policy"] = self.weights.policy(
                weights, policy.version, iteration, self.checkpoints
            )
        if draft is not None and draft.steps:
            weights, *facts = self.draft.export.options(num_returns=4).remote()
            meta, version, trained_on = self.wait(
                "a draft export", facts
            )  # weights stay in the store
            loaded, done.draft_swap_error = self.weights.draft(weights, version, meta, iteration)
            if done.draft_swap_error is None:
                done.sync["draft"], done.draft_trained_on_policy = loaded, trained_on
        return done

    def save(self, folder: Path) -> None:
        """The roles' part of a checkpoint: the policy (rank 0 writes it whole, gathered
        from every rank), the draft learner's head and state, or the frozen head the
        engines serve."""
        jobs = [rank.save.remote(folder) for rank in self.policies]
        if self.draft is not None:
            jobs.append(self.draft.save.remote(folder))
        self.wait("a checkpoint save", jobs)  # FSDP ranks gather together: one dead holds all
        if self.draft is None and self.engine_cfg.speculative:
            shutil.copytree(self.engine_cfg.speculative.draft, folder / "draft")

    def shutdown(self) -> None:
        """Stop every actor cleanly; one that died already (the fault a stopped job names)
        is passed over, so the job ends on that reason, not on its death again."""
        for actors in (self.rollouts, self.policies):
            for actor, stopped in zip(actors, [a.shutdown.remote() for a in actors], strict=True):
                try:
                    ray.get(stopped, timeout=self.cfg.ray.call_timeout_s)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    ray.kill(actor, no_restart=True)
        self.placement.remove()


@dataclass
class Published:
    """What one publish loaded: role -> its load's figures; for the draft, the policy
    version it learnt from, or why the engines refused it."""

    sync: dict[str, dict] = field(default_factory=dict)
    draft_trained_on_policy: int | None = None
    draft_swap_error: str | None = None


@dataclass
class Learning:
    """One rollout being learned from: the policy ranks' updates and the draft's training."""

    roles: Roles
    shards: list  # the policy forward's hidden states, a shard per rank
    updates: list
    draft_job: object | None
    draft_version: int  # the newest the job has issued

    def policy(self) -> PolicyRound:
        return self.roles.wait("a policy update", self.updates)[0]  # each rank: the whole batch's

    def draft(self, iteration: int, restart_timeout_s: float = 300.0) -> DraftRound | None:
        """What the draft's training did (None: no draft learns online); a learner that
        died meanwhile is restarted by Ray from its last checkpoint and trains on this
        rollout again."""
        if self.draft_job is None:
            return None
        deadline = time.monotonic() + restart_timeout_s
        job = self.draft_job
        while True:
            try:
                return self.roles.wait("a draft round", [job])[0]
            except ray.exceptions.RayActorError as err:
                if time.monotonic() > deadline:
                    raise
                self.roles.log(
                    f"iteration {iteration}: the draft learner is down ({type(err).__name__}); "
                    "Ray restarts it from its last checkpoint; training it on this rollout again"
                )
                time.sleep(1.0)
                job = self.roles.draft.train.remote(*self.shards, after_version=self.draft_version)


def get_failing_fast(refs: list, deadline_s: float | None = None, what: str = "a call") -> list:
    """ray.get of every ref, raising as soon as one fails: a rank whose peer died would
    otherwise hold the caller in a collective until the group's timeout; and, given
    `deadline_s`, CallPastDeadline once that long has passed with a call unanswered."""
    pending = list(refs)
    end = None if deadline_s is None else time.monotonic() + deadline_s
    while pending:
        timeout = None if end is None else max(end - time.monotonic(), 0.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            raise CallPastDeadline(
                f"{what} did not answer within {deadline_s:g} s (ray.call_timeout_s): its "
                "actor is taken as hung"
            )
        ray.get(ready)
    return ray.get(list(refs))
