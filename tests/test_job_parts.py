"""The GRPO job's plain parts, without Ray or vLLM: the all-or-none weight sync, the
checkpointer, the metrics records, the prompt batches and the vLLM log routing."""

from __future__ import annotations

import importlib
import json
import logging
import random
import subprocess
import sys

import pytest
import torch
from ray.exceptions import RayTaskError

from grpo_specdec.draft_watch import Rollback
from grpo_specdec.job.batches import batch_at
from grpo_specdec.job.checkpoints import Checkpointer
from grpo_specdec.job.config import CompareSettings, RolloutSettings
from grpo_specdec.job.logs import VllmLog
from grpo_specdec.job.metrics import truncate_records
from grpo_specdec.job.weight_sync import WeightSync
from vllm_plugin.weights.manifest import MixedWeightsError

# ---- weight sync: fake engines whose remote calls finish at once ---------------------


class _Done:
    """A finished remote call: its value, or the error Ray would raise for it."""

    def __init__(self, value=None, error: Exception | None = None):
        self.value, self.error = value, error


def _get(refs):
    if isinstance(refs, list):
        return [_get(r) for r in refs]
    if refs.error is not None:
        raise RayTaskError("load_weights", "traceback", refs.error)
    return refs.value


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _Engine:
    """Serves one version per role; a load for which `fails(role, version)` is true fails
    with `error`."""

    def __init__(self, versions, fails=lambda role, version: False, error=None):
        self.serving, self.fails, self.error = dict(versions), fails, error
        self.load_weights = _Method(self._load)
        self.versions = _Method(lambda: _Done(dict(self.serving)))

    def _load(self, role, weights, version, metadata=None):
        if self.fails(role, version):
            return _Done(error=self.error or RuntimeError(f"injected {role} v{version} failure"))
        self.serving[role] = version
        return _Done({"total_s": 0.1 * version})


def _fails_once(role):
    calls = []

    def fails(r, version):
        calls.append(r)
        return r == role and calls.count(role) == 1

    return fails


def _sync(*engines):
    served = {"policy": ("w1", 1, None), "draft": ("d1", 1, {"m": 1})}
    return WeightSync(list(engines), served, log=lambda _: None, get=_get)


def test_a_load_reaches_every_engine_and_is_what_a_later_failure_restores():
    a, b = _Engine({"policy": 1}), _Engine({"policy": 1})
    sync = _sync(a, b)
    assert sync.load("policy", "w2", 2) == {"total_s": pytest.approx(0.2)}
    assert a.serving == b.serving == {"policy": 2}
    assert sync.served["policy"] == ("w2", 2, None)
    b.fails = _fails_once("policy")
    with pytest.raises(RuntimeError, match="policy weight sync \\(version 3\\) failed: injected"):
        sync.policy("w3", 3, iteration=7, checkpoints="runs/x/checkpoints")
    # The engine that had loaded version 3 serves version 2 again: both agree.
    assert a.serving == b.serving == {"policy": 2}
    assert sync.versions() == {"policy": 2}


def test_a_failed_draft_load_keeps_the_previous_draft_everywhere():
    a, b = _Engine({"draft": 1}), _Engine({"draft": 1}, fails=_fails_once("draft"))
    loaded, why = _sync(a, b).draft("d2", 2, {"m": 2}, iteration=3)
    assert loaded == {} and "injected draft v2 failure" in why
    assert a.serving == b.serving == {"draft": 1}


def test_an_engine_that_may_hold_mixed_weights_is_the_error_raised():
    mixed = MixedWeightsError("draft weights may be a mix")
    a = _Engine({"draft": 1}, fails=lambda role, version: True)
    b = _Engine({"draft": 1}, fails=lambda role, version: True, error=mixed)
    with pytest.raises(RayTaskError) as err:
        _sync(a, b).draft("d2", 2, {}, iteration=3)
    assert err.value.cause is mixed


def test_a_failed_restore_is_raised_from_the_load_failure():
    restore_fails = _Engine({"draft": 1}, fails=lambda role, version: version == 1)
    load_fails = _Engine({"draft": 1}, fails=lambda role, version: version == 2)
    with pytest.raises(RayTaskError) as err:
        _sync(restore_fails, load_fails).load("draft", "d2", 2)
    assert "injected draft v1 failure" in str(err.value.cause)
    assert "injected draft v2 failure" in str(err.value.__cause__.cause)


