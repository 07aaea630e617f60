"""Ray actors: the plain role classes, unchanged, placed by Ray.

CPUs are not reserved (num_cpus=0): the roles take turns within an iteration, and a
small machine must still fit all three. GPUs are requested per role from the config.
The draft learner is restarted by Ray if its process dies; it reloads its last
checkpoint in __init__.
"""

from __future__ import annotations

import ray

from grpo_specdec.job.config import RaySettings
from grpo_specdec.job.roles import DraftLearner, PolicyLearner, RolloutWorker


def remote_roles(cfg: RaySettings):
    rollout = ray.remote(num_cpus=0, num_gpus=cfg.rollout_gpus)(RolloutWorker)
    policy = ray.remote(num_cpus=0, num_gpus=cfg.policy_gpus)(PolicyLearner)
    draft = ray.remote(num_cpus=0, num_gpus=cfg.draft_gpus, max_restarts=-1)(DraftLearner)
    return rollout, policy, draft
