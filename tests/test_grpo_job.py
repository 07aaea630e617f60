"""The GRPO job end to end on the tiny models, through Ray."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from grpo_specdec.config import load_yaml
from grpo_specdec.grpo.core import group_advantages
from grpo_specdec.job.batches import batch_at
from grpo_specdec.job.config import TrainConfig
from tests.conftest import ROOT, job_overrides, job_records, run_cli
from tests.conftest import TINY_JOB_CONFIG as CONFIG

# a job, several engines or processes: `make test` runs it, `make test-fast` does not
pytestmark = pytest.mark.slow


def _engine_params(worker) -> dict[str, torch.Tensor]:
    """Runs in the rollout actor: the engine's parameters that it keeps as loaded (on CPU,
    vLLM repacks its linear layers' weights for oneDNN, leaving those empty)."""

    def read(model):
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.numel()}

    return worker.engine.llm.apply_model(read)[0]


def _learner_params(learner) -> dict[str, torch.Tensor]:
    """Runs in the policy actor: the learner's parameters."""
    return {n: p.detach().cpu().clone() for n, p in learner.model.named_parameters()}


def _verl_parquet(path: Path, n: int) -> Path:
    """`n` level-1 arithmetic problems in verl's parquet layout (chat-turn prompts, the
    ground truth under reward_model)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from grpo_specdec.tasks.datasets import ArithmeticSource

    source = ArithmeticSource(0, [1])
    rows = [
        {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": source.get(i).question}],
            "reward_model": {"style": "rule", "ground_truth": source.get(i).answer},
        }
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _kill_before(job, iteration: int, actor, no_restart: bool) -> None:
    """`actor(job)` dies as `iteration` starts; with no_restart=False Ray restarts it."""
    import ray

    step = job.step

    def kill_then_step():
        if job.iteration + 1 == iteration:
            job.step = step
            ray.kill(actor(job), no_restart=no_restart)
        return step()

    job.step = kill_then_step


def test_job_runs_syncs_weights_and_survives_a_dead_draft_learner(
    tiny_target, tiny_draft, job_profile, tmp_path, questions
):
    import ray

    from grpo_specdec.job.run import Job

    out = tmp_path / "run"
    data = _verl_parquet(tmp_path / "train.parquet", 64)
    cfg = load_yaml(
        TrainConfig,
        CONFIG,
        [
            *job_overrides(tiny_target, tiny_draft, job_profile, out, 2),
            "rollout.controller.group.enabled=true",
            "rollout.length_budget.median=16",
            "rollout.max_gen_batches=2",
            "data.source=parquet",
            f"data.path={data}",
            f"data.eval_path={data}",
        ],
    )
    job = Job(cfg)
    try:
        job.run()
        records = job_records(out)
        assert [r["iteration"] for r in records] == [1, 2]
        # The data came from verl's parquet layout, as chat turns, graded by math-verify.
        assert job.source.get(0).question.messages()[0]["role"] == "user"
        assert cfg.reward.kind == "math_verify"
        # Dynamic sampling: a second batch where the first had too few groups with reward
        # variance (the tiny policy rarely earns a reward), the policy trained on at most a
        # batch of them, the cursor past every prompt rolled out.
        assert any(r["gen_batches"] == 2 for r in records)
        prompts, group = cfg.rollout.prompts_per_iteration, cfg.rollout.group_size
        for r in records:
            first = torch.tensor(r["rewards"][: prompts * group])
            first_batch_signal = int(group_advantages(first.view(prompts, group))[1].sum())
            assert r["gen_batches"] == (1 if first_batch_signal == prompts else 2)
            assert len(r["rewards"]) == r["gen_batches"] * prompts * group
            assert r["policy_sequences"] == r["informative_groups"] * group <= prompts * group
        assert job.cursor == sum(r["gen_batches"] for r in records) * prompts
        # Group drafts: both sources drafted, the group's tokens were accepted, and the
        # engine keeps the rollouts it made. (The tiny head's own drafts at T = 1 are few
        # here, ~12 tokens, once the controller prices them against the group's: whether
        # any is accepted depends on the machine's sampling draws; tests/test_draft_swap.py
        # and tests/test_sampled_drafts.py measure the head's acceptance.)
        for source in ("model", "group"):
            drafted = sum(r[f"{source}_draft_tokens"] for r in records)
            accepted = sum(r[f"{source}_accepted_tokens"] for r in records)
            assert 0 <= accepted <= drafted and drafted > 0, (source, accepted, drafted)
        assert sum(r["group_accepted_tokens"] for r in records) > 0
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
        # Held-out evaluation before training and after the last iteration (every 5: none
        # between), in eval.jsonl and in the evaluated iteration's record.
        evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
        assert [e["iteration"] for e in evals] == [0, 2]
        for e in evals:
            assert e["examples"] == 16 and e["interval"][0] <= e["accuracy"] <= e["interval"][1]
        assert records[-1]["eval_accuracy"] == evals[-1]["accuracy"]
        assert "eval_accuracy" not in records[0]
        # The rollout policy's token entropy, from the learner's logits: positive, below
        # the uniform distribution's over the tiny vocabulary.
        vocab = json.loads((Path(tiny_target) / "config.json").read_text())["vocab_size"]
        assert all(0 < r["policy_entropy"] < math.log(vocab) for r in records)
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
        # The engine serves exactly the learner's weights: every parameter it keeps as
        # loaded (the norms and the embedding, each trained every step) equals the
        # learner's, rounded to the engine's dtype. (Greedy text is no test of it: on CPUs
        # with AMX, oneDNN computes float32 linears at lower precision, which flips near ties.)
        served = ray.get(job.rollouts[0].__ray_call__.remote(_engine_params))
        learnt = ray.get(job.policies[0].__ray_call__.remote(_learner_params))
        compared = [name for name in learnt if name in served]
        layers = json.loads((Path(tiny_target) / "config.json").read_text())["num_hidden_layers"]
        assert len(compared) >= 2 * layers + 2, compared  # two norms a layer, the last, embed
        for name in compared:
            rows = learnt[name].shape[0]  # vLLM pads the embedding's rows
            assert torch.equal(served[name][:rows], learnt[name].to(served[name].dtype)), name
        # rollout.length_budget: every sample of a group stops at its own budget.
        batch = batch_at(job.source, job.cursor, cfg.rollout, cfg.seed)
        budgeted = ray.get(
            job.rollouts[0].rollout.remote(
                batch.prompts, {**batch.sampling, "ignore_eos": True}, None, batch.budgets
            )
        )
        assert [[len(s) for s in group] for group in budgeted.responses] == batch.budgets
        assert len({b for group in batch.budgets for b in group}) > 1

        # The draft learner dies after iteration 3, which wrote no checkpoint: Ray restarts
        # it from checkpoint 2, a version behind the draft the engine serves.
        before = ray.get(job.draft.status.remote())
        job.cfg.checkpoint_every, job.cfg.iterations = 10, 4
        _kill_before(job, 4, lambda j: j.draft, no_restart=False)
        job.run()
        after = ray.get(job.draft.status.remote())
        assert after["pid"] != before["pid"]
        assert after["resumed_from"] == str(out / "checkpoints" / "iter_000002")
        records = job_records(out)
        assert [r["iteration"] for r in records] == [1, 2, 3, 4]
        # It numbers on above the versions already served: no version names two heads.
        assert [r["engine_draft_version"] for r in records] == [1, 2, 3, 4]
        assert after["version"] == 4
        assert sum(r["policy_steps"] for r in records) >= 1
    finally:
        job.shutdown()


def test_sigkill_mid_checkpoint_then_resume(tiny_target, tiny_draft, job_profile, tmp_path):
    from grpo_specdec.checkpoint_pointer import latest_checkpoint
    from grpo_specdec.job.checkpoints import check_checkpoint

    out = tmp_path / "run"
    overrides = [
        *job_overrides(tiny_target, tiny_draft, job_profile, out, 4),
        "rollout.draft_sampling=probabilistic",  # sampled drafts, through a resume
        "ray.rollout_workers=2",  # and a scaled-out job
        "ray.policy_workers=2",
        # priced on the profile alone: this test asks of the controller only that it
        # drafts where the profile says drafting pays. An engine of CI's run on 2026-12-06
        # verified no accepted draft in iteration 4 (12 steps or so; k not recorded), where
        # every run here drafts k = 1 at acceptance ~0.9: the likeliest cause is prices
        # learnt from the tiny model's ~10 ms steps timed beside another test.
        "rollout.controller.learn_costs=false",
    ]
    # The job runs in a child process that dies (SIGKILL) in the middle of its third
    # checkpoint: after the roles' state is written, before it is renamed into place.
    driver = textwrap.dedent(f"""
        import os, signal
        import grpo_specdec.job.run as run
        from grpo_specdec.config import load_yaml
        from grpo_specdec.job.config import TrainConfig
        real_replace = os.replace
        def dying_replace(src, dst):
            if str(dst).endswith("iter_000003"):
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)
        run.os.replace = dying_replace
        run.Job(load_yaml(TrainConfig, {CONFIG!r}, {overrides!r})).run()
    """)
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", driver],
            stdout=log,
            stderr=log,
            start_new_session=True,
            cwd=ROOT,
        )
        try:
            returncode = proc.wait(timeout=900)
        finally:
            try:  # the job's Ray processes, in the driver's session
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    ckpts = out / "checkpoints"
    assert [p.name.split(".p")[0] for p in ckpts.glob(".tmp_*")] == [".tmp_iter_000003"]
    assert latest_checkpoint(ckpts) == ckpts / "iter_000002"
    check_checkpoint(ckpts / "iter_000002")  # whole and loadable
    opt_at_kill = torch.load(ckpts / "iter_000002" / "policy_state.pt", weights_only=True)
    args = ["train", "--config", CONFIG, *overrides]

    resumed = run_cli(
        *args,
        "compare_at_end=true",
        "compare.shape=tail",
        "compare.cap=48",
        "compare.fixed_k=[2]",
        "compare.natural_repeats=2",
        "--resume",
        str(out),
        timeout=900,
    )
    records = job_records(out)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]  # none lost, none counted twice
    # Both engines drafted and had drafts accepted in every iteration, before and after
    # the resume.
    for record in records:
        assert len(record["engines"]) == 2
        for engine in record["engines"]:
            said = (record["iteration"], engine["mean_acceptance_length"], engine["k_steps"])
            assert engine["mean_acceptance_length"] > 1.0, said
            assert any(int(k) > 0 for k in engine["k_steps"]), said
    final = torch.load(out / "checkpoints" / "iter_000004" / "policy_state.pt", weights_only=True)
    steps = sum(r["policy_steps"] for r in records)
    assert final["version"] == steps
    # The optimiser continued: its step count carries on from the checkpoint's, one a policy
    # step. (Not from 0: under FSDP, torch's state-dict gathering steps an optimiser that has
    # no state yet once, at lr 0, to create it: a checkpoint written before the first policy
    # step already counts one.)
    step_at = lambda s: max((v["step"] for v in s["opt"]["state"].values()), default=0)  # noqa: E731
    after_resume = sum(r["policy_steps"] for r in records if r["iteration"] > 2)
    assert step_at(final) == step_at(opt_at_kill) + after_resume
    state = json.loads((out / "checkpoints" / "iter_000004" / "state.json").read_text())
    assert state["iteration"] == 4 and state["cursor"] == 4 * 4
    # compare_at_end on the tail shape: the next batch rolled out with and without
    # speculation and at a fixed k, side by side.
    assert "as the tail shape" in resumed.stdout and "cap 48" in resumed.stdout
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
        for line in resumed.stdout.splitlines()
        if line.startswith(("| no speculation", "| speculation:", "| fixed k"))
    }
    assert set(rows) == {"no speculation", "speculation: concurrency_aware", "fixed k = 2"}
    plain, spec, fixed = (
        rows[n] for n in ("no speculation", "speculation: concurrency_aware", "fixed k = 2")
    )
    for tokens, seconds, tokens_per_s, _, tail_s, *_ in (plain, spec, fixed):
        # tokens/s is the row's own tokens over its own measured time (printed to 0.1 s);
        # 4 prompts x 4 samples, each within its 48-token cap
        assert 0 < int(tokens) <= 16 * 48 and float(tokens_per_s) > 0
        assert abs(int(tokens) / float(tokens_per_s) - float(seconds)) <= 0.06, (plain, spec)
        assert 0 <= float(tail_s) <= float(seconds) + 0.05
    # Every row made exactly the tokens each request made without speculation.
    assert plain[0] == spec[0] == fixed[0], (plain, spec, fixed)
    # Each row measured its own engine: the plain one never drafted; the speculative one
    # went through its scheduler (here ~12 tokens a request, 16 at once: it may well not
    # draft; every iteration above did); the fixed one drafted 2 or nothing, and had drafts
    # accepted.
    assert plain[5:7] == ["1.00", "-"], plain
    assert spec[6] != "-", spec
    assert {pair.split(":")[0] for pair in fixed[6].split(", ")} <= {"0", "2"} and "2:" in fixed[6]
    assert float(fixed[5]) > 1.0, fixed
    # Under the protocol: each ratio is the median over the repeats of no speculation's
    # time over the row's, inside its own 95% interval, with a verdict only outside 1.0; the
    # others' CPU share during the runs was measured (this machine has /proc).
    for row in (spec, fixed):
        ratio = float(row[3].removesuffix("x"))
        low, high = (float(x) for x in row[7].strip("[]").split(", "))
        assert low <= ratio <= high, row
        expected = "gain" if low > 1 else "loss" if high < 1 else "no clear difference"
        assert row[8] == expected, row
    for row in (plain, spec, fixed):
        assert row[9].endswith("%"), row
    assert "Medians of 3 repeats" in resumed.stdout
    saved = json.loads((out / "comparison.json").read_text())
    assert len(saved["no speculation"]["orders"]) == 3
    # and 2 natural-EOS rounds per row: each configuration its own answers, none past EOS
    natural = {n.removeprefix("natural EOS: "): v for n, v in saved.items() if "natural" in n}
    assert set(natural) == set(rows)
    assert {n: len(v["repeats"]) for n, v in saved.items()} == {
        **{n: 3 for n in rows},
        **{f"natural EOS: {n}": 2 for n in rows},
    }
    assert len(natural["no speculation"]["orders"]) == 2
    assert "'natural EOS' rows: 2 more repeats" in resumed.stdout
    (natural_plain,) = (
        line for line in resumed.stdout.splitlines() if line.startswith("| natural EOS: no spec")
    )
    assert [cell.strip() for cell in natural_plain.split("|")[2:-1]][8] == "-"  # no verdict


def test_resume_from_an_older_checkpoint_makes_it_the_only_timeline(
    tiny_target, tiny_draft, job_profile, tmp_path, monkeypatch
):
    import ray
    from safetensors.torch import load_file

    from grpo_specdec.checkpoint_pointer import latest_checkpoint
    from grpo_specdec.job import run
    from grpo_specdec.job.checkpoints import check_checkpoint, read_state
    from grpo_specdec.job.run import Job

    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    # An earlier start of this run died before its first checkpoint, leaving its new head.
    shutil.copytree(tiny_draft, out / "initial_draft")
    cfg = load_yaml(
        TrainConfig,
        CONFIG,
        [*job_overrides(tiny_target, tiny_draft, job_profile, out, 2), "model.draft=null"],
    )
    # Rewards that differ within every group: every iteration updates the policy.
    flips = itertools.count()
    monkeypatch.setitem(run.GRADERS, cfg.reward.kind, lambda *_: bool(next(flips) % 2))
    job = Job(cfg)
    try:
        # This start's new head replaced that one whole, and the engine serves it.
        assert job._engine_cfg.speculative.draft == str(out / "initial_draft")
        assert sorted(p.name for p in (out / "initial_draft").iterdir()) == [
            "config.json",
            "model.safetensors",
        ]
        on_disk = load_file(out / "initial_draft" / "model.safetensors")
        learner_head = ray.get(job.draft.export.remote())[0]
        assert on_disk.keys() == learner_head.keys()
        assert all(torch.equal(on_disk[k], learner_head[k]) for k in on_disk)
        job.run()
    finally:
        job.shutdown()
    first = ckpts / "iter_000001"
    saved = {
        role: torch.load(first / f"{role}_state.pt", weights_only=True)["version"]
        for role in ("policy", "draft")
    }
    assert saved == {"policy": 1, "draft": 1}

    # Equal rewards from here: iteration 2 leaves the policy as it is, so no swap renumbers
    # it, and the engine's versions are the checkpoint's.
    monkeypatch.setitem(run.GRADERS, cfg.reward.kind, lambda *_: False)
    log: list[str] = []
    job = Job(cfg, resume=str(first), log=log.append)
    try:
        # `latest` names the resume point; the later checkpoint is moved aside, whole.
        assert latest_checkpoint(ckpts) == first
        assert not (ckpts / "iter_000002").exists()
        check_checkpoint(ckpts / "abandoned" / "after_iter_000001" / "iter_000002")
        # Every role starts from the resume point, and the engines say so.
        draft = ray.get(job.draft.status.remote())
        assert draft["resumed_from"] == str(first) and draft["version"] == saved["draft"]
        assert ray.get(job.policies[0].status.remote())["version"] == saved["policy"]
        assert ray.get(job.rollouts[0].versions.remote()) == saved
        # The engine dies in iteration 2, before this timeline has a checkpoint of its own:
        # the restart goes back to the resume point, not to the abandoned iteration 2.
        _kill_before(job, 2, lambda j: j.rollouts[0], no_restart=True)
        assert [r["iteration"] for r in job.run()] == [2]
    finally:
        job.shutdown()
    assert any(line.endswith(f"restarting all roles from {first}") for line in log), log
    records = job_records(out)
    assert [r["iteration"] for r in records] == [1, 2]
    assert records[-1]["policy_steps"] == 0
    assert records[-1]["engine_policy_version"] == 1 and records[-1]["engine_draft_version"] == 2
    assert records[-1]["draft_trained_on_policy"] == 1 and records[-1]["draft_policy_lag"] == 0
    assert latest_checkpoint(ckpts) == ckpts / "iter_000002"
    assert read_state(ckpts / "iter_000002")["iteration"] == 2
    check_checkpoint(first)  # the resume point is never overwritten