def test_engines_serving_different_versions_are_refused():
    sync = _sync(_Engine({"policy": 1}), _Engine({"policy": 2}))
    with pytest.raises(RuntimeError, match="the engines serve different weight versions"):
        sync.versions()


# ---- checkpointer --------------------------------------------------------------------


def _roles_writing(content: str):
    """A stand-in for the roles' save: the files every checkpoint holds."""

    def save_roles(folder):
        (folder / "policy").mkdir()
        (folder / "policy" / "weights").write_text(content)
        (folder / "policy" / "config.json").write_text("{}")
        (folder / "policy_state.pt").write_bytes(b"")

    return save_roles


def _write(checkpointer, iteration, cursor=0):
    return checkpointer.write(iteration, cursor, {"iterations": 9}, _roles_writing(str(iteration)))


def test_checkpoints_are_written_whole_named_latest_and_never_overwritten(tmp_path):
    ckpts = Checkpointer(tmp_path / "checkpoints", log=lambda _: None)
    assert ckpts.start_point(None) is None and ckpts.latest() is None
    random.seed(5)
    first = _write(ckpts, 1, cursor=4)
    expected_draw = random.random()
    assert ckpts.latest() == first
    assert (first / "policy" / "weights").read_text() == "1"
    assert not list(ckpts.root.glob(".tmp_*"))
    with pytest.raises(FileExistsError, match="refusing to overwrite it"):
        _write(ckpts, 1)
    # A half-written checkpoint (its roles failed to save) is never named by `latest`.
    with pytest.raises(OSError):
        ckpts.write(2, 0, {}, lambda folder: (_ for _ in ()).throw(OSError("disk full")))
    assert ckpts.latest() == first
    # Nor one the roles wrote nothing into (on a cluster, an `out` the nodes do not share).
    with pytest.raises(OSError, match=r"the roles wrote no policy/config.json, policy_state.pt"):
        ckpts.write(2, 0, {}, lambda folder: None)
    assert ckpts.latest() == first
    # Restoring gives the place in the data, and Python's RNG as it was when written.
    random.seed(99)
    assert ckpts.restore(first) == (1, 4)
    assert random.random() == expected_draw
    # A run folder with checkpoints is not started over by accident, even one whose newest
    # checkpoint was renamed into place by a run killed before `latest` named it.
    with pytest.raises(ValueError, match=f"pass --resume {tmp_path} or choose another out"):
        Checkpointer(tmp_path / "checkpoints").start_point(None)
    (ckpts.root / "latest").unlink()
    with pytest.raises(ValueError, match=f"pass --resume {tmp_path} or choose another out"):
        Checkpointer(tmp_path / "checkpoints").start_point(None)


def test_latest_names_a_checkpoint_of_its_own_folder_only(tmp_path):
    ckpts = Checkpointer(tmp_path / "checkpoints", log=lambda _: None)
    _write(ckpts, 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "state.json").write_text("{}")
    for name in (str(elsewhere), "../elsewhere"):
        (ckpts.root / "latest").write_text(name)
        with pytest.raises(ValueError, match="not a checkpoint of this folder"):
            ckpts.latest()


def test_a_resume_point_is_checked_whole_before_anything_moves(tmp_path):
    ckpts = Checkpointer(tmp_path / "checkpoints", log=lambda _: None)
    first, second = _write(ckpts, 1), _write(ckpts, 2)
    with pytest.raises(ValueError, match=rf"checkpoint {first} policy: .* holds no \*.safetensors"):
        ckpts.start_point(str(first))
    assert ckpts.latest() == second and second.is_dir()  # the timeline left as it was
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        ckpts.start_point(str(tmp_path / "nowhere"))


