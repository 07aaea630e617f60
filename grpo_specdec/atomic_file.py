"""A file replaced whole or not at all: a reader (a resume, a restart, an engine loading a
profile) never meets a half-written one, even after a crash or a power loss mid-write."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """`text` in `path`: written beside it, flushed to the disk, renamed over it, and the
    rename itself made durable."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_dir(path.parent)


def sync_dir(path: Path) -> None:
    """fsync a folder: its entries (files made, renamed or removed in it) reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
