"""Ray for the job: starting it (or joining a cluster), and the plain role classes,
unchanged, as actors placed by Ray in one placement group per role (N engines, N policy
ranks, one draft learner).

By default no CPUs are reserved: the roles take turns within an iteration, and a small
machine must still fit them all. GPUs (and CPUs, if asked) are reserved per actor from
the config; the strategy decides how each role's bundles spread over nodes. The draft
learner is restarted by Ray if its process dies; it reloads its last checkpoint in
__init__.
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from grpo_specdec.job.config import RaySettings
from grpo_specdec.job.learners import JobDraftLearner, PolicyLearner
from grpo_specdec.job.rollout_worker import RolloutWorker
from grpo_specdec.runtime import runtime_env, worker_cpus_env

ROLES = {"rollout": RolloutWorker, "policy": PolicyLearner, "draft": JobDraftLearner}
# Ray refuses bundles of zero resources: a hundredth of a CPU makes an actor that
# reserves nothing placeable without taking cores from the others.
_PLACEABLE_CPUS = 0.01


class Placement:
    """The job's placement groups, created once and kept across restarts of its actors."""

    def __init__(self, cfg: RaySettings, draft: bool = True, ready_timeout_s: float = 120.0):
        """`draft`: whether the job has a draft learner to place."""
        self.cfg = cfg
        self.groups = {}
        for role in [r for r in ROLES if draft or r != "draft"]:
            bundle = {"CPU": max(self._resources(role)["num_cpus"], _PLACEABLE_CPUS)}
            if self._resources(role)["num_gpus"]:
                bundle["GPU"] = self._resources(role)["num_gpus"]
            group = placement_group([bundle] * self.count(role), strategy=cfg.placement)
            self.groups[role] = group
            if not group.wait(ready_timeout_s):
                self.remove()
                raise RuntimeError(
                    f"Ray could not place {self.count(role)} {role} actor(s) of {bundle} "
                    f"({cfg.placement}) within {ready_timeout_s:.0f} s: the cluster lacks the "
                    f"resources set by ray.{role}_cpus / ray.{role}_gpus "
                    f"(it has {ray.cluster_resources()})"
                )

    def count(self, role: str) -> int:
        return {
            "rollout": self.cfg.rollout_workers,
            "policy": self.cfg.policy_workers,
            "draft": 1,
        }[role]

    def _resources(self, role: str) -> dict:
        return {
            "num_cpus": getattr(self.cfg, f"{role}_cpus"),
            "num_gpus": getattr(self.cfg, f"{role}_gpus"),
        }

    def actor(self, role: str, index: int | None = 0, **options):
        """The role's class as a Ray actor, in bundle `index` of the role's group (None:
        outside the groups, e.g. a short-lived extra engine)."""
        if index is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.groups[role], placement_group_bundle_index=index
            )
        return ray.remote(ROLES[role]).options(**self._resources(role), **options)

    def remove(self) -> None:
        for group in self.groups.values():
            remove_placement_group(group)
        self.groups = {}


def start_ray(cfg: RaySettings, env_vars: dict[str, str]) -> None:
    """Join the configured cluster, else start a local one on this machine's CPUs. Every
    worker gets the runtime settings of this process and `env_vars`."""
    if ray.is_initialized():
        return
    env = {
        k: v
        for k, v in runtime_env(dict(os.environ)).items()
        if k in ("LD_PRELOAD", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")
    }
    # The learners' model loads and saves would each draw a progress bar on the console.
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.update(env_vars)
    address = cfg.address or os.environ.get("RAY_ADDRESS")
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