def test_a_resume_that_reads_other_data_is_refused_before_anything_moves(tmp_path, monkeypatch):
    """The data cursor counts examples of the checkpoint's data: a resume whose config reads
    other data (here data.seed and data.levels changed) is refused with each field named, and
    the timeline stays as it was; other settings (the learning rate) may change."""
    from grpo_specdec.job import checkpoints

    monkeypatch.setattr(checkpoints, "check_checkpoint", lambda path: None)
    ckpts = Checkpointer(tmp_path / "checkpoints", log=lambda _: None)
    saved = {"data": {"source": "arithmetic", "levels": [1, 2], "seed": 0}, "seed": 0}

    first = ckpts.write(1, 8, {**saved, "policy": {"lr": 1e-6}}, _roles_writing("1"))
    second = ckpts.write(2, 16, {**saved, "policy": {"lr": 1e-6}}, _roles_writing("2"))
    other = {"data": {"source": "arithmetic", "levels": [1], "seed": 1}, "seed": 0}
    with pytest.raises(
        ValueError, match=r"data.levels: \[1, 2\] -> \[1\]; data.seed: 0 -> 1\), so the data cursor"
    ):
        ckpts.start_point(str(first), {**other, "policy": {"lr": 1e-6}})
    assert ckpts.latest() == second and second.is_dir()
    assert ckpts.start_point(str(first), {**saved, "policy": {"lr": 1e-7}}) == first


# ---- metrics, batches ------------------------------------------------------------------


def test_truncate_records_keeps_each_iteration_up_to_the_restart_point(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2, 3)) + "\n")
    truncate_records(path, 2)
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2]
    truncate_records(tmp_path / "absent.jsonl", 0)  # a first start has none
    # The abandoned iteration's record is kept beside, not lost.
    aside = tmp_path / "metrics.after_iteration_2.jsonl"
    assert [json.loads(line)["iteration"] for line in aside.read_text().splitlines()] == [3]


