"""Checkpoint folders of the GRPO job: writing one atomically and durably (fsynced before
`latest` names it), finding the newest complete one, checking one is whole before any work
starts from it, making the one a resume starts from the newest (the only timeline), and
replacing a folder the job writes whole."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import zipfile
from pathlib import Path

from grpo_specdec.atomic_file import sync_dir
from grpo_specdec.checkpoint_pointer import LATEST, latest_checkpoint, point_latest_at
from grpo_specdec.fingerprint import fingerprint
from grpo_specdec.job.restarts import JobStopped
from grpo_specdec.learner_state import load_learner_state
from grpo_specdec.modelcheck import check_model_dir

ABANDONED = "abandoned"  # where a resume moves the checkpoints of the timeline it leaves
_ITERATION = re.compile(r"iter_(\d+)")


def check_same_data_file(saved: dict | None, now: dict | None, ckpt: Path) -> None:
    """Refuse a resume whose data file changed in place since checkpoint `ckpt` was written
    (the data cursor would point into other examples). A checkpoint that predates the
    fingerprint, or a run without a data file, is not compared."""
    if not saved or not now or saved["sha256"] == now["sha256"]:
        return
    raise ValueError(
        f"--resume {ckpt}: the data file {now['path']} changed since that checkpoint was "
        f"written ({saved['size']} bytes, sha256 {saved['sha256'][:12]}; now {now['size']} "
        f"bytes, {now['sha256'][:12]}): the data cursor would point into other examples; put "
        "the file back as it was, or start a new run"
    )


def staging_name(name: str) -> str:
    """Where this process writes checkpoint `name` before renaming it into place: its own
    name, so that no other process's cleanup removes it halfway."""
    return f".tmp_{name}.p{os.getpid()}"


