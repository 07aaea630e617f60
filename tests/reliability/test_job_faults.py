"""Faults during a GRPO job: dead actors, failed swaps, a diverging draft. The job must
recover or stop clearly, losing nothing (a SIGKILL in the middle of a checkpoint write:
tests/test_grpo_job.py::test_sigkill_mid_checkpoint_then_resume).
The scaled-out job (two engines, two policy ranks) takes the faults one member at a time:
the others must follow it, and every engine must serve the same weight versions."""

from __future__ import annotations

import pytest
import ray
import torch

from grpo_specdec.config import load_yaml
from grpo_specdec.job.config import TrainConfig
from grpo_specdec.job.restarts import JobStopped, RestartBudget
from tests.conftest import TINY_JOB_CONFIG as CONFIG
from tests.conftest import job_overrides, job_records
from vllm_plugin.weights.manifest import MixedWeightsError
from vllm_plugin.weights.swap_folder import process_alive, swap_folder, writer_pid

pytestmark = pytest.mark.slow


def _poison_head(learner):
    with torch.no_grad():
        learner.head.fc.weight[0, 0] = float("nan")


def _break_next_swap(role):
    def install(worker):
        engine = worker.engine
        original = engine.swap_weights

        def failing(r, *args, **kwargs):
            if r == role:
                engine.swap_weights = original
                raise RuntimeError(f"injected {role} swap failure")
            return original(r, *args, **kwargs)

        engine.swap_weights = failing

    return install


def _kill_rollout_before(job, iteration):
    """The second engine dies as `iteration` starts."""
    step = job.step

    def kill_then_step():
        if job.iteration + 1 == iteration:
            job.step = step
            ray.kill(job.rollouts[1], no_restart=True)
        return step()

    job.step = kill_then_step


def _kill_rollout_every_time(job, iteration):
    """The second engine dies each time `iteration` starts, replays included."""
    step = job.step

    def kill_then_step():
        if job.iteration + 1 == iteration:
            ray.kill(job.rollouts[1], no_restart=True)
        return step()

    job.step = kill_then_step


def _engine_seeds(job) -> list[int]:
    """The sampling seed each live engine started with (None for a dead one)."""
    seeds = []
    for engine in job.rollouts:
        try:
            seeds.append(ray.get(engine.__ray_call__.remote(lambda w: w.engine.cfg.seed)))
        except ray.exceptions.RayActorError:
            seeds.append(None)
    return seeds


def _kill_inside(job, method: str, victim) -> None:
    """`victim(job)` dies as the job's `method` (checkpoint, evaluate) next begins."""
    original = getattr(job, method)

    def kill_then_call():
        setattr(job, method, original)
        ray.kill(victim(job), no_restart=True)
        return original()

    setattr(job, method, kill_then_call)


def _break_draft_loads(worker):
    """Runs in the rollout actor: every draft load in its engine fails from now on."""

    def failing_load(vllm_worker):
        def load_weights(weights):
            raise RuntimeError("injected draft load failure")

        vllm_worker.get_draft_model().load_weights = load_weights

    worker.engine.llm.collective_rpc(failing_load)


def _served(job) -> list[dict]:
    return ray.get([engine.versions.remote() for engine in job.rollouts])


def _greedy(worker, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    """Runs in the rollout actor: each prompt's greedy completion and its log-probs, which
    any change of the policy weights the engine serves moves."""
    from vllm import SamplingParams

    outs = worker.engine.llm.generate(
        [{"prompt_token_ids": worker.engine.encode(p)} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, logprobs=0),
        use_tqdm=False,
    )
    return [
        (list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)])
        for o in (out.outputs[0] for out in outs)
    ]


def _draft_fc(worker) -> list[float]:
    """Runs in the rollout actor: the served draft's fc layer applied to a fixed input (on
    CPU the engine repacks linear weights, so they cannot be read back as tensors)."""

    def apply_fc(vllm_worker):
        fc = vllm_worker.get_draft_model().model.fc
        out = fc(torch.linspace(-1, 1, fc.input_size).reshape(1, -1))
        return (out[0] if isinstance(out, tuple) else out).flatten().tolist()

    return worker.engine.llm.collective_rpc(apply_fc)[0]