def test_a_record_torn_by_a_kill_mid_append_does_not_block_a_resume(tmp_path):
    """SIGKILL while appending leaves a last line with no newline: it is dropped; a bad
    line anywhere else is an error naming the file and line."""
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2))
    path.write_text(whole + '{"iteration": 3, "rew')
    truncate_records(path, 2)
    assert path.read_text() == whole
    path.write_text('{"iteration": 1}\n{"iter\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2: not a JSON record"):
        truncate_records(path, 2)
    assert path.read_text().startswith('{"iteration": 1}')  # left as it was


class _Source:
    def get(self, i):
        return type("Example", (), {"question": f"q{i}", "answer": i})()


def test_batches_follow_the_cursor_and_seed_each_prompts_samples_apart():
    rollout = RolloutSettings(prompts_per_iteration=3, group_size=4, seeded=True)
    batch = batch_at(_Source(), 6, rollout, job_seed=1)
    assert batch.prompts == ["q6", "q7", "q8"]
    assert batch.sampling["n"] == 4
    assert batch.seeds == [(1 << 32) + 24, (1 << 32) + 28, (1 << 32) + 32]
    assert batch_at(_Source(), 6, RolloutSettings(), 1).seeds is None


def test_length_budgets_give_each_sample_its_own_cap_the_same_at_the_same_cursor():
    rollout = RolloutSettings(
        prompts_per_iteration=3, group_size=8, max_tokens=512, length_budget={"median": 128}
    )
    batch = batch_at(_Source(), 6, rollout, job_seed=1)
    assert [len(b) for b in batch.budgets] == [8, 8, 8]
    flat = [b for group in batch.budgets for b in group]
    assert all(16 <= b <= 512 for b in flat) and len(set(flat)) > 12
    assert batch_at(_Source(), 6, rollout, job_seed=1).budgets == batch.budgets
    assert batch_at(_Source(), 9, rollout, job_seed=1).budgets != batch.budgets
    assert batch_at(_Source(), 6, RolloutSettings(), 1).budgets is None
    with pytest.raises(ValueError, match=r"rollout.length_budget.median \(600\) exceeds"):
        RolloutSettings(max_tokens=512, length_budget={"median": 600})


# ---- vLLM's log -----------------------------------------------------------------------


def test_vllm_records_go_to_the_file_and_only_errors_to_the_console(tmp_path, capfd):
    vllm_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    before = logging.getLogger("vllm").handlers[:]
    log = VllmLog(tmp_path, "INFO")
    try:
        vllm_logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        vllm_logger.info("Loading weights took 0.01 seconds")
        vllm_logger.error("the engine died")
    finally:
        log.close()
    console = capfd.readouterr().err
    assert "Failed to load weights" not in console and "Loading weights took" not in console
    assert "the engine died" in console
    text = log.path.read_text()
    assert "RotaryEmbedding: Failed to load weights" in text and "Loading weights took" in text
    assert log.counts() == {"WARNING": 1, "INFO": 1, "ERROR": 1}
    assert log.summary() == f"vLLM: 1 warnings, 1 errors in {log.path}"
    assert logging.getLogger("vllm").handlers == before  # this process's own, back
    # vLLM's processes build the same handlers from the config file they are pointed at.
    config = json.loads((tmp_path / "vllm_logging.json").read_text())
    assert log.worker_env["VLLM_LOGGING_CONFIG_PATH"] == str(tmp_path / "vllm_logging.json")
    assert config["loggers"]["vllm"]["handlers"] == ["file", "console"]
    for spec in config["handlers"].values():
        module, name = spec.pop("()").rsplit(".", 1)
        handler = getattr(importlib.import_module(module), name)(**spec)
        record = logging.LogRecord(
            "vllm.config", logging.WARNING, __file__, 1, "Enforce eager set", None, None
        )
        if record.levelno >= handler.level:  # as the vllm logger calls its handlers
            handler.handle(record)
        handler.close()
    assert log.path.read_text().count("Enforce eager set") == 1
    assert "Enforce eager set" not in capfd.readouterr().err


def test_iteration_record_carries_sync_times_and_the_draft_lag():
    from grpo_specdec.draft.learner import DraftRound
    from grpo_specdec.job.learners import PolicyRound
    from grpo_specdec.job.metrics import IterationRounds, RolloutRound, iteration_record
    from grpo_specdec.job.roles import Published
    from grpo_specdec.job.rollout_worker import Rollout

    spec = {"acceptance_rate": 0.5, "mean_acceptance_length": 2.0, "per_position_acceptance": []}
    rollout = Rollout([[1]], [[[2, 3], [4]]], [["a", "b"]], spec, 0.5, {0: 1, 2: 3})
    rollout.draft_rollbacks = [Rollback(3, 2, 0.01, 0.6, 300)]
    scores = torch.tensor([[1.0, 0.0]])
    rounds = IterationRounds(
        rolled=RolloutRound([None], rollout, [rollout], scores, scores),
        informative=torch.tensor([True]),
        policy=PolicyRound(sequences=2, entropy=1.5, version=5, steps=1, means={"loss": 0.25}),
        draft=DraftRound(1, 0, 2, False, 0.4, 3, {"loss": 1.5}),
        published=Published({"policy": {"total_s": 0.2}}, draft_trained_on_policy=4),
        seconds={"generation": 1.0, "policy_update": 2.0, "draft_wait": 0.5, "sync": 0.25},
        versions={"policy": 5, "draft": 3},
    )
    record = iteration_record(4, rounds)
    assert record["iteration_s"] == 3.75 and record["draft_train_s"] == 0.4
    assert record["tokens_per_s"] == 6.0 and record["response_length"] == 1.5
    assert record["k_steps"] == {"0": 1, "2": 3} and "engines" not in record
    assert record["draft_policy_lag"] == 1
    assert record["policy_sync_s"] == 0.2 and record["draft_sync_s"] == 0.0
    assert "draft_seconds" not in record
    assert record["policy_loss"] == 0.25 and record["policy_steps"] == 1
    assert record["draft_loss"] == 1.5 and record["draft_version"] == 3
    assert "draft_swap_error" not in record
    assert record["draft_rollbacks"] == [rollout.draft_rollbacks[0].describe()]  # the watch's


def test_rollouts_made_one_after_another_add_their_times_and_keep_the_last_history():
    from grpo_specdec.engine import SpecCounters
    from grpo_specdec.job.rollout_worker import Rollout

    def rollout(prompt: int, wall_s: float, finished_s: list[float], history: int) -> Rollout:
        spec = SpecCounters().metrics() | {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 3}
        sources = {"model_draft_tokens": 6, "group_history_positions": history}
        return Rollout(
            [[prompt]], [[[7, 8], [9]]], [["a", "b"]], spec, wall_s, {2: 2}, sources, finished_s
        )

    first, second = rollout(1, 2.0, [1.0, 2.0], 10), rollout(2, 3.0, [0.5, 3.0], 25)
    chained = Rollout.chain([first, second])
    assert chained.prompt_ids == [[1], [2]] and chained.wall_s == 5.0
    assert chained.finished_s == [1.0, 2.0, 2.5, 5.0]
    assert chained.k_steps == {2: 4} and chained.spec["draft_tokens"] == 12
    # counts add; the group drafter's history is what it holds after the last rollout
    assert chained.sources == {"model_draft_tokens": 12, "group_history_positions": 25}
    side_by_side = Rollout.gather([first, second])
    assert side_by_side.wall_s == 3.0 and side_by_side.sources["group_history_positions"] == 35
    second.draft_rollbacks = [Rollback(3, 2, 0.01, 0.6, 300)]
    assert Rollout.chain([first, second]).draft_rollbacks == second.draft_rollbacks


def test_an_engine_the_driver_starts_logs_to_the_file_too(tmp_path):
    """vLLM reconfigures its logging from the environment when an engine starts in this
    process (the job's latency profile): the routing must survive that."""
    code = (
        "from argparse import Namespace\n"
        "from pathlib import Path\n"
        "from grpo_specdec.job.logs import VllmLog\n"
        f"log = VllmLog(Path({str(tmp_path)!r}))\n"
        "from vllm.logger import configure_logging_from_args, init_logger\n"
        "configure_logging_from_args(Namespace())  # what building an engine's args does\n"
        "init_logger('vllm.probe').warning('probe warning')\n"
        "log.close()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "probe warning" not in proc.stdout + proc.stderr
    assert "probe warning" in (tmp_path / "vllm.log").read_text()


def test_the_tail_comparison_rolls_each_sample_out_alone_within_its_own_budget():
    from grpo_specdec.bench.compare import requests_of
    from grpo_specdec.tasks.datasets import ArithmeticSource

    rollout = RolloutSettings(prompts_per_iteration=3, group_size=4, max_tokens=200)
    batch = batch_at(ArithmeticSource(0, [1, 2]), 6, rollout, job_seed=0)
    same = requests_of(batch, CompareSettings(), 0)
    assert same == (batch.prompts, batch.sampling, {"seeds": batch.seeds})

    tail = CompareSettings(shape="tail", cap=120, budget_median=40)
    prompts, sampling, per_request = requests_of(batch, tail, 0)
    assert prompts == [q for q in batch.prompts for _ in range(4)]
    assert sampling == {**batch.sampling, "n": 1, "max_tokens": 120}
    budgets = per_request["max_tokens"]
    assert len(budgets) == len(per_request["seeds"]) == 12 == len(set(per_request["seeds"]))
    assert all(16 <= b <= 120 for b in budgets) and len(set(budgets)) > 6
    assert requests_of(batch, tail, 0) == (prompts, sampling, per_request)  # seeded
    assert requests_of(batch, tail, 1)[2] != per_request
    # Without a cap of its own, the rollout's max_tokens caps it, the median a quarter of it.
    _, sampling, per_request = requests_of(batch, CompareSettings(shape="tail"), 0)
    assert sampling["max_tokens"] == 200 and max(per_request["max_tokens"]) <= 200


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            {"compare": {"budget_median": 300}, "rollout": {"max_tokens": 200}},
            "compare.budget_median",
        ),
        ({"compare": {"cap": 600}, "rollout": {"max_model_len": 512}}, "compare.cap"),
        ({"compare": {"fixed_k": [5]}, "rollout": {"k": 4}}, "compare.fixed_k"),
        ({"compare": {"fixed_k": [1]}, "rollout": {"speculation": "off"}}, "compare.fixed_k"),
        ({"compare": {"natural_repeats": 5}}, "compare.natural_repeats"),
    ],
)
def test_a_comparison_the_job_cannot_run_is_refused_by_name(overrides, field):
    from pydantic import ValidationError

    from grpo_specdec.job.config import TrainConfig

    config = {"model": {"policy": "tiny"}, **overrides}
    with pytest.raises(ValidationError, match=field):
        TrainConfig.model_validate({**config, "compare_at_end": True})
    # Settings of a comparison the job does not run stand (configs/smollm2_arith.yaml has
    # compare.fixed_k: a run of it with rollout.speculation=off must start).
    assert TrainConfig.model_validate(config).compare == CompareSettings(**overrides["compare"])


