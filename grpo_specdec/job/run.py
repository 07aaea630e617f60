"""`grpo-specdec train`: GRPO with speculative rollouts and an online-learned draft, on Ray.

Per iteration: rollout (vLLM engines, concurrency-aware speculation, prompt groups split
across them) -> rule rewards and group advantages -> the policy ranks' forward (log-probs +
hidden states, a shard each) -> data-parallel policy update and draft training side by
side -> new policy and draft weights hot-swapped into every running engine -> metrics; a
checkpoint every N iterations and at the end.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import ray
import torch
from tqdm import tqdm

from grpo_specdec.grpo.core import group_advantages
from grpo_specdec.job.actors import Placement
from grpo_specdec.job.checkpoints import (
    LATEST,
    check_checkpoint,
    latest_checkpoint,
    point_latest_at,
    read_state,
    replace_dir,
    resume_timeline,
)
from grpo_specdec.job.config import TrainConfig
from grpo_specdec.job.data_parallel import shard
from grpo_specdec.job.roles import PolicyBatch, Rollout
from grpo_specdec.modelcheck import resolve_max_model_len
from grpo_specdec.runtime import runtime_env, worker_cpus_env
from grpo_specdec.tasks.datasets import ArithmeticSource, JsonlSource
from grpo_specdec.tasks.rewards import reward
from vllm_plugin.manifest import MixedWeightsError, read_manifest
from vllm_plugin.settings import profile_key, store_path


def resolve_model(name: str) -> str:
    """'smollm2', 'tiny' and 'smollm2-arith' name the project's assets; anything else is a path."""
    if name == "smollm2":
        from grpo_specdec.assets.smollm2 import prepare_smollm2

        return str(prepare_smollm2())
    if name in ("tiny", "tiny-draft"):
        from grpo_specdec.assets.smollm2 import default_dir
        from grpo_specdec.assets.tiny import build_tiny

        root = default_dir().parent / "tiny"
        if not (root / "draft" / "model.safetensors").is_file():
            build_tiny(root)
        return str(root / ("target" if name == "tiny" else "draft"))
    if name == "smollm2-arith":
        from grpo_specdec.assets.smollm2 import DEFAULT_DRAFT_VOCAB, head_dir
        from grpo_specdec.draft.bootstrap import DraftBootstrapConfig, bootstrap_draft

        out = head_dir()
        if not (out / "model.safetensors").is_file():
            bootstrap_draft(
                DraftBootstrapConfig(
                    target=resolve_model("smollm2"),
                    out=str(out),
                    task="arithmetic",
                    steps=300,
                    draft_vocab=DEFAULT_DRAFT_VOCAB,
                )
            )
        return str(out)
    return name


