"""One job per run folder. Two jobs on one `out` (or a `--resume` while the first still
runs) would write each other's checkpoints and metrics: `latest` could name weights of the
other job. The job holds an exclusive lock on `out/.job.lock` for its whole life; the lock
is the kernel's (`flock`), so a job that dies for any reason, SIGKILL included, releases
it. The file names its holder, which a refused job reports. (flock is not reliable on every
network file system; keep `out` on a local one, or one that implements it.)"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".job.lock"


class RunFolderLock:
    def __init__(self, out: Path):
        self.path = out / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"out={out} is in use by another job ({holder}): two jobs on one folder would "
                "overwrite each other's checkpoints and metrics; wait for it to end, or choose "
                "another out"
            ) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.ctime()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None