def test_the_job_profiles_batch_sizes_up_to_what_its_engine_holds():
    from grpo_specdec.job.engine_setup import profiled_batch_sizes

    assert profiled_batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert profiled_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert profiled_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_each_engine_and_each_start_gets_its_own_sampling_seed():
    """A resume at another version or a restart from the same checkpoint starts the engines
    on new streams (the job's restart path: tests/reliability/test_job_faults.py)."""
    from grpo_specdec.job.engine_setup import engine_seed

    seeds = {
        (e, v, n): engine_seed(0, e, v, n) for e in range(4) for v in (0, 3, 7) for n in (0, 1)
    }
    assert len(set(seeds.values())) == len(seeds)
    assert engine_seed(0, 1, 3, 0) == engine_seed(0, 1, 3, 0) != engine_seed(1, 1, 3, 0)
    assert all(0 <= s < 1 << 31 for s in seeds.values())


def test_a_fault_that_recurs_from_one_checkpoint_stops_the_job_and_a_new_checkpoint_resets():
    from pathlib import Path

    from grpo_specdec.job.restarts import JobStopped, RestartBudget

    budget = RestartBudget(per_checkpoint=2, total=4)
    first, second = Path("run/checkpoints/iter_000002"), Path("run/checkpoints/iter_000004")
    budget.spend(first, "iteration 3: an actor died")
    budget.spend(first, "iteration 3: an actor died")
    budget.spend(second, "iteration 5: an actor died")  # a good stretch in between: counted anew
    with pytest.raises(JobStopped, match=r"^iteration 3: .*after 2 restarts from run/check"):
        budget.spend(first, "iteration 3: an actor died")
    budget = RestartBudget(per_checkpoint=5, total=2)
    budget.spend(None, "a")
    budget.spend(first, "b")
    with pytest.raises(JobStopped, match=r"^c, after 2 restarts in this run \(restarts.total\)"):
        budget.spend(second, "c")


