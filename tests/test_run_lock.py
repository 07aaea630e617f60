"""One job per run folder (`grpo_specdec/job/run_lock.py`), the folder made private whatever
the umask, and checkpoints staged under names of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from grpo_specdec.job.run_lock import LOCK_NAME, RunFolderLock

HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from grpo_specdec.job.run_lock import RunFolderLock
    lock = RunFolderLock(Path(sys.argv[1]))
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_a_second_holder_is_refused_naming_the_first_until_it_releases(tmp_path):
    first = RunFolderLock(tmp_path)
    with pytest.raises(ValueError, match=rf'in use by another job \({{"pid": {os.getpid()},'):
        RunFolderLock(tmp_path)
    first.release()
    RunFolderLock(tmp_path).release()


def test_a_job_killed_outright_leaves_the_folder_free(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf'"pid": {holder.pid},'):
            RunFolderLock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    RunFolderLock(tmp_path).release()
    assert (tmp_path / LOCK_NAME).stat().st_mode & 0o077 == 0


class RayWouldStart(Exception):
    pass


def _job(tiny_target, tiny_draft, out, monkeypatch):
    """A Job up to the moment Ray would start (everything it checks before is real)."""
    from grpo_specdec.config import load_yaml
    from grpo_specdec.job import run
    from grpo_specdec.job.config import TrainConfig
    from tests.conftest import TINY_JOB_CONFIG

    def no_ray(*_):
        raise RayWouldStart

    monkeypatch.setattr(run, "start_ray", no_ray)
    overrides = [f"model.policy={tiny_target}", f"model.draft={tiny_draft}", f"out={out}"]
    return run.Job(load_yaml(TrainConfig, TINY_JOB_CONFIG, overrides), log=lambda _: None)


def test_a_job_on_a_folder_another_job_holds_is_refused_before_anything_starts(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    out.mkdir(mode=0o700)
    other = RunFolderLock(out)
    try:
        with pytest.raises(ValueError, match=r"out=.*run is in use by another job"):
            _job(tiny_target, tiny_draft, out, monkeypatch)
    finally:
        other.release()
    with pytest.raises(RayWouldStart):  # free again: it gets as far as Ray
        _job(tiny_target, tiny_draft, out, monkeypatch)
    RunFolderLock(out).release()  # the failed start let go of it


def test_the_run_folder_is_private_under_a_group_writable_umask(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    previous = os.umask(0o002)
    try:
        with pytest.raises(RayWouldStart):
            _job(tiny_target, tiny_draft, tmp_path / "a" / "run", monkeypatch)
    finally:
        os.umask(previous)
    assert (tmp_path / "a" / "run").stat().st_mode & 0o777 == 0o700


def test_a_run_folder_inside_a_folder_anyone_can_write_is_refused(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"its parent .*shared has mode 0777: anyone can replace"):
        _job(tiny_target, tiny_draft, shared / "run", monkeypatch)
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot rename what is not theirs
    with pytest.raises(RayWouldStart):
        _job(tiny_target, tiny_draft, shared / "run2", monkeypatch)


def test_stale_staging_folders_are_swept_when_a_job_starts(tmp_path):
    from grpo_specdec.job.checkpoints import Checkpointer, staging_name

    root = tmp_path / "checkpoints"
    stale = root / ".tmp_iter_000004.p1"
    stale.mkdir(parents=True)
    assert staging_name("iter_000004") == f".tmp_iter_000004.p{os.getpid()}"
    Checkpointer(root, log=lambda _: None).start_point(None)
    assert not stale.exists()