class Checkpointer:
    """The job's checkpoints folder: where a run starts from, and each checkpoint it writes."""

    def __init__(self, root: Path, log=print, data_path: str | None = None):
        """`data_path`: the job's data file (or dataset folder), whose size and hash each
        checkpoint records and a resume compares."""
        self.root, self.log = root, log
        self.data_file = fingerprint(data_path) if data_path else None

    def start_point(self, resume: str | None, config: dict | None = None) -> Path | None:
        """The checkpoint a run starts from: with `resume` (a run folder or a checkpoint),
        that one, made the newest of this folder's timeline, once `config` is found to read
        the same data as the checkpoint's; without, none, and a folder that holds
        checkpoints already is refused. Staging folders a killed run left are removed
        first: the job holds the run folder's lock (`run_lock.py`), so no other writes here."""
        for stale in self.root.glob(".tmp_*"):
            shutil.rmtree(stale, ignore_errors=True)
        if resume:
            ckpt = resume_point(Path(resume))
            if config is not None:
                check_same_data(read_state(ckpt).get("config") or {}, config, ckpt)
            check_same_data_file(read_state(ckpt).get("data_file"), self.data_file, ckpt)
            return resume_timeline(self.root, ckpt, self.log)
        # A checkpoint renamed into place by a run killed before `latest` named it counts
        # too: a new run would stop at its first checkpoint, finding the name taken.
        if latest_checkpoint(self.root) is not None or any(self.root.glob("iter_*")):
            raise ValueError(
                f"{self.root} already holds checkpoints: pass --resume {self.root.parent} "
                "or choose another out"
            )
        return None

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def _check_room(self, final: Path) -> None:
        """Stop before writing a checkpoint the disk cannot hold, judged by the size of the
        newest one (the roles' files keep their size from one checkpoint to the next)."""
        latest = self.latest()
        if latest is None:
            return
        need = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file())
        free = shutil.disk_usage(self.root).free
        if free < need:
            raise JobStopped(
                f"no room for checkpoint {final.name} in {self.root}: the last one, {latest.name}, "
                f"takes {need / 2**20:.0f} MiB and {free / 2**20:.0f} MiB are free; free some "
                f"and --resume (from {latest.name}, which is whole)"
            )

    def write(self, iteration: int, cursor: int, config: dict, save_roles) -> Path:
        """Write everything needed to continue, atomically: a half-written checkpoint is
        never named by `latest`, so the previous one stays loadable. `save_roles(folder)`
        writes the roles' files into the folder."""
        final = self.root / f"iter_{iteration:06d}"
        # Resuming moved any later checkpoint aside: one found here is the one `latest`
        # names (or the resume point), which a restart or resume still needs.
        if final.exists():
            raise FileExistsError(f"checkpoint {final} exists already; refusing to overwrite it")
        self._check_room(final)
        tmp = self.root / staging_name(final.name)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            save_roles(tmp)
            check_roles_wrote(tmp, final)
            state = {
                "iteration": iteration,
                "cursor": cursor,
                "python_rng": random.getstate(),
                "config": config,
                "data_file": self.data_file,
            }
            (tmp / "state.json").write_text(json.dumps(state))
            # On disk before `latest` can name it: against a power loss, not only a crash
            # (renames are journalled before the data they name is written).
            sync_tree(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk is not left fuller
            raise
        os.replace(tmp, final)
        sync_dir(self.root)
        point_latest_at(self.root, final)
        return final

    @staticmethod
    def restore(ckpt: Path) -> tuple[int, int]:
        """(iteration, data cursor) of checkpoint `ckpt`; Python's RNG back to its state."""
        state = read_state(ckpt)
        random.setstate(_tuplify(state["python_rng"]))
        return state["iteration"], state["cursor"]


# The settings that say which example the data cursor points at: a resume that changes one
# would go on from the cursor into other data. (Learning rates, batch shape, iterations and
# the like may change at a resume; the cursor counts examples, not batches.)
DATA_IDENTITY = (
    ("data", "source"),
    ("data", "path"),
    ("data", "question_field"),
    ("data", "answer_field"),
    ("data", "levels"),
    ("data", "seed"),
    ("seed",),
)


def check_same_data(saved: dict, config: dict, ckpt: Path) -> None:
    """Refuse a resume whose config reads other data than the checkpoint's, naming each
    field that changed (a field the checkpoint's config predates is not compared)."""

    def at(cfg: dict, path: tuple):
        for part in path:
            if not isinstance(cfg, dict) or part not in cfg:
                return _ABSENT
            cfg = cfg[part]
        return cfg

    changed = [
        f"{'.'.join(path)}: {at(saved, path)!r} -> {at(config, path)!r}"
        for path in DATA_IDENTITY
        if at(saved, path) is not _ABSENT and at(saved, path) != at(config, path)
    ]
    if changed:
        raise ValueError(
            f"--resume {ckpt}: the config reads other data than the checkpoint's ("
            + "; ".join(changed)
            + "), so the data cursor would point at other examples; resume with the "
            "checkpoint's data settings, or start a new run (another out)"
        )


_ABSENT = object()


def _tuplify(x):
    """JSON turned the RNG state's tuples into lists; random.setstate wants tuples."""
    return tuple(_tuplify(i) for i in x) if isinstance(x, list) else x


def resume_point(path: Path) -> Path:
    """The checkpoint `--resume path` names: path itself, or the newest in a run folder
    (or in a checkpoints folder), checked whole."""
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


def sync_tree(path: Path) -> None:
    """fsync every file under `path`, then every folder, deepest first."""
    folders = []
    for folder, _, files in os.walk(path):
        folders.append(Path(folder))
        for name in files:
            fd = os.open(Path(folder) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for folder in reversed(folders):
        sync_dir(folder)


def resume_timeline(root: Path, ckpt: Path, log=print) -> Path:
    """Make checkpoint `ckpt` the newest under `root`, the job's checkpoints folder, before
    any role loads from it: every role, and every later restart, finds it through `latest`.

    A checkpoint of another run is copied in first, into a root without checkpoints (two
    runs' histories must not mix). `latest` is rewritten before anything else changes, so
    that a crash in between leaves a timeline that starts from `ckpt` as well. The
    checkpoints of later iterations, the timeline this resume leaves, move to
    root/abandoned/after_<ckpt>/: kept rather than deleted (the resume may have named the
    wrong one), and out of the way of the checkpoints the job writes next.
    A checkpoint of this run's abandoned/ is brought back: see `_restore_abandoned`.
    Returns `ckpt`'s folder in root."""
    root.mkdir(parents=True, exist_ok=True)
    if ckpt.resolve().parent.parent == (root / ABANDONED).resolve():
        ckpt = _restore_abandoned(root, ckpt, log)
    elif ckpt.resolve().parent != root.resolve():
        if _iterations(root):
            raise ValueError(
                f"--resume {ckpt}: that checkpoint is of another run, and {root} holds "
                "checkpoints of its own; resume from one of those, or choose another out"
            )
        copy = root / staging_name(ckpt.name)
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ckpt, copy)
        sync_tree(copy)  # on the disk before `latest` can name it
        os.replace(copy, root / ckpt.name)
        sync_dir(root)
        log(f"copied checkpoint {ckpt} to {root / ckpt.name}")
        ckpt = root / ckpt.name
    point_latest_at(root, ckpt)
    _move_later_aside(root, read_state(ckpt)["iteration"], ckpt.name, log)
    return ckpt


def _restore_abandoned(root: Path, ckpt: Path, log) -> Path:
    """`ckpt`, in root/abandoned/after_<branch>[.n]/, made part of root's timeline again:
    root's checkpoints after the branch point (the timeline resumed from there) move aside
    in turn, and `ckpt` with the older ones of its own timeline comes back. `latest` names
    the branch point while they move, so that a crash leaves a timeline that resumes."""
    branch = re.fullmatch(r"after_(iter_\d+)(\.\d+)?", ckpt.parent.name)
    if branch is None or not (root / branch[1] / "state.json").is_file():
        raise ValueError(
            f"--resume {ckpt}: its folder does not name a branch checkpoint of {root} "
            "(expected abandoned/after_iter_NNNNNN/)"
        )
    point_latest_at(root, root / branch[1])
    _move_later_aside(root, read_state(root / branch[1])["iteration"], branch[1], log)
    upto = read_state(ckpt)["iteration"]
    back = sorted(path for path, it in _iterations(ckpt.parent).items() if it <= upto)
    for path in back:
        os.replace(path, root / path.name)
    sync_dir(ckpt.parent)
    sync_dir(root)
    log(f"brought back from {ckpt.parent}: {', '.join(p.name for p in back)}")
    return root / ckpt.name


def _move_later_aside(root: Path, after: int, name: str, log) -> None:
    """root's checkpoints of iterations after `after` to root/abandoned/after_<name>[.n]/."""
    later = sorted(path for path, iteration in _iterations(root).items() if iteration > after)
    if not later:
        return
    aside, n = root / ABANDONED / f"after_{name}", 1
    while aside.exists():
        n += 1
        aside = root / ABANDONED / f"after_{name}.{n}"
    aside.mkdir(parents=True)
    for path in later:
        os.replace(path, aside / path.name)
    for folder in (aside, aside.parent, root):  # both ends of each rename, and the new folders
        sync_dir(folder)
    log(
        f"resuming from {name}: moved the later checkpoints {', '.join(p.name for p in later)} to {aside}"
    )


def _iterations(root: Path) -> dict[Path, int]:
    """Checkpoint folders in root -> the iteration in their name."""
    return {path: int(m[1]) for path in root.iterdir() if (m := _ITERATION.fullmatch(path.name))}


def replace_dir(new: Path, dst: Path) -> None:
    """Move folder `new` to `dst`, replacing any folder there whole (`shutil.move` would put
    it inside). Each step is a rename: `dst` is the old folder, then none, then the new
    one, never a mix. A crash in between leaves the old one at .<name>.old beside it, and
    the next call puts it back first (it is the folder, as long as `dst` is missing)."""
    old = dst.with_name(f".{dst.name}.old")
    if old.exists():
        if dst.exists():  # the crash came after the new one landed: the old one is spent
            shutil.rmtree(old)
        else:
            os.replace(old, dst)
    if not new.is_dir():
        raise FileNotFoundError(f"{new}: no folder to replace {dst} with")
    sync_tree(new)
    if dst.exists():
        os.replace(dst, old)
    os.replace(new, dst)
    sync_dir(dst.parent)
    shutil.rmtree(old, ignore_errors=True)


def read_state(path: Path) -> dict:
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {path}: state.json is unreadable ({err})") from None
    missing = {"iteration", "cursor", "python_rng"} - set(state)
    if missing:
        raise ValueError(f"checkpoint {path}: state.json lacks {sorted(missing)}")
    return state


# What the roles write into a checkpoint folder, whatever else they add.
ROLE_FILES = ("policy/config.json", "policy_state.pt")


def check_roles_wrote(folder: Path, final: Path) -> None:
    """The roles' files are in the folder the driver is about to name: on a cluster whose
    `out` is not one shared folder, the roles write on their own nodes and it stays empty."""
    missing = [name for name in ROLE_FILES if not (folder / name).is_file()]
    if missing:
        raise OSError(
            f"checkpoint {final}: the roles wrote no {', '.join(missing)} where the driver "
            f"reads them ({folder}); on a cluster, `out` must be a folder every node shares"
        )


def check_checkpoint(path: Path) -> None:
    """Every file a resume needs is present and uncorrupted (torch files are zip archives
    with per-member CRCs, and must hold data only; safetensors files must match their
    headers)."""
    read_state(path)
    check_model_dir(path / "policy", f"checkpoint {path} policy")
    if (path / "draft").is_dir():
        check_model_dir(path / "draft", f"checkpoint {path} draft")
    for name in ("policy_state.pt", "draft_state.pt"):
        f = path / name
        if name == "draft_state.pt" and not f.exists():
            continue
        try:
            with zipfile.ZipFile(f) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as err:
            raise ValueError(f"checkpoint {path}: {name} is missing or corrupt ({err})") from None
        if bad is not None:
            raise ValueError(f"checkpoint {path}: {name} is corrupt (member {bad} fails its CRC)")
        load_learner_state(f, mmap=True)  # mapped, not read: only the pickled structure is checked