def test_a_resume_with_bad_data_moves_no_checkpoint(tiny_target, tiny_draft, tmp_path, monkeypatch):
    """The data files are read before a resume makes its checkpoint the timeline."""
    from grpo_specdec.config import load_yaml
    from grpo_specdec.job import checkpoints
    from grpo_specdec.job.config import TrainConfig
    from grpo_specdec.job.run import Job
    from tests.conftest import TINY_JOB_CONFIG

    monkeypatch.setattr(checkpoints, "check_checkpoint", lambda path: None)
    out = tmp_path / "run"
    overrides = [f"model.policy={tiny_target}", f"model.draft={tiny_draft}", f"out={out}"]
    cfg = load_yaml(TrainConfig, TINY_JOB_CONFIG, overrides)
    ckpts = Checkpointer(out / "checkpoints", log=lambda _: None)
    first = ckpts.write(1, 4, cfg.model_dump(), _roles_writing("1"))
    second = ckpts.write(2, 8, cfg.model_dump(), _roles_writing("2"))
    missing = tmp_path / "gone.jsonl"
    bad = load_yaml(TrainConfig, TINY_JOB_CONFIG, [*overrides, f"data.eval_path={missing}"])
    with pytest.raises(FileNotFoundError, match="gone.jsonl does not exist"):
        Job(bad, resume=str(first))
    assert ckpts.latest() == second and second.is_dir()


def test_a_draft_for_another_model_is_refused_by_its_config_name(tiny_target, tiny_draft, tmp_path):
    """Checked by the driver before Ray starts (the learner and the engines each failed on
    it inside their actors, a Ray traceback)."""
    import shutil

    from grpo_specdec.config import load_yaml
    from grpo_specdec.job.config import TrainConfig
    from grpo_specdec.job.run import Job
    from tests.conftest import TINY_JOB_CONFIG

    bad = tmp_path / "wide_draft"
    shutil.copytree(tiny_draft, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 256}))
    out = tmp_path / "run"
    overrides = [f"model.policy={tiny_target}", f"model.draft={bad}", f"out={out}"]
    with pytest.raises(ValueError, match=r"^model.draft: draft: .* was built for hidden_size=256"):
        Job(load_yaml(TrainConfig, TINY_JOB_CONFIG, overrides))
    assert not out.exists()