def _engine_outputs(job, probe, *args) -> list:
    return ray.get([engine.__ray_call__.remote(probe, *args) for engine in job.rollouts])


def _assert_same_greedy(now, before) -> None:
    """Token ids equal; log-probs equal up to the float noise of different step batches."""
    for engine_now, engine_before in zip(now, before, strict=True):
        for (ids, logp), (ids_0, logp_0) in zip(engine_now, engine_before, strict=True):
            assert ids == ids_0
            assert logp == pytest.approx(logp_0, abs=1e-5)


def test_job_recovers_from_faults_and_loses_nothing(
    tiny_target, tiny_draft, job_profile, tmp_path, questions
):
    from grpo_specdec.job.run import Job

    out = tmp_path / "run"
    cfg = load_yaml(
        TrainConfig,
        CONFIG,
        [
            *job_overrides(tiny_target, tiny_draft, job_profile, out, 1),
            "ray.rollout_workers=2",
            "ray.policy_workers=2",
        ],
    )
    log: list[str] = []
    before = set(swap_folder().rglob("*.safetensors"))
    job = Job(cfg, log=log.append)
    try:
        job.run()  # iteration 1, checkpoint 1

        # One engine of two dies in iteration 3, after an iteration without a checkpoint:
        # every role restarts from checkpoint 1 and iterations 2 and 3 run again; each is
        # returned (and recorded) once.
        job.cfg.checkpoint_every, job.cfg.iterations = 10, 3
        _kill_rollout_before(job, 3)
        assert [r["iteration"] for r in job.run()] == [2, 3]
        assert any("an actor died" in line and "iter_000001" in line for line in log)

        # One policy rank of two dies: the same, from checkpoint 3 (a run's last iteration
        # checkpoints); the surviving rank, waiting in a collective, is not waited for.
        ray.kill(job.policies[1], no_restart=True)
        job.cfg.iterations = 4
        job.run()
        assert any("an actor died" in line and "iter_000003" in line for line in log)
        learner = ray.get(job.policies[0].status.remote())
        assert _served(job) == [_served(job)[0]] * 2
        assert _served(job)[0]["policy"] == learner["version"] and learner["world"] == 2

        # A policy rank dies inside a checkpoint (the ranks gather the weights together), and
        # an engine inside an evaluation: each time every role restarts from the newest
        # checkpoint, and every iteration is recorded once.
        _kill_inside(job, "checkpoint", lambda j: j.policies[1])
        job.cfg.checkpoint_every, job.cfg.iterations = 1, 5
        job.run()
        assert any("iteration 5: an actor died" in line and "iter_000004" in line for line in log)
        _kill_inside(job, "evaluate", lambda j: j.rollouts[1])
        job.cfg.eval.every, job.cfg.iterations = 1, 6
        job.run()
        job.cfg.eval.every = 0
        assert any("iteration 6: an actor died" in line and "iter_000005" in line for line in log)
        assert [r["iteration"] for r in job_records(out)] == [1, 2, 3, 4, 5, 6]
        assert "eval_accuracy" in job_records(out)[-1]

        # The draft learner diverges: its update is rolled back, the engines keep their draft.
        served = _served(job)[0]["draft"]
        ray.get(job.draft.__ray_call__.remote(_poison_head))
        job.cfg.iterations = 7
        job.run()
        rec = job_records(out)[-1]
        assert rec["draft_rolled_back"] and rec["draft_steps"] == 0
        assert [v["draft"] for v in _served(job)] == [served, served]

        # A draft swap that fails inside one engine: reported, and the other engine, which
        # had loaded it, gets the previous draft back: both serve that version, and its
        # weights (the fc layer computes what it did before).
        draft_before = _engine_outputs(job, _draft_fc)
        ray.get(job.rollouts[1].__ray_call__.remote(_break_next_swap("draft")))
        job.cfg.iterations = 8
        job.run()
        rec = job_records(out)[-1]
        assert "injected draft swap failure" in rec["draft_swap_error"]
        assert [v["draft"] for v in _served(job)] == [served, served]
        assert _engine_outputs(job, _draft_fc) == draft_before

        # A failed policy sync in one engine stops the job with a clear error; neither
        # engine is left on the new version.
        policy_before = _served(job)[0]["policy"]
        greedy_before = _engine_outputs(job, _greedy, questions[:4])
        ray.get(job.rollouts[1].__ray_call__.remote(_break_next_swap("policy")))
        job.cfg.iterations = 11
        with pytest.raises(
            RuntimeError, match="policy weight sync .* failed: .*injected policy swap failure"
        ):
            job.run()
        assert [v["policy"] for v in _served(job)] == [policy_before] * 2
        # The engine that had loaded the new policy serves the previous one again.
        _assert_same_greedy(_engine_outputs(job, _greedy, questions[:4]), greedy_before)

        # A draft swap whose restore fails too stops the job naming both failures; the
        # engine, whose draft may be a mix, refuses to generate.
        ray.get(job.rollouts[1].__ray_call__.remote(_break_draft_loads))
        with pytest.raises(
            MixedWeightsError,
            match=r"loading draft version \d+ failed \(RuntimeError: injected draft load failure\), "
            r"and restoring version \d+ failed too \(RuntimeError: injected draft load failure\)",
        ):
            job.run()
        with pytest.raises(MixedWeightsError, match="refusing to generate: the draft weights"):
            job.run()

        # A fault that recurs at one iteration (an engine dies each time it is replayed):
        # one restart from the newest checkpoint (restarts.per_checkpoint=1), on engines
        # sampling from new streams, then the job stops with one line.
        job._restart("the test starts every role afresh")
        seeds_before = _engine_seeds(job)
        job.restart_budget = RestartBudget(per_checkpoint=1, total=10)
        job.cfg.iterations = job.iteration + 1
        _kill_rollout_every_time(job, job.iteration + 1)
        with pytest.raises(
            JobStopped,
            match=rf"^iteration {job.iteration + 1}: an actor died \(.*\), after 1 restarts "
            r"from .*iter_\d+ \(restarts.per_checkpoint\): the fault recurs; stopping",
        ):
            job.run()
        assert _engine_seeds(job)[0] != seeds_before[0]  # the restart drew new streams
    finally:
        job.shutdown()
    iterations = [r["iteration"] for r in job_records(out)]
    assert iterations == sorted(set(iterations)) == list(range(1, len(iterations) + 1))
    # Every weight file the job's trainers wrote is gone, killed writers' included (a live
    # writer's may be another test's swap in flight).
    left = [
        p.name
        for p in set(swap_folder().rglob("*.safetensors")) - before
        if (pid := writer_pid(p)) is None or not process_alive(pid)
    ]
    assert not left, f"weight files left in the swap folder: {left}"


