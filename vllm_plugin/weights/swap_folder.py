"""The folders through which weight files travel from a trainer to its engine, private to
the user that runs both, one per engine.

The trainer asks the engine for its folder (`grpo_swap_folder`, every trainer's client
has the call), checks it (a private `engine-*` folder inside its user's), writes a
safetensors file there and names it in the swap call; the engine opens only files directly
inside its own folder (made and checked at its first swap, removed at its end unless a live
trainer's file is in it), owned by its user. So a caller of one server's swap route cannot
make it load, or probe for, any other file the server can read, another server's weight
files included: each engine's folder (`engine-<vLLM's instance id>`) lies inside the
user's swap folder, which is named per user in shared memory, made with mode 0700, and
checked (a real directory, owned by this user, mode 0700) on every use. Its name can be
guessed, so another local user may have made it first, to replace a weight file between
its writing and its loading or only to block every swap: such a folder is never used nor
repaired; the swaps go through a private folder in this user's cache instead (on disk,
which other users cannot write to), and the log names the squatted folder and its owner.
Trainer and engine, the same user on one machine, pick the same folder either way.
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from vllm_plugin.settings import cache_dir
from vllm_plugin.weights.manifest import WeightSwapError

logger = logging.getLogger(__name__)

SHARED_MEMORY = Path("/dev/shm")
_said: set[Path] = set()  # squatted folders already named in the log


def swap_folder() -> Path:
    base = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    folder = base / f"grpo-specdec-{os.getuid()}"
    problem = _not_private(folder)
    if problem is None:
        return folder
    fallback = cache_dir() / f"swap-{os.getuid()}"
    fallback.parent.mkdir(parents=True, exist_ok=True)
    also = _not_private(fallback)
    if also is not None:
        raise WeightSwapError(
            f"the weight swap folder {folder} {problem}, and {fallback} {also}: only a folder "
            "private to this user keeps weight files from being replaced by others; remove "
            "them and swap again"
        )
    if folder not in _said:
        _said.add(folder)
        logger.warning(
            "the weight swap folder %s %s: weights travel through %s instead (on disk, "
            "slower than shared memory); remove %s to swap through shared memory again",
            folder,
            problem,
            fallback,
            folder,
        )
    return fallback


def engine_swap_folder(instance_id: str) -> Path:
    """The swap folder of the engine with vLLM's `instance_id` (each rank of one engine
    holds the same), made private if missing, inside the user's `swap_folder()`."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", instance_id) or "engine"
    folder = swap_folder() / f"engine-{name}"
    problem = _not_private(folder)
    if problem is not None:
        raise WeightSwapError(f"the engine's weight swap folder {folder} {problem}")
    return folder


def remove_engine_folder(folder: Path) -> None:
    """At its engine's end, its swap `folder` goes, with the files of writers that died in
    it, unless a live trainer's file is there (that trainer removes its file): each engine
    has an id of its own, so no later engine would use or remove the folder, and it would
    stay in shared memory until the machine restarts."""
    sweep_orphans(folder)
    try:
        folder.rmdir()
    except OSError as err:
        # ENOENT: another rank of the engine removed it first.
        if err.errno not in (errno.ENOTEMPTY, errno.ENOENT):
            logger.warning("the engine's swap folder %s stays: %s", folder, err)


def trainer_swap_folder(named: str, base: Path) -> Path:
    """The folder an engine named as its own (`grpo_swap_folder`), checked on the trainer's
    side: a private folder directly inside this user's swap folder `base`."""
    folder = Path(os.path.abspath(named))
    if folder.parent == base and folder.name.startswith("engine-"):
        problem = _not_private(folder)
    else:
        problem = f"is not inside this user's swap folder {base}"
    if problem is not None:
        raise WeightSwapError(
            f"the engine named {named} as its weight swap folder, which {problem}: the "
            "trainer and the engine must run as one user on one machine"
        )
    return folder