def test_a_frozen_run_s_checkpoint_starts_an_online_learner_from_its_head(
    tiny_target, tiny_draft, tmp_path
):
    """A run with `draft.online: false` checkpoints the head it served and no learner state;
    resumed with the draft online, the learner starts from that head (it failed in its
    actor reading draft_state.pt)."""
    import shutil

    from safetensors.torch import load_file

    from grpo_specdec.draft.trainer import DraftTrainConfig
    from grpo_specdec.job.learners import JobDraftLearner

    def frozen_roles(folder):
        _roles_writing("1")(folder)
        shutil.copytree(tiny_draft, folder / "draft")

    ckpts = Checkpointer(tmp_path / "checkpoints", log=lambda _: None)
    ckpt = ckpts.write(1, 4, {}, frozen_roles)
    learner = JobDraftLearner(
        tiny_target, str(ckpt / "draft"), DraftTrainConfig(), "cpu", 0, str(ckpts.root), "eagle"
    )
    assert learner.resumed_from is None and learner.version == 0
    served = load_file(str(ckpt / "draft" / "model.safetensors"))
    for name, tensor in learner.head.export_state_dict().items():
        assert torch.equal(tensor, served[name].to(tensor.dtype)), name


def test_the_comparison_s_engine_that_never_starts_is_given_up_by_name():
    """Outside the job's placement groups Ray waits for room for the extra engine as long
    as it takes (the job hung after its last iteration): it gets `start_timeout_s`."""
    from grpo_specdec.bench.compare import started
    from grpo_specdec.job.config import RaySettings

    killed, waited = [], []

    class Pending:
        class __ray_ready__:  # noqa: N801 (Ray's name)
            @staticmethod
            def remote():
                return "ready"

    def never(refs, timeout):
        waited.append(timeout)
        return [], refs

    with pytest.raises(RuntimeError, match=r"did not start within 5 s \(compare.start_timeout_s\)"):
        started(Pending(), 5.0, RaySettings(rollout_gpus=1), wait=never, kill=killed.append)
    assert waited == [5.0] and len(killed) == 1


def test_tensorboard_shows_each_iteration_once_after_a_restart_and_a_resume(tmp_path):
    """Iterations run again after a restart (from checkpoint 1) or a resume (from 2) were
    logged to TensorBoard a second time: 1, 2, 3, 2, 3, 3 steps before."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_specdec.job.metrics import MetricsSink

    def record(iteration: int, reward: float) -> dict:
        return {
            "iteration": iteration,
            "reward_mean": reward,
            "mean_acceptance_length": 1.0,
            "tokens_per_s": 1.0,
            "per_position_acceptance": [],
            "k_steps": {},
        }

    with MetricsSink(tmp_path, 0, 3) as sink:
        for i in (1, 2, 3):
            sink.write(record(i, 0.0))
        sink.rewind(1)
        for i in (2, 3):
            sink.write(record(i, 1.0))
    with MetricsSink(tmp_path, 2, 3) as sink:
        sink.write(record(3, 2.0))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (1, 0.0),
        (2, 1.0),
        (3, 2.0),
    ]


def test_a_resumed_job_publishes_in_its_engines_start_folder_s_dtype_and_serves_the_base_s(
    tmp_path, monkeypatch
):
    """A resumed job's engine starts from a checkpoint, stored in float32, and checks every
    update against it: the learners published in the base's bfloat16, and the engine refused
    each ("dtype torch.bfloat16, expected torch.float32", resuming the shipped recipe at its
    iteration 15). It serves the base's dtype on `engine_dtype: auto`, as a fresh job does."""
    from safetensors.torch import save_file

    from grpo_specdec.job.config import TrainConfig
    from grpo_specdec.job.engine_setup import engine_config, serving_dtype, stored_dtype
    from vllm_plugin import settings

    monkeypatch.setattr(settings, "cpu_has_bf16", lambda: True)  # as where it was found
    base, checkpoint = tmp_path / "base", tmp_path / "iter_000015"
    for folder, dtype in ((base, torch.bfloat16), (checkpoint, torch.float32)):
        folder.mkdir()
        save_file({"w": torch.zeros(2, dtype=dtype)}, folder / "model.safetensors")
    assert (stored_dtype(str(base)), stored_dtype(str(checkpoint))) == ("bfloat16", "float32")
    cfg = TrainConfig.model_validate({"model": {"policy": str(base)}})
    dtype = serving_dtype(cfg, str(base))
    assert engine_config(cfg, str(checkpoint), None, None, dtype)["dtype"] == "bfloat16"
    cfg.model.engine_dtype = "float32"
    assert serving_dtype(cfg, str(base)) == "float32"