class Job:
    MAX_CONSECUTIVE_RESTARTS = 3

    def __init__(self, cfg: TrainConfig, resume: str | None = None, log=print):
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.out)
        self.ckpts = self.out / "checkpoints"
        self.metrics_path = self.out / "metrics.jsonl"
        self.base_policy = resolve_model(cfg.model.policy)
        self.base_draft = cfg.model.draft and resolve_model(cfg.model.draft)
        self._check_context_length()
        ckpt = None
        if resume:
            ckpt = resume_timeline(self.ckpts, self._resume_point(Path(resume)), self.log)
        elif latest_checkpoint(self.ckpts) is not None:
            raise ValueError(
                f"{self.ckpts} already holds checkpoints: pass --resume {self.out} or choose another out"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        self.source = (
            JsonlSource(cfg.data.path)
            if cfg.data.source == "jsonl"
            else ArithmeticSource(cfg.data.seed, cfg.data.levels)
        )
        self.weight_dtype = str(
            next(iter(read_manifest(self.base_policy).values()))[1]
        ).removeprefix("torch.")
        self._init_ray()
        self.placement = Placement(cfg.ray, draft=self._has_draft_learner(cfg.model.draft))
        self.rollouts, self.policies, self.draft = [], [], None
        self._start(ckpt)

    def _check_context_length(self) -> None:
        """The engine checks its context length against the model too, but only inside its
        actor, once Ray and both learners have started: say it here, by the config's name."""
        r = self.cfg.rollout
        try:
            resolve_max_model_len(
                r.max_model_len,
                self.base_policy,
                r.kv_cache_gib,
                self.cfg.model.engine_dtype,
                self.base_draft or None,
            )
        except ValueError as err:
            raise ValueError(f"rollout.max_model_len: {err}") from None

    def _start(self, ckpt: Path | None) -> None:
        """Create the three roles: from checkpoint `ckpt`, or from the configured models."""
        cfg = self.cfg
        policy_dir, draft_dir = self.base_policy, self.base_draft
        if ckpt is not None:
            state = read_state(ckpt)
            self.iteration, self.cursor = state["iteration"], state["cursor"]
            random.setstate(_tuplify(state["python_rng"]))
            policy_dir, draft_dir = str(ckpt / "policy"), str(ckpt / "draft")
            self.log(f"starting from checkpoint {ckpt} at iteration {self.iteration}")
        else:
            self.iteration, self.cursor = 0, 0
            random.seed(cfg.seed)
        place = self.placement
        if self._has_draft_learner(draft_dir):
            self.draft = place.actor("draft", max_restarts=-1).remote(
                self.base_policy,
                draft_dir,
                cfg.draft.train,
                cfg.model.device,
                cfg.seed,
                str(self.ckpts),
            )
            if not draft_dir:  # a new head: the engine needs it on disk to start
                draft_dir = self.base_draft = str(self.out / "initial_draft")
                staging = self.out / "initial_draft_state"
                shutil.rmtree(staging, ignore_errors=True)
                ray.get(self.draft.save.remote(staging))
                replace_dir(staging / "draft", Path(draft_dir))  # e.g. an earlier run's head
                shutil.rmtree(staging)
        self.policies = [
            place.actor("policy", rank).remote(
                self.base_policy, cfg.policy, cfg.model.device, cfg.model.train_dtype, cfg.seed
            )
            for rank in range(cfg.ray.policy_workers)
        ]
        if len(self.policies) > 1:
            address = ray.get(self.policies[0].rendezvous.remote())
            world = len(self.policies)
            ray.get([p.join.remote(address, rank, world) for rank, p in enumerate(self.policies)])
        if ckpt is not None:
            ray.get([p.load.remote(ckpt) for p in self.policies])
        self._ensure_profile(draft_dir)
        self._engine_cfg = self._engine_config(policy_dir, draft_dir)
        # The engines start from the weights the learners hold now: they report their versions.
        learners = {"policy": self.policies[0], "draft": self.draft}
        learners = {role: a for role, a in learners.items() if a is not None}
        status = ray.get([a.status.remote() for a in learners.values()])
        versions = {role: s["version"] for role, s in zip(learners, status, strict=True)}
        self.draft_version = versions.get("draft", 0)  # the newest draft version issued
        self.rollouts = [
            place.actor("rollout", i).remote(self._engine_cfg, versions)
            for i in range(cfg.ray.rollout_workers)
        ]
        # Start-up (model loads, engine compile) must not count in the first iteration's times.
        ray.get([a.__ray_ready__.remote() for a in self._actors()])
        self._served = self._weights_served(versions)
        _truncate_metrics(self.metrics_path, self.iteration)

    def _has_draft_learner(self, draft_dir: str | None) -> bool:
        """A learner when the draft trains online, or to create a new head for the engine."""
        cfg = self.cfg
        return cfg.rollout.speculation != "off" and (cfg.draft.online or not draft_dir)

    def _actors(self) -> list:
        return [*self.rollouts, *self.policies, *([self.draft] if self.draft else [])]

    def _weights_served(self, versions: dict[str, int]) -> dict:
        """role -> (weights in the object store, version, metadata) the engines serve.
        Kept with several engines only: a swap that fails in one puts these back into the
        others, so that no engine serves a version the rest do not."""
        if len(self.rollouts) == 1:
            return {}
        served = {
            "policy": (
                self.policies[0].export_weights.remote(self.weight_dtype),
                versions["policy"],
                None,
            )
        }
        if self.draft is not None and self.cfg.draft.online:
            weights, meta, _, _ = self.draft.export.options(num_returns=4).remote()
            served["draft"] = (weights, versions["draft"], ray.get(meta))
        return served

    def _restart(self, reason: str) -> None:
        """An actor died: rebuild every role from the newest checkpoint (or the start) and
        redo the iterations since; their metrics records are dropped first."""
        ckpt = latest_checkpoint(self.ckpts)
        self.log(f"{reason}; restarting all roles from {ckpt or 'the initial models'}")
        for actor in self._actors():
            ray.kill(actor, no_restart=True)
        self.rollouts, self.policies, self.draft = [], [], None
        self._start(ckpt)

    def _ensure_profile(self, draft_dir: str | None) -> None:
        """Concurrency-aware rollouts need the latency profile of this model on this
        hardware; measure it once (it is kept in the profile store) if it is missing."""
        r = self.cfg.rollout
        if (
            r.speculation != "concurrency_aware"
            or r.controller.policy == "fixed"
            or r.controller.profile
        ):
            return
        from grpo_specdec.profile import ProfileConfig, run_profile

        path = store_path(
            profile_key(self.base_policy, self.cfg.model.engine_dtype, draft_dir, r.draft_sampling)
        )
        if not path.is_file():
            self.log(
                f"no latency profile for {self.base_policy} on this hardware yet: profiling it first"
            )
            run_profile(
                ProfileConfig(
                    model=self.base_policy,
                    draft=draft_dir,
                    draft_sampling=r.draft_sampling,
                    dtype=self.cfg.model.engine_dtype,
                    k_max=r.k,
                    enforce_eager=r.enforce_eager,
                ),
                path,
                log=self.log,
            )
        # Named explicitly: after a resume the engine serves a checkpoint folder, not the base model.
        r.controller.profile = str(path)

    def _resume_point(self, path: Path) -> Path:
        if (path / "state.json").is_file():
            ckpt = path
        else:
            ckpt = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(
                f"--resume {path}: no checkpoint found (looked for {path}/checkpoints/{LATEST})"
            )
        check_checkpoint(ckpt)
        return ckpt

    def _init_ray(self) -> None:
        env = {
            k: v
            for k, v in runtime_env(dict(os.environ)).items()
            if k in ("LD_PRELOAD", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")
        }
        env.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
        address = self.cfg.ray.address or os.environ.get("RAY_ADDRESS")
        if ray.is_initialized():
            return
        if address:
            ray.init(address=address, runtime_env={"env_vars": env})
        else:
            ray.init(
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                runtime_env={
                    "env_vars": {**env, **worker_cpus_env()},
                    "worker_process_setup_hook": "grpo_specdec.runtime.restore_worker_cpus",
                },
                log_to_driver=True,
            )

    def _engine_config(self, policy_dir: str, draft_dir: str | None) -> dict:
        r = self.cfg.rollout
        spec = None
        if r.speculation != "off":
            spec = {
                "draft": draft_dir,
                "k": r.k,
                "draft_sampling": r.draft_sampling,
                "concurrency_aware": r.speculation == "concurrency_aware",
                "controller": r.controller.model_dump(),
            }
        return {
            "model": policy_dir,
            "dtype": self.cfg.model.engine_dtype,
            "max_model_len": r.max_model_len,
            "max_num_seqs": max(r.prompts_per_iteration * r.group_size, 8),
            "kv_cache_gib": r.kv_cache_gib,
            "seed": self.cfg.seed,
            "enforce_eager": r.enforce_eager,
            "speculative": spec,
        }

    # ---- one iteration ---------------------------------------------------------------------
    def _next_batch(self) -> tuple[list, dict, list[int] | None]:
        """The next iteration's examples, the sampling settings of its rollout, and with
        rollout.seeded each prompt's seed (from the job seed and the example's index)."""
        r = self.cfg.rollout
        examples = [self.source.get(self.cursor + i) for i in range(r.prompts_per_iteration)]
        sampling = {
            "n": r.group_size,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "max_tokens": r.max_tokens,
        }
        seeds = None
        if r.seeded:  # vLLM seeds a prompt's samples seed, seed + 1, ...: keep them apart
            seeds = [
                (self.cfg.seed << 32) + (self.cursor + i) * r.group_size
                for i in range(len(examples))
            ]
        return examples, sampling, seeds

    def _roll_out(
        self, prompts: list[str], sampling: dict, seeds: list[int] | None
    ) -> list[Rollout]:
        """Consecutive prompt groups to each engine, side by side; their rollouts in order."""
        parts = [shard(len(prompts), i, len(self.rollouts)) for i in range(len(self.rollouts))]
        return _get_all(
            [
                engine.rollout.remote(
                    [prompts[i] for i in part], sampling, seeds and [seeds[i] for i in part]
                )
                for engine, part in zip(self.rollouts, parts, strict=True)
            ]
        )

    def step(self) -> dict:
        t_start = time.perf_counter()
        examples, sampling, seeds = self._next_batch()
        per_engine = self._roll_out([e.question for e in examples], sampling, seeds)
        rollout = Rollout.gather(per_engine)
        t_gen = time.perf_counter()

        rewards = torch.tensor(
            [
                [reward(text, e.answer) for text in texts]
                for e, texts in zip(examples, rollout.texts, strict=True)
            ]
        )
        correct = torch.tensor(
            [
                [float(reward(text, e.answer, 0.0) > 0) for text in texts]
                for e, texts in zip(examples, rollout.texts, strict=True)
            ]
        )
        adv, informative = group_advantages(rewards)
        batch = PolicyBatch([], [], [], [])
        for g, prompt in enumerate(rollout.prompt_ids):
            for s, response in enumerate(rollout.responses[g]):
                batch.token_ids.append(prompt + response)
                batch.prompt_lens.append(len(prompt))
                batch.advantages.append(float(adv[g, s]))
                batch.informative.append(bool(informative[g]))

        batch = ray.put(batch)  # once, for every rank
        shards = [p.prepare.remote(batch) for p in self.policies]
        updates = [p.update.remote() for p in self.policies]
        draft_job = (
            self.draft.train.remote(*shards, after_version=self.draft_version)
            if self.draft is not None and self.cfg.draft.online
            else None
        )
        policy_stats = _get_all(updates)[0]  # every rank returns the whole batch's
        t_policy = time.perf_counter()
        draft_stats = self._finish_draft(draft_job, shards)
        self.draft_version = draft_stats.get("draft_version", self.draft_version)
        t_draft = time.perf_counter()

        sync = {}
        if policy_stats.get("policy_steps"):
            sync["policy"] = self._sync_policy(policy_stats["policy_version"])
        if draft_stats.get("draft_steps"):
            weights, *facts = self.draft.export.options(num_returns=4).remote()
            meta, dversion, trained_on = ray.get(facts)  # the weights stay in the object store
            try:
                sync["draft"] = self._swap("draft", weights, dversion, meta)
                draft_stats["draft_trained_on_policy"] = trained_on
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, MixedWeightsError):
                    raise  # the engine refuses to generate until a draft loads whole
                # The engines rejected or undid the swap and still serve their previous
                # draft; rollouts stay correct (speculation is lossless), only slower.
                draft_stats["draft_swap_error"] = str(err.cause if err.cause else err).splitlines()[
                    0
                ]
                self.log(
                    f"iteration {self.iteration + 1}: draft swap failed, keeping the previous draft: "
                    f"{draft_stats['draft_swap_error']}"
                )
        t_end = time.perf_counter()

        versions = self._engine_versions()
        self.cursor += len(examples)
        self.iteration += 1
        n_tokens = sum(len(x) for g in rollout.responses for x in g)
        record = {
            "iteration": self.iteration,
            "reward_mean": float(rewards.mean()),
            "rewards": [round(float(x), 4) for x in rewards.flatten()],
            "accuracy": float(correct.mean()),
            "informative_groups": int(informative.sum()),
            "response_length": n_tokens / rewards.numel(),
            "generation_s": t_gen - t_start,
            "policy_update_s": t_policy - t_gen,
            "draft_train_s": draft_stats.pop("draft_seconds", 0.0),
            "draft_wait_s": t_draft - t_policy,
            "sync_s": t_end - t_draft,
            "iteration_s": t_end - t_start,
            "tokens_per_s": n_tokens / rollout.wall_s,
            "acceptance_rate": rollout.spec["acceptance_rate"],
            "mean_acceptance_length": rollout.spec["mean_acceptance_length"],
            "per_position_acceptance": rollout.spec["per_position_acceptance"],
            "k_steps": {str(k): v for k, v in sorted(rollout.k_steps.items())},
            **(rollout.sources or {}),
            "engine_policy_version": versions["policy"],
            "engine_draft_version": versions["draft"],
            **policy_stats,
            **draft_stats,
        }
        if len(per_engine) > 1:
            record["engines"] = [part.summary() for part in per_engine]
        if "draft_trained_on_policy" in record:
            record["draft_policy_lag"] = versions["policy"] - record["draft_trained_on_policy"]
        record["policy_sync_s"] = sync.get("policy", {}).get("total_s", 0.0)
        record["draft_sync_s"] = sync.get("draft", {}).get("total_s", 0.0)
        return record

    def _engine_versions(self) -> dict[str, int]:
        """The weight versions every engine serves; they must agree."""
        versions = ray.get([engine.versions.remote() for engine in self.rollouts])
        if any(v != versions[0] for v in versions):
            raise RuntimeError(f"the engines serve different weight versions: {versions}")
        return versions[0]

    def _swap(self, role: str, weights, version: int, metadata: dict | None = None) -> dict:
        """Load `role` weights (one object in Ray's object store) into every engine, all or
        none: when one engine fails, the others get the weights they served back and the
        failure is raised. Engines load side by side; the slowest one's time is reported."""
        loads = [e.load_weights.remote(role, weights, version, metadata) for e in self.rollouts]
        outcomes = []
        for load in loads:
            try:
                outcomes.append(ray.get(load))
            except ray.exceptions.RayTaskError as err:
                outcomes.append(err)
        failures = [o for o in outcomes if isinstance(o, Exception)]
        if failures:
            # An engine whose weights may be a mix refuses to generate: that one is the news.
            failures.sort(key=lambda err: not isinstance(err.cause, MixedWeightsError))
            loaded = [
                e
                for e, o in zip(self.rollouts, outcomes, strict=True)
                if not isinstance(o, Exception)
            ]
            if loaded:
                try:
                    ray.get([e.load_weights.remote(role, *self._served[role]) for e in loaded])
                except ray.exceptions.RayTaskError as err:
                    raise err from failures[0]
            raise failures[0]
        if self._served:
            self._served[role] = (weights, version, metadata)
        return {"total_s": max(o["total_s"] for o in outcomes)}

    def _sync_policy(self, version: int) -> dict:
        """Policy weights must reach the engines, or rollouts would come from a stale
        policy: a failed sync stops the job with the reason, which says what the engines
        hold now (the previous weights, or, if restoring them failed too, a mix they
        refuse to generate from); the last checkpoint is intact."""
        try:
            return self._swap(
                "policy", self.policies[0].export_weights.remote(self.weight_dtype), version
            )
        except ray.exceptions.RayTaskError as err:
            cause = str(err.cause if err.cause else err).splitlines()[0]
            raise RuntimeError(
                f"iteration {self.iteration + 1}: policy weight sync (version {version}) failed: {cause}. "
                f"Stopping; resume from {self.ckpts} once the cause is fixed."
            ) from err

    def _finish_draft(self, job, shards: list, restart_timeout_s: float = 300.0) -> dict:
        if job is None:
            return {}
        deadline = time.monotonic() + restart_timeout_s
        while True:
            try:
                return ray.get(job)
            except ray.exceptions.RayActorError as err:
                if time.monotonic() > deadline:
                    raise
                self.log(
                    f"iteration {self.iteration + 1}: the draft learner is down ({type(err).__name__}); "
                    "Ray restarts it from its last checkpoint; training it on this rollout again"
                )
                time.sleep(1.0)
                job = self.draft.train.remote(*shards, after_version=self.draft_version)

    # ---- checkpoints -------------------------------------------------------------------
    def checkpoint(self) -> Path:
        """Write everything needed to continue, atomically: a half-written checkpoint is
        never named by `latest`, so the previous one stays loadable."""
        final = self.ckpts / f"iter_{self.iteration:06d}"
        # Resuming moved any later checkpoint aside: one found here is the one `latest`
        # names (or the resume point), which a restart or resume still needs.
        if final.exists():
            raise FileExistsError(f"checkpoint {final} exists already; refusing to overwrite it")
        tmp = self.ckpts / f".tmp_{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        jobs = [self.policies[0].save.remote(tmp)]  # every rank holds the same
        if self.draft is not None:
            jobs.append(self.draft.save.remote(tmp))
        ray.get(jobs)
        if self.draft is None and self._engine_cfg["speculative"]:
            # frozen draft: keep the head the engine serves next to the policy
            shutil.copytree(self._engine_cfg["speculative"]["draft"], tmp / "draft")
        state = {
            "iteration": self.iteration,
            "cursor": self.cursor,
            "python_rng": random.getstate(),
            "config": self.cfg.model_dump(),
        }
        (tmp / "state.json").write_text(json.dumps(state))
        os.replace(tmp, final)
        point_latest_at(self.ckpts, final)
        return final

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> list[dict]:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(self.out / "tensorboard"))
        records = []
        bar = tqdm(
            initial=self.iteration,
            total=self.cfg.iterations,
            desc="GRPO",
            unit="iter",
        )
        consecutive_failures = 0
        while self.iteration < self.cfg.iterations:
            try:
                record = self.step()
            except ray.exceptions.RayActorError as err:
                consecutive_failures += 1
                if consecutive_failures > self.MAX_CONSECUTIVE_RESTARTS:
                    raise
                self._restart(
                    f"iteration {self.iteration + 1}: an actor died ({type(err).__name__})"
                )
                # The iterations since the checkpoint run again: keep each record once.
                records = [r for r in records if r["iteration"] <= self.iteration]
                bar.n = self.iteration
                bar.refresh()
                continue
            consecutive_failures = 0
            records.append(record)
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            for key, value in record.items():
                if isinstance(value, int | float):
                    tb.add_scalar(key, value, self.iteration)
            for i, p in enumerate(record["per_position_acceptance"]):
                tb.add_scalar(f"per_position_acceptance/{i}", p, self.iteration)
            for i, engine in enumerate(record.get("engines", [])):
                for key in ("tokens_per_s", "mean_acceptance_length", "wall_s"):
                    tb.add_scalar(f"engine{i}/{key}", engine[key], self.iteration)
            ks = [int(k) for k, n in record["k_steps"].items() for _ in range(n)]
            if ks:
                tb.add_histogram("k_chosen", torch.tensor(ks), self.iteration)
            bar.update(1)
            bar.set_postfix(
                reward=f"{record['reward_mean']:.2f}",
                mal=f"{record['mean_acceptance_length']:.2f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
            )
            if (
                self.iteration % self.cfg.checkpoint_every == 0
                or self.iteration == self.cfg.iterations
            ):
                self.checkpoint()
        bar.close()
        tb.close()
        return records

    def compare_rollout(self) -> dict[str, dict]:
        """The next batch of prompts rolled out twice, one engine after the other: by the
        job's (first) engine (its speculation, final weights) and by an engine without
        speculation serving the last checkpoint's policy (the same weights)."""
        ckpt = latest_checkpoint(self.ckpts)
        if ckpt is None or read_state(ckpt)["iteration"] != self.iteration:
            ckpt = self.checkpoint()
        examples, sampling, seeds = self._next_batch()
        prompts = [e.question for e in examples]
        plain_cfg = {**self._engine_cfg, "model": str(ckpt / "policy"), "speculative": None}
        plain = self.placement.actor("rollout", None).remote(plain_cfg, {})
        ray.get(plain.__ray_ready__.remote())  # start-up is not part of the comparison
        try:
            runs = {
                "no speculation": ray.get(plain.rollout.remote(prompts, sampling, seeds)),
                f"speculation: {self.cfg.rollout.speculation}": ray.get(
                    self.rollouts[0].rollout.remote(prompts, sampling, seeds)
                ),
            }
        finally:
            ray.get(plain.shutdown.remote())
            ray.kill(plain)
        return {name: run.summary() for name, run in runs.items()}

    def shutdown(self) -> None:
        ray.get([engine.shutdown.remote() for engine in self.rollouts])
        ray.get([rank.shutdown.remote() for rank in self.policies])
        self.placement.remove()
        ray.shutdown()


def comparison_table(runs: dict[str, dict], prompts: int, group: int) -> str:
    """`Job.compare_rollout`'s result, side by side."""
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
    return "\n".join(lines)


def _get_all(refs: list) -> list:
    """ray.get of every ref, raising as soon as one fails: a rank whose peer died would
    otherwise hold the caller in a collective until the group's timeout."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(list(refs))


def _truncate_metrics(path: Path, iteration: int) -> None:
    """Drop records of iterations after the resume point, so none is counted twice."""
    if not path.is_file():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["iteration"] <= iteration
    ]
    path.write_text("".join(line + "\n" for line in keep))


def _tuplify(x):
    """JSON turned the RNG state's tuples into lists; random.setstate wants tuples."""
    return tuple(_tuplify(i) for i in x) if isinstance(x, list) else x
