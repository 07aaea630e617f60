"""Weights handed to an engine as a safetensors file in the private swap folder
(`vllm_plugin.swap_folder`), the one place the engine loads swapped weights from."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from vllm_plugin.manifest import WeightSwapError
from vllm_plugin.swap_folder import process_alive, swap_folder, writer_pid


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

    folder = swap_folder()
    sweep_orphans(folder)
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
