"""Weight files in the swap folder (`vllm_plugin/weights/swap_folder.py`): a trainer killed between
writing a file and removing it leaves it in shared memory, so the next writer sweeps files
whose writer is gone; a full folder (a container's 64 MiB /dev/shm) is named with the fix."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

from vllm_plugin.weights.manifest import WeightSwapError
from vllm_plugin.weights.swap_folder import swap_file, swap_folder, sweep_orphans


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_files_of_writers_that_died_are_swept_and_live_ones_kept():
    """A trainer SIGKILLed mid-swap: its file has no owner left to remove it."""
    folder = swap_folder()
    killed, running = _sleeper(), _sleeper()
    orphan = folder / f"policy-v7-p{killed.pid}-0123abcd.safetensors"
    live = folder / f"draft-v3-p{running.pid}-89abcdef.safetensors"
    try:
        orphan.write_bytes(b"weights")
        live.write_bytes(b"weights")
        killed.kill()  # SIGKILL: nothing of the writer's runs
        killed.wait()
        with swap_file("draft", {"w": torch.zeros(4)}, 4, None) as path:
            assert path.is_file() and f"-p{os.getpid()}-" in path.name
            assert not orphan.exists() and live.exists()
        assert not path.exists()
        assert sweep_orphans(folder) == []
    finally:
        running.kill()
        running.wait()
        live.unlink(missing_ok=True)
        orphan.unlink(missing_ok=True)


def test_a_full_swap_folder_is_named_with_the_fix(monkeypatch):
    def no_room(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", no_room)
    with pytest.raises(
        WeightSwapError,
        match=r"no room for the policy weights \(\d+ MiB\) in the swap folder .*--shm-size",
    ):
        with swap_file("policy", {"w": torch.zeros(1 << 20)}, 1, None):
            pass
    assert not list(swap_folder().glob("policy-v1-p*"))  # the partial file is gone