def agreed_folder(per_rank: list[str]) -> str:
    """The one swap folder every rank of an engine named."""
    if len(set(per_rank)) != 1:
        raise WeightSwapError(f"the engine's ranks name different swap folders: {per_rank}")
    return per_rank[0]


def _not_private(folder: Path) -> str | None:
    """What makes `folder` (made if missing) no folder private to this user; None if it is."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory (a symlink or a file)"
    if info.st_uid != os.getuid():
        return (
            f"is owned by {_user(info.st_uid)} (uid {info.st_uid}), not by this user "
            f"(uid {os.getuid()})"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        return f"has mode {stat.S_IMODE(info.st_mode):04o}, not 0700"
    return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "an unknown user"


def open_swap_file(path: str, folder: Path) -> int:
    """A read-only descriptor of the weight file at `path`, which must name a file directly
    inside the engine's swap `folder`, not a link. The file may be unlinked once it is
    open: the descriptor keeps it readable for as long as it is held. The path is checked
    as named, never resolved, so a refusal tells the caller nothing about files outside the
    folder."""
    refusal = WeightSwapError(
        f"refused weight file {path}: weights are loaded only from files written to this "
        f"engine's swap folder {folder} by this server's user (no links)"
    )
    named = Path(os.path.abspath(path))
    if named.parent != folder:
        raise refusal
    try:
        fd = os.open(named, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise WeightSwapError(
            f"weight file {path} does not exist (its writer may have given up and removed it)"
        ) from None
    except OSError as err:
        if err.errno == errno.ELOOP:  # a symlink, which O_NOFOLLOW does not follow
            raise refusal from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise WeightSwapError(
            f"refused weight file {path}: not a regular file owned by this user (uid {os.getuid()})"
        )
    return fd


# Weight files are named <role>-v<version>-p<writer pid>-<8 hex>.safetensors.
_WRITER = re.compile(r"-p(\d+)-[0-9a-f]{8}\.safetensors$")


def writer_pid(path: str | Path) -> int | None:
    """The pid of the process that wrote the weight file at `path`, from its name."""
    match = _WRITER.search(Path(path).name)
    return int(match.group(1)) if match else None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


@contextmanager
def swap_file(
    role: str,
    weights: dict[str, torch.Tensor],
    version: int,
    metadata: dict | None,
    engine_folder: str,
) -> Iterator[Path]:
    """`weights` as a file for the engine whose swap folder is `engine_folder` (as it named
    it), `metadata` in its header; removed when the block ends, however it ends. That is
    safe even while the engine may still be loading it (a timed-out call): the engine opens
    the file before reading it and keeps it open while it may reload it, and one that has
    not opened it yet finds no file and refuses the swap, keeping its old weights."""
    from safetensors.torch import save_file

    base = swap_folder()
    folder = trainer_swap_folder(engine_folder, base)
    for each in (base, *base.glob("engine-*")):  # engines gone too, and files of old installs
        sweep_orphans(each)
    path = folder / f"{role}-v{version}-p{os.getpid()}-{uuid.uuid4().hex[:8]}.safetensors"
    tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    try:
        try:
            save_file(tensors, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            free = shutil.disk_usage(folder).free
            raise WeightSwapError(
                f"no room for the {role} weights ({need / 2**20:.0f} MiB) in the swap folder "
                f"{folder} ({free / 2**20:.0f} MiB free): it lives in shared memory, which "
                "containers often cap at 64 MiB; give the container more (docker run "
                "--shm-size=16g, a Kubernetes emptyDir with medium Memory on /dev/shm)"
            ) from None
        yield path
    finally:
        path.unlink(missing_ok=True)


def sweep_orphans(folder: Path) -> list[Path]:
    """Remove the weight files whose writer process is gone: a trainer killed (SIGKILL, the
    OOM killer) between writing a file and removing it never removes it, and the folder
    lives in RAM. A file an engine still has open stays readable through its descriptor."""
    removed = []
    for path in folder.glob("*.safetensors"):
        pid = writer_pid(path)
        if pid is not None and not process_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
