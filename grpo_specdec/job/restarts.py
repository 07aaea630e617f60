"""How many times the job restarts its roles before it stops. An actor that dies makes every
role restart from the newest checkpoint; a fault that recurs (a batch that crashes an engine
every time it is replayed, a node that keeps failing) would restart for ever, since the
iterations between the checkpoint and the fault succeed each time. So restarts are counted
per checkpoint and in total, and past either budget the job stops with one line naming the
fault, the checkpoint and the count."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


class JobStopped(RuntimeError):
    """The job gave up: the message says why and where it can resume from."""


class CallPastDeadline(RuntimeError):
    """A remote call that did not answer within `ray.call_timeout_s`: its actor is taken as
    hung. In an iteration the job restarts every role as for a dead one; as the roles start,
    it stops."""


class RestartBudget:
    def __init__(self, per_checkpoint: int, total: int):
        self.per_checkpoint, self.total = per_checkpoint, total
        self.from_checkpoint: Counter = Counter()
        self.restarts = 0

    def spend(self, ckpt: Path | None, fault: str) -> None:
        """Count one restart from `ckpt` (None: the initial models) for `fault`; raise
        JobStopped when it is over either budget."""
        where = str(ckpt) if ckpt is not None else "the initial models"
        self.from_checkpoint[where] += 1
        self.restarts += 1
        if self.from_checkpoint[where] > self.per_checkpoint:
            raise JobStopped(
                f"{fault}, after {self.per_checkpoint} restarts from {where} "
                f"(restarts.per_checkpoint): the fault recurs; stopping. Fix its cause and "
                "--resume (the checkpoint is whole)"
            )
        if self.restarts > self.total:
            raise JobStopped(
                f"{fault}, after {self.total} restarts in this run (restarts.total); stopping. "
                "Fix the cause and --resume from the newest checkpoint"
            )