def _never_starting(role: type) -> type:
    """`role` whose start never ends (a model load or a compile that hangs)."""

    class NeverStarts(role):
        def __init__(self, *args, **kwargs):
            import time

            time.sleep(3600)

    return NeverStarts


def test_a_role_that_never_starts_stops_the_job_at_the_deadline(
    tiny_target, tiny_draft, job_profile, tmp_path, monkeypatch
):
    """The roles' start waits under `ray.call_timeout_s` too: a job whose policy learner
    never starts stops with one line (it waited for ever before). The learner is the one
    that hangs so that the first deadline to pass is this one however slowly the other
    roles start on a loaded machine (an engine that hangs is waited for in the same way,
    after the learners)."""
    from grpo_specdec.job import actors
    from grpo_specdec.job.restarts import CallPastDeadline
    from grpo_specdec.job.run import Job

    monkeypatch.setitem(actors.ROLES, "policy", _never_starting(actors.ROLES["policy"]))
    overrides = [*job_overrides(tiny_target, tiny_draft, job_profile, tmp_path / "run", 1)]
    cfg = load_yaml(TrainConfig, CONFIG, [*overrides, "eval.every=0", "ray.call_timeout_s=20"])
    with pytest.raises(CallPastDeadline, match=r"^a learner's start did not answer within 20 s"):
        Job(cfg)


