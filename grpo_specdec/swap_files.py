"""Weights handed to an engine as a safetensors file in the private swap folder
(`vllm_plugin.swap_folder`), the one place the engine loads swapped weights from."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from vllm_plugin.swap_folder import swap_folder


@contextmanager
def swap_file(
    role: str, weights: dict[str, torch.Tensor], version: int, metadata: dict | None
) -> Iterator[Path]:
    """`weights` as a file for the engine, `metadata` in its header; removed when the block
    ends, however it ends. That is safe even while the engine may still be loading it (a
    timed-out call): the engine opens the file before reading it and keeps it open while
    it may reload it, and one that has not opened it yet finds no file and refuses the
    swap, keeping its old weights."""
    from safetensors.torch import save_file

    path = swap_folder() / f"{role}-v{version}-{uuid.uuid4().hex[:8]}.safetensors"
    tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    try:
        save_file(tensors, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})
        yield path
    finally:
        path.unlink(missing_ok=True)
