"""Weights handed to an engine as safetensors files in shared memory, per role.

The file of a role's last good swap is kept until the next swap of that role succeeds:
the engine reloads it if a later swap fails halfway."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import torch


def swap_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = base / "grpo-specdec"
    path.mkdir(exist_ok=True)
    return path


class SwapFiles:
    def __init__(self):
        self._last_good: dict[str, Path] = {}

    def write(
        self, role: str, weights: dict[str, torch.Tensor], version: int, metadata: dict | None
    ) -> Path:
        """`weights` as a file for the engine; `metadata` goes in its header."""
        from safetensors.torch import save_file

        path = swap_dir() / f"{role}-v{version}-{uuid.uuid4().hex[:8]}.safetensors"
        tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
        save_file(tensors, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})
        return path

    def loaded(self, role: str, path: Path) -> None:
        """The engine now serves `path`: it becomes the file to fall back on."""
        previous = self._last_good.get(role)
        self._last_good[role] = path
        if previous is not None:
            previous.unlink(missing_ok=True)

    def remove_all(self) -> None:
        for path in self._last_good.values():
            path.unlink(missing_ok=True)
        self._last_good.clear()
