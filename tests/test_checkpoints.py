"""Checkpoint folders without a job: the timeline a resume makes, durability (fsync before
`latest` names a checkpoint), and recovering from a crash between renames."""

from __future__ import annotations

import json
import os

import pytest

from grpo_specdec.checkpoint_pointer import latest_checkpoint, point_latest_at
from grpo_specdec.job.checkpoints import (
    Checkpointer,
    replace_dir,
    resume_timeline,
    staging_name,
)

QUIET = {"log": lambda _: None}


def _fake_checkpoint(root, iteration: int):
    path = root / f"iter_{iteration:06d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(
        json.dumps({"iteration": iteration, "cursor": 0, "python_rng": 0})
    )
    return path


def test_resume_timeline_moves_later_checkpoints_aside_and_copies_in_another_runs(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _, second, third = (_fake_checkpoint(root, i) for i in (1, 2, 3))
    point_latest_at(root, third)
    assert resume_timeline(root, second, log=lambda _: None) == second
    assert latest_checkpoint(root) == second
    assert (root / "abandoned" / "after_iter_000002" / "iter_000003" / "state.json").is_file()
    # The same resume point again, after the new timeline got as far: kept apart.
    _fake_checkpoint(root, 3)
    resume_timeline(root, second, log=lambda _: None)
    assert (root / "abandoned" / "after_iter_000002.2" / "iter_000003").is_dir()
    assert sorted(p.name for p in root.iterdir()) == [
        "abandoned",
        "iter_000001",
        "iter_000002",
        "latest",
    ]

    # Another run's checkpoint is copied in, and only into a run without checkpoints.
    other = tmp_path / "other" / "checkpoints"
    with pytest.raises(ValueError, match="of another run, and .* holds checkpoints of its own"):
        resume_timeline(root, _fake_checkpoint(other, 1), log=lambda _: None)
    fresh = tmp_path / "fresh" / "checkpoints"
    assert (
        resume_timeline(fresh, other / "iter_000001", log=lambda _: None) == fresh / "iter_000001"
    )
    assert latest_checkpoint(fresh) == fresh / "iter_000001"
    assert (other / "iter_000001" / "state.json").is_file()  # the original stays


def test_an_abandoned_checkpoint_resumed_by_path_becomes_the_timeline(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for i in (1, 2, 3, 4):
        _fake_checkpoint(root, i)
    (root / "iter_000004" / "mark").write_text("first timeline")
    resume_timeline(root, root / "iter_000002", **QUIET)  # 3 and 4 move aside
    for i in (3, 4, 5):  # the second timeline, with names the first one also had
        _fake_checkpoint(root, i)
    point_latest_at(root, root / "iter_000005")

    abandoned = root / "abandoned" / "after_iter_000002" / "iter_000004"
    ckpt = resume_timeline(root, abandoned, **QUIET)

    assert ckpt == root / "iter_000004" and latest_checkpoint(root) == ckpt
    assert (ckpt / "mark").read_text() == "first timeline"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == [
        "iter_000001",
        "iter_000002",
        "iter_000003",
        "iter_000004",
    ]
    # the timeline it leaves is kept, apart from the first abandoned one
    left = root / "abandoned" / "after_iter_000002.2"
    assert sorted(p.name for p in left.iterdir()) == ["iter_000003", "iter_000004", "iter_000005"]
    assert not any((root / "abandoned" / "after_iter_000002").iterdir())


def test_an_abandoned_checkpoint_outside_a_branch_folder_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 1)
    stray = _fake_checkpoint(root / "abandoned" / "by_hand", 2)
    with pytest.raises(ValueError, match="expected abandoned/after_iter_NNNNNN"):
        resume_timeline(root, stray, **QUIET)


def test_a_checkpoint_is_on_disk_before_latest_names_it(tmp_path, monkeypatch):
    """Every file and folder of the checkpoint is fsynced before the rename that makes
    `latest` name it (without, a power loss can leave `latest` naming empty files)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        os,
        "fsync",
        lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd)),
    )
    monkeypatch.setattr(
        os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))
    )
    root = tmp_path / "checkpoints"
    root.mkdir()

    def save_roles(folder):
        (folder / "policy").mkdir()
        (folder / "policy" / "model.safetensors").write_bytes(b"weights")
        (folder / "policy" / "config.json").write_text("{}")
        (folder / "policy_state.pt").write_bytes(b"state")

    final = Checkpointer(root).write(3, 7, {}, save_roles)
    latest_at = events.index(("replace", str(root / "latest")))
    synced = {path for what, path in events[:latest_at] if what == "fsync"}
    tmp = root / staging_name("iter_000003")
    for path in ("", "policy", "policy/model.safetensors", "policy_state.pt", "state.json"):
        assert str(tmp / path).rstrip("/") in synced, path
    assert str(root) in synced  # the rename of the folder itself
    assert ("fsync", str(root)) in events[latest_at:]  # and then that of `latest`
    assert latest_checkpoint(root) == final


def test_replace_dir_puts_back_the_old_folder_a_crash_left_aside(tmp_path):
    dst, new = tmp_path / "head", tmp_path / "staging"
    dst.mkdir()
    (dst / "weights").write_text("old")
    # a crash between the two renames: the old folder aside, none at dst
    os.replace(dst, tmp_path / ".head.old")
    with pytest.raises(FileNotFoundError):
        replace_dir(new, dst)  # this call fails too: the old folder must survive it
    assert (dst / "weights").read_text() == "old"
    new.mkdir()
    (new / "weights").write_text("new")
    replace_dir(new, dst)
    assert (dst / "weights").read_text() == "new" and not (tmp_path / ".head.old").exists()
    # the crash after the new one landed: the old one is spent, and goes
    (tmp_path / ".head.old").mkdir()
    newer = tmp_path / "staging2"
    newer.mkdir()
    replace_dir(newer, dst)
    assert not (tmp_path / ".head.old").exists() and not (dst / "weights").exists()


def test_a_resume_s_copies_and_moves_reach_the_disk(tmp_path, monkeypatch):
    """A checkpoint of another run copied in is fsynced before `latest` names it, and the
    folders the later checkpoints move between are fsynced (without, a power loss can
    leave `latest` naming empty files, or lose the moved checkpoints)."""
    other, root = tmp_path / "other" / "checkpoints", tmp_path / "run" / "checkpoints"
    other.mkdir(parents=True)
    for it in (1, 2):
        Checkpointer(other, log=lambda _: None).write(it, it, {}, _save_roles)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))
    )
    ckpt = resume_timeline(root, other / "iter_000001", log=lambda _: None)
    assert str(root / staging_name("iter_000001") / "policy" / "model.safetensors") in synced
    assert str(root) in synced and ckpt == root / "iter_000001"

    Checkpointer(root, log=lambda _: None).write(2, 2, {}, _save_roles)
    synced.clear()
    resume_timeline(root, root / "iter_000001", log=lambda _: None)
    aside = root / "abandoned" / "after_iter_000001"
    assert (aside / "iter_000002").is_dir()
    assert {str(aside), str(aside.parent), str(root)} <= set(synced)


def _save_roles(folder):
    (folder / "policy").mkdir()
    (folder / "policy" / "model.safetensors").write_bytes(b"weights")
    (folder / "policy" / "config.json").write_text("{}")
    (folder / "policy_state.pt").write_bytes(b"state")


def test_a_checkpoint_the_disk_cannot_hold_stops_the_job_before_it_is_written(
    tmp_path, monkeypatch
):
    import shutil
    from collections import namedtuple

    from grpo_specdec.job import checkpoints
    from grpo_specdec.job.restarts import JobStopped

    root = tmp_path / "checkpoints"
    ckpts = Checkpointer(root, **QUIET)
    first = ckpts.write(1, 4, {}, _save_roles)
    usage, real = namedtuple("usage", "total used free"), shutil.disk_usage
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda _: usage(100, 90, 10))
    with pytest.raises(JobStopped, match=r"no room for checkpoint iter_000002 in .*: the last one"):
        ckpts.write(2, 8, {}, _save_roles)
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", real)

    def disk_full(folder):
        _save_roles(folder)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        ckpts.write(2, 8, {}, disk_full)
    assert not list(root.glob(".tmp_*"))  # the half-written one does not fill the disk more
    assert latest_checkpoint(root) == first


def test_a_resume_refuses_a_data_file_edited_in_place(tmp_path):
    from grpo_specdec.job.checkpoints import check_same_data_file, read_state

    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    root = tmp_path / "run" / "checkpoints"
    ckpt = Checkpointer(root, data_path=str(data), **QUIET).write(1, 1, {}, _save_roles)
    saved = read_state(ckpt)["data_file"]
    assert saved["size"] == data.stat().st_size
    check_same_data_file(saved, Checkpointer(root, data_path=str(data), **QUIET).data_file, ckpt)
    data.write_text('{"question": "2+2", "answer": "4"}\n')
    now = Checkpointer(root, data_path=str(data), **QUIET).data_file
    with pytest.raises(ValueError, match=rf"the data file {data} changed since that checkpoint"):
        check_same_data_file(saved, now, ckpt)
