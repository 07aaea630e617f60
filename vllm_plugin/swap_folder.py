"""The folder through which weight files travel from a trainer to its engine, private to
the user that runs both.

The trainer writes a safetensors file there and names it in the swap call; the engine
opens only files inside it. So a caller of the swap route cannot make the server load,
or probe for, any other file the server can read. The folder is named per user, made
with mode 0700, and checked (a real directory, owned by this user, mode 0700) on every
use: one that another local user made first could have a weight file replaced between
its writing and its loading, so it is refused, never repaired.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from pathlib import Path

from vllm_plugin.manifest import WeightSwapError

SHARED_MEMORY = Path("/dev/shm")


def swap_folder() -> Path:
    base = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    folder = base / f"grpo-specdec-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a symlink or a file)"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    elif stat.S_IMODE(info.st_mode) != 0o700:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}, not 0700"
    else:
        return folder
    raise WeightSwapError(
        f"the weight swap folder {folder} {problem}: only a folder private to this user "
        "keeps weight files from being replaced by others; remove it and swap again"
    )


def open_swap_file(path: str) -> int:
    """A read-only descriptor of the weight file at `path`, which must name a file directly
    inside the swap folder, not a link. The file may be unlinked once it is open: the
    descriptor keeps it readable for as long as it is held. The path is checked as named,
    never resolved, so a refusal tells the caller nothing about files outside the folder."""
    folder = swap_folder()
    refusal = WeightSwapError(
        f"refused weight file {path}: weights are loaded only from files written to the "
        f"swap folder {folder} by this server's user (no links)"
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
