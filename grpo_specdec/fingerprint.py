"""What a file or folder holds, in one digest: the job's data file recorded in each
checkpoint, a published head's files keying its on-the-fly import."""

from __future__ import annotations

import hashlib
from pathlib import Path


def fingerprint(path: str | Path) -> dict:
    """Path, size and sha256 of a file, or of every file under a folder (names included)."""
    root = Path(path)
    files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else [root]
    digest, size = hashlib.sha256(), 0
    for f in files:
        digest.update(str(f.relative_to(root) if root.is_dir() else f.name).encode())
        with f.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
                size += len(block)
    return {"path": str(root.resolve()), "size": size, "sha256": digest.hexdigest()}