def _hang_generation(worker):
    import time

    worker.engine.generate = lambda *args, **kwargs: time.sleep(3600)


def test_a_hung_engine_is_taken_as_dead_after_the_deadline(
    tiny_target, tiny_draft, job_profile, tmp_path
):
    """An engine that stops answering (a wedged collective, a driver hang) would hold the
    job for ever: past `ray.call_timeout_s` its call is given up, every role restarts from
    the newest checkpoint, and the job finishes."""
    from grpo_specdec.job.run import Job

    out = tmp_path / "run"
    overrides = [*job_overrides(tiny_target, tiny_draft, job_profile, out, 1), "eval.every=0"]
    # The deadline covers the roles' starts too (Ray workers importing torch, loading the
    # models), which on a 2-core CI machine busy with another test took over 30 s.
    cfg = load_yaml(TrainConfig, CONFIG, [*overrides, "ray.call_timeout_s=90"])
    log: list[str] = []
    job = Job(cfg, log=log.append)
    try:
        job.run()  # iteration 1, checkpoint 1
        ray.get(job.rollouts[0].__ray_call__.remote(_hang_generation))
        job.cfg.iterations = 2
        assert [r["iteration"] for r in job.run()] == [2]
    finally:
        job.shutdown()
    said = [line for line in log if "iteration 2: a rollout did not answer within 90 s" in line]
    assert len(said) == 1 and "restarting all roles from" in said[0] and "iter_000001" in said[0]
    assert [r["iteration"] for r in job_records(out)] == [1, 2]


def _scramble_head(learner):
    from tests.conftest import scrambled

    learner.head.load_export_state_dict(scrambled(learner.head.export_state_dict()))


@pytest.mark.parametrize("engines", [1, 2])
def test_a_collapsed_head_is_rolled_back_in_the_engine_and_the_learner(
    tiny_target, tiny_draft, job_profile, tmp_path, engines
):
    """The draft learner's head is scrambled (weights lost, as a broken sync or sleep/wake
    leaves them): the head it publishes collapses in the next rollout, the engine's watch
    (with several engines, the driver's, over their pooled drafts) goes back to the head
    before in every engine, and the learner goes back with it, so the head after is sound
    again, not a descendant of the collapse."""
    from grpo_specdec.job.run import Job

    out = tmp_path / "run"
    overrides = [
        *job_overrides(tiny_target, tiny_draft, job_profile, out, 2),
        "eval.every=0",
        "rollout.prompts_per_iteration=8",
        "rollout.group_size=8",
        "rollout.controller.policy=fixed",  # every step drafts: the watch judges each head
        f"ray.rollout_workers={engines}",
    ]
    log: list[str] = []
    job = Job(load_yaml(TrainConfig, CONFIG, overrides), log=log.append)
    try:
        job.run()  # heads 1 and 2, each trained on a rollout; 1 judged sound in rollout 2
        ray.get(job.draft.__ray_call__.remote(_scramble_head))
        job.cfg.iterations = 4
        job.run()  # head 3, scrambled, collapses in rollout 4
        job.cfg.iterations = 5
        job.run()
    finally:
        job.shutdown()
    records = {r["iteration"]: r for r in job_records(out)}
    assert not records[3]["draft_rollbacks"]
    (rollback,) = records[4]["draft_rollbacks"]
    assert "draft head version 3 had" in rollback and "back on version 2" in rollback
    assert not records[5]["draft_rollbacks"]
    sound = records[3]["acceptance_rate"]  # head 2's
    # Head 4, learnt on from head 2 (measured: 0.92x head 2's; learnt on from the
    # scrambled head 3, as before the learner went back, 0.64x)
    assert records[5]["acceptance_rate"] > 0.8 * sound
    assert any(
        "iteration 4: draft head version 3" in line and "learns on from version 2" in line
        for line in log
    )
