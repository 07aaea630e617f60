"""The `latest` pointer of a run's checkpoints folder, the one file that says which
checkpoint is the newest complete one: the job writes it (`job/checkpoints.py`), and
whatever reads a run folder (`evaluate.py`, a resume, the benchmarks) follows it.
Below the job, so that readers need none of it."""

from __future__ import annotations

import re
from pathlib import Path

from grpo_specdec.atomic_file import write_atomic

LATEST = "latest"  # file naming the newest complete checkpoint, replaced atomically


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under root, or None if there is none yet."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not re.fullmatch(r"iter_\d+", name):
        raise ValueError(
            f"{pointer} names {name!r}, not a checkpoint of this folder (iter_N): refusing to "
            "follow it elsewhere"
        )
    path = root / name
    if not (path / "state.json").is_file():
        raise FileNotFoundError(
            f"checkpoint {path} named by {pointer} is incomplete (no state.json)"
        )
    return path


def point_latest_at(root: Path, ckpt: Path) -> None:
    """Name `ckpt` (a folder in root) as the newest checkpoint, atomically and durably."""
    write_atomic(root / LATEST, ckpt.name)