def test_on_a_cpu_without_bf16_the_job_serves_and_profiles_a_bf16_base_in_float32(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    """On an AMD EPYC without bfloat16 instructions `make demo` profiled SmolLM2 (stored in
    bfloat16) on `engine_dtype: auto` in float32, as `engine_dtype` resolves auto there, while
    the job served the stored bfloat16 (emulated, many times slower) and its engine refused the
    profile 22 minutes in ("dtype: profiled float32, this engine bfloat16"). Both now take
    the dtype from `serving_dtype`."""
    import shutil

    from safetensors.torch import load_file, save_file

    from grpo_specdec.job import engine_setup
    from grpo_specdec.job.config import TrainConfig
    from vllm_plugin import settings

    base = tmp_path / "base"
    shutil.copytree(tiny_target, base)
    for f in base.glob("*.safetensors"):
        save_file({n: t.to(torch.bfloat16) for n, t in load_file(f).items()}, f)
    cfg = TrainConfig.model_validate(
        {"model": {"policy": str(base)}, "rollout": {"speculation": "concurrency_aware"}}
    )
    asked = []
    monkeypatch.setattr(settings, "profile_store", lambda: tmp_path / "profiles")
    monkeypatch.setattr(
        "grpo_specdec.profile.run_profile", lambda c, path, log: asked.append(c.dtype)
    )
    monkeypatch.setattr(engine_setup, "read_profile", lambda path: {})
    for has_bf16, served in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(settings, "cpu_has_bf16", lambda has_bf16=has_bf16: has_bf16)
        assert engine_setup.serving_dtype(cfg, str(base)) == served
        path = engine_setup.latency_profile(cfg, str(base), tiny_draft, print)
        assert asked[-1] == served
        key = settings.profile_key(str(base), served, tiny_draft, cfg.rollout.draft_sampling)
        assert path == str(settings.store_path(key))
    # The job itself measures none (Roles: measure=False): it starts without one.
    said = []
    monkeypatch.setattr(settings, "profile_store", lambda: tmp_path / "empty")
    assert engine_setup.latency_profile(cfg, str(base), tiny_draft, said.append, False) is None
    assert len(asked) == 2 and "learns what drafting costs" in said[0]


def test_a_float32_engine_starts_from_a_float32_copy_of_a_bfloat16_base(tiny_target, tmp_path):
    """The engines check updates against their start folder's dtypes: from a bfloat16 folder a
    float32 engine was sent the learners' weights rounded to bfloat16. A fresh run whose
    engines serve float32 from a bfloat16 base starts them from a float32 copy, written once;
    where the dtypes agree it starts them from the base itself."""
    import shutil

    from safetensors.torch import load_file, save_file

    from grpo_specdec.job.engine_setup import engine_start_folder, stored_dtype

    base = tmp_path / "base"
    shutil.copytree(tiny_target, base)
    for f in base.glob("*.safetensors"):
        save_file({n: t.to(torch.bfloat16) for n, t in load_file(f).items()}, f)
    run = tmp_path / "run"
    run.mkdir()
    assert engine_start_folder(str(base), "bfloat16", run) == str(base)
    folder = run / "engine_policy"
    assert engine_start_folder(str(base), "float32", run) == str(folder)
    assert folder.parent == run and stored_dtype(str(folder)) == "float32"
    assert sorted(f.name for f in folder.iterdir()) == sorted(f.name for f in base.iterdir())
    for f in base.glob("*.safetensors"):
        narrow, wide = load_file(f), load_file(folder / f.name)
        assert narrow.keys() == wide.keys()
        assert all(torch.equal(narrow[n].float(), wide[n]) for n in narrow)
    written = (folder / "config.json").stat().st_mtime_ns
    assert engine_start_folder(str(base), "float32", run) == str(folder)
    assert (folder / "config.json").stat().st_mtime_ns == written
    assert engine_start_folder(str(folder), "float32", run) == str(folder)  # stored float32
