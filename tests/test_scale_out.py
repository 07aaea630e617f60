"""The job scaled out: two engines and two data-parallel policy ranks compute what one
engine and one rank compute, and every engine serves the same weights."""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from grpo_specdec.config import load_yaml
from grpo_specdec.job.config import TrainConfig
from tests.conftest import TINY_JOB_CONFIG as CONFIG
from tests.conftest import job_overrides, job_records

# a job, several engines or processes: `make test` runs it, `make test-fast` does not
pytestmark = pytest.mark.slow

# Two ranks sum the gradients one rank accumulates over the same micro-batches; only the
# order of float additions differs (measured: weights within 1.5e-8 after three steps,
# a loss of exactly 0 on one rank was -5e-9 on two).
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6


def _length_parity_grade(text: str, answer) -> bool:
    """A grade of the text alone, so equal rollouts get equal rewards, and groups differ."""
    return bool(len(text) % 2)


def _run(tmp_path, name, overrides, monkeypatch) -> tuple[list[dict], dict, list[dict]]:
    from grpo_specdec.job import run

    out = tmp_path / name
    cfg = load_yaml(TrainConfig, CONFIG, [*overrides, f"out={out}"])
    monkeypatch.setitem(run.GRADERS, cfg.reward.kind, _length_parity_grade)
    job = run.Job(cfg)
    try:
        records = job.run()
        served = ray.get([engine.versions.remote() for engine in job.rollouts])
    finally:
        job.shutdown()
    weights = load_file(out / "checkpoints" / "iter_000003" / "policy" / "model.safetensors")
    return records, weights, served


def test_two_engines_and_two_ranks_match_one_of_each(
    tiny_target, tiny_draft, job_profile, tmp_path, monkeypatch
):
    base = [
        *job_overrides(tiny_target, tiny_draft, job_profile, tmp_path, 3),
        # Seeded rollouts (vLLM on CPU honours request seeds without speculation): each
        # prompt's samples are the same whichever engine serves it.
        "rollout.seeded=true",
        "rollout.speculation=off",
        "policy.autocast=off",
        "policy.micro_batch=8",
    ]
    one, one_weights, _ = _run(tmp_path, "one", base, monkeypatch)
    two, two_weights, served = _run(
        tmp_path, "two", [*base, "ray.rollout_workers=2", "ray.policy_workers=2"], monkeypatch
    )
    assert [r["rewards"] for r in two] == [r["rewards"] for r in one]  # the same rollouts
    assert sum(r["policy_steps"] for r in one) >= 2
    for a, b in zip(one, two, strict=True):
        assert b["policy_steps"] == a["policy_steps"]
        for key in ("policy_loss", "policy_grad_norm", "policy_clip_frac"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL, abs=1e-7), key
        assert [e["prompts"] for e in b["engines"]] == [2, 2]
    assert one_weights.keys() == two_weights.keys()
    for name, w in one_weights.items():
        torch.testing.assert_close(
            two_weights[name],
            w,
            rtol=0,
            atol=WEIGHT_ATOL,
        )
    assert served == [served[0]] * 2
    assert served[0]["policy"] == sum(r["policy_steps"] for r in two)


def test_engines_serve_the_learners_versions_after_every_sync(
    tiny_target, tiny_draft, job_profile, tmp_path
):
    """Speculating engines with an online draft: each sync reaches both engines; the draft
    learns from every engine's rollouts (each rank's shard of the batch)."""
    from grpo_specdec.job.run import Job

    cfg = load_yaml(
        TrainConfig,
        CONFIG,
        [
            *job_overrides(tiny_target, tiny_draft, job_profile, tmp_path / "run", 1),
            "ray.rollout_workers=2",
            "ray.policy_workers=2",
        ],
    )
    job = Job(cfg)
    try:
        # Each engine samples from its own stream (one seed for all drew the same numbers).
        seeds = ray.get([e.__ray_call__.remote(lambda w: w.engine.cfg.seed) for e in job.rollouts])
        assert len(set(seeds)) == 2
        for iteration in (1, 2, 3):
            job.cfg.iterations = iteration
            job.run()
            served = ray.get([engine.versions.remote() for engine in job.rollouts])
            learners = {
                "policy": ray.get(job.policies[0].status.remote())["version"],
                "draft": ray.get(job.draft.status.remote())["version"],
            }
            assert served == [learners, learners], iteration
    finally:
        job.shutdown()
    records = job_records(tmp_path / "run")
    assert all(len(r["engines"]) == 2 for r in records)
    sequences = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    assert all(r["draft_sequences"] == sequences for r in records)
    assert sum(r["draft_steps"] for r in records) > 0


def test_layouts_the_job_cannot_run_are_refused_by_name(tiny_target):
    from grpo_specdec.config import ConfigError

    cases = {
        "ray.rollout_workers=5": "ray.rollout_workers=5 exceeds rollout.prompts_per_iteration=4",
        "ray.placement=EVERYWHERE": "ray.placement: Input should be 'PACK'",
        "ray.policy_workers=0": "ray.policy_workers: Input should be greater than or equal to 1",
        "policy.sharding=zero3": "policy.sharding: Input should be 'none' or 'fsdp'",
        "policy.sharding=fsdp": "policy.sharding=fsdp shards over ray.policy_workers ranks, "
        "and ray.policy_workers=1",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_yaml(TrainConfig, CONFIG, [f"model.policy={tiny_target}", override])
    with pytest.raises(ConfigError, match="NCCL needs one whole GPU per rank"):
        load_yaml(
            TrainConfig,
            CONFIG,
            ["model.device=cuda", "ray.policy_workers=2", "ray.policy_gpus=0.5"],
        )


def test_several_policy_ranks_shard_by_default(tiny_target):
    def sharding(*overrides):
        cfg = load_yaml(TrainConfig, CONFIG, [f"model.policy={tiny_target}", *overrides])
        return cfg.policy.sharding

    assert sharding() == "none"
    assert sharding("ray.policy_workers=2") == "fsdp"
    assert sharding("ray.policy_workers=2", "policy.sharding=none") == "none"


def test_a_cluster_without_room_for_a_role_is_reported_by_name():
    from ray.util import placement_group_table

    from grpo_specdec.job.actors import Placement
    from grpo_specdec.job.config import RaySettings

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        with pytest.raises(RuntimeError, match=r"2 rollout actor\(s\).*ray\.rollout_gpus"):
            Placement(RaySettings(rollout_workers=2, rollout_gpus=1), ready_timeout_s=2)
        # nothing is left reserved
        assert {g["state"] for g in placement_group_table().values()} == {"REMOVED"}
        placed = Placement(RaySettings(rollout_workers=2, policy_workers=2, policy_cpus=0.5))
        live = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
        assert sorted(len(g["bundles"]) for g in live) == [1, 2, 2]  # draft, engines, ranks
        placed.remove()
    finally:
        ray.shutdown()
