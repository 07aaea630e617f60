"""The GRPO job end to end on the tiny models, through Ray."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import torch

from grpo_specdec.config import load_yaml
from grpo_specdec.job.config import TrainConfig
from tests.conftest import TINY_JOB_CONFIG as CONFIG
from tests.conftest import job_overrides, job_records, run_cli


def _engine_greedy(
    worker, prompts: list[str], max_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """Runs in the rollout actor: (prompt ids, the engine's greedy output ids) per prompt."""
    from grpo_specdec.engine import SamplingSettings

    res = worker.engine.generate(prompts, SamplingSettings(max_tokens=max_tokens))
    return [(p, g[0].token_ids) for p, g in zip(res.prompt_token_ids, res.outputs, strict=True)]


def _hf_greedy(learner, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Runs in the policy actor: the learner's HF model decoding greedily."""
    learner.model.eval()
    ids = torch.tensor([prompt_ids], device=learner.device)
    with torch.no_grad():
        out = learner.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=learner.model.config.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_job_runs_syncs_weights_and_survives_a_dead_draft_learner(
    tiny_target, tiny_draft, job_profile, tmp_path, questions
):
    import ray

    from grpo_specdec.job.run import Job

    out = tmp_path / "run"
    cfg = load_yaml(
        TrainConfig,
        CONFIG,
        [
            *job_overrides(tiny_target, tiny_draft, job_profile, out, 2),
            "rollout.controller.group.enabled=true",
        ],
    )
    job = Job(cfg)
    try:
        job.run()
        records = job_records(out)
        assert [r["iteration"] for r in records] == [1, 2]
        # Group drafts: counted per source, and the engine keeps the rollouts it made.
        for source in ("model", "group"):
            assert records[-1][f"{source}_accepted_tokens"] <= records[-1][f"{source}_draft_tokens"]
        assert records[-1]["group_history_positions"] >= 16 * records[-1]["response_length"]
        for key in (
            "reward_mean",
            "accuracy",
            "response_length",
            "generation_s",
            "policy_update_s",
            "draft_train_s",
            "sync_s",
            "tokens_per_s",
            "acceptance_rate",
            "mean_acceptance_length",
            "per_position_acceptance",
            "k_steps",
        ):
            assert key in records[-1], key
        assert any(
            p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir()
        )
        # Every role computes on the driver's CPUs, not on the single core that processes
        # forked after OpenMP start-up (the embedded raylet, so every worker) are pinned to.
        for actor in (*job.rollouts, *job.policies, job.draft):
            cpus = ray.get(actor.__ray_call__.remote(lambda _: os.sched_getaffinity(0)))
            assert cpus == os.sched_getaffinity(0)
        versions = ray.get(job.rollouts[0].versions.remote())
        assert versions["draft"] == 2  # a new head every iteration
        assert versions["policy"] == sum(r["policy_steps"] for r in records)
        # The engine serves exactly the learner's weights: greedy decoding agrees with HF.
        greedy = ray.get(job.rollouts[0].__ray_call__.remote(_engine_greedy, questions[:4], 20))
        for prompt_ids, engine_out in greedy:
            assert (
                ray.get(job.policies[0].__ray_call__.remote(_hf_greedy, prompt_ids, 20))
                == engine_out
            )

        before = ray.get(job.draft.status.remote())
        ray.kill(job.draft, no_restart=False)
        job.cfg.iterations = 3
        job.run()
        after = ray.get(job.draft.status.remote())
        assert after["pid"] != before["pid"]
        assert after["resumed_from"] == str(out / "checkpoints" / "iter_000002")
        assert after["version"] == before["version"] + 1  # training went on from the checkpoint
        assert [r["iteration"] for r in job_records(out)] == [1, 2, 3]
        assert sum(r["policy_steps"] for r in job_records(out)) >= 1
    finally:
        job.shutdown()


def test_kill_after_checkpoint_then_resume(tiny_target, tiny_draft, job_profile, tmp_path):
    out = tmp_path / "run"
    args = [
        "train",
        "--config",
        CONFIG,
        *job_overrides(tiny_target, tiny_draft, job_profile, out, 4),
        "rollout.draft_sampling=probabilistic",  # sampled drafts, through a resume
        "ray.rollout_workers=2",  # and a scaled-out job
        "ray.policy_workers=2",
    ]
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_specdec", *args],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 600
    while not (latest.is_file() and latest.read_text() == "iter_000002"):
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    opt_at_2 = torch.load(
        out / "checkpoints" / "iter_000002" / "policy_state.pt", weights_only=True
    )

    resumed = run_cli(*args, "compare_at_end=true", "--resume", str(out), timeout=900)
    records = job_records(out)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]  # none lost, none counted twice
    assert any(r["mean_acceptance_length"] > 1.0 for r in records)
    final = torch.load(out / "checkpoints" / "iter_000004" / "policy_state.pt", weights_only=True)
    steps = sum(r["policy_steps"] for r in records)
    assert final["version"] == steps
    # The optimiser continued: its step count carries on from the checkpoint's.
    step_at = lambda s: max((v["step"] for v in s["opt"]["state"].values()), default=0)  # noqa: E731
    assert step_at(final) == steps and step_at(final) >= step_at(opt_at_2)
    state = json.loads((out / "checkpoints" / "iter_000004" / "state.json").read_text())
    assert state["iteration"] == 4 and state["cursor"] == 4 * 4
    # compare_at_end: the next batch rolled out with and without speculation, side by side.
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in resumed.stdout.splitlines()
        if line.startswith("| no speculation") or line.startswith("| speculation:")
    }
    assert set(rows) == {"no speculation", "speculation: concurrency_aware"}, resumed.stdout
    assert all(int(cells[0]) > 0 for cells in rows.values())
    assert rows["no speculation"][3].strip() == "1.00x"


def test_resumed_engine_reports_the_checkpoint_weight_versions(
    tiny_target, tiny_draft, job_profile, tmp_path, monkeypatch
):
    import ray

    from grpo_specdec.job import run

    out = tmp_path / "run"
    cfg = load_yaml(
        TrainConfig, CONFIG, job_overrides(tiny_target, tiny_draft, job_profile, out, 1)
    )
    # Rewards that differ within every group: iteration 1 updates the policy.
    flips = itertools.count()
    monkeypatch.setattr(run, "reward", lambda *_: float(next(flips) % 2))
    job = run.Job(cfg)
    try:
        job.run()
    finally:
        job.shutdown()
    ckpt = out / "checkpoints" / "iter_000001"
    saved = {
        role: torch.load(ckpt / f"{role}_state.pt", weights_only=True)["version"]
        for role in ("policy", "draft")
    }
    assert saved == {"policy": 1, "draft": 1}

    # Equal rewards: iteration 2 leaves the policy as it is, so no swap renumbers it.
    monkeypatch.setattr(run, "reward", lambda *_: 0.0)
    cfg.iterations = 2
    job = run.Job(cfg, resume=str(out))
    try:
        assert ray.get(job.rollouts[0].versions.remote()) == saved
        job.run()
    finally:
        job.shutdown()
    record = job_records(out)[-1]
    assert record["iteration"] == 2 and record["policy_steps"] == 0
    assert record["engine_policy_version"] == 1 and record["engine_draft_version"] == 2
    assert record["draft_trained_on_policy"] == 1 and record["draft_policy_lag"] == 0
