"""Weight files in the engines' swap folders (`vllm_plugin/weights/swap_folder.py`): a trainer
killed between writing a file and removing it leaves it in shared memory, so the next writer
sweeps files whose writer is gone, in every engine's folder; an engine's folder goes at its
end unless a live trainer's file is in it; a full folder (a container's 64 MiB /dev/shm) is
named with the fix; a folder an engine names is written to only if it is an engine's private
folder inside the user's."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm_plugin.weights.manifest import WeightSwapError
from vllm_plugin.weights.rank_weights import WeightSwaps
from vllm_plugin.weights.swap_folder import (
    engine_swap_folder,
    remove_engine_folder,
    swap_file,
    swap_folder,
    sweep_orphans,
)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_files_of_writers_that_died_are_swept_and_live_ones_kept():
    """A trainer SIGKILLed mid-swap: its file has no owner left to remove it."""
    folder, ours = engine_swap_folder("gone-engine"), str(engine_swap_folder("test-engine"))
    killed, running = _sleeper(), _sleeper()
    orphan = folder / f"policy-v7-p{killed.pid}-0123abcd.safetensors"
    live = folder / f"draft-v3-p{running.pid}-89abcdef.safetensors"
    try:
        orphan.write_bytes(b"weights")
        live.write_bytes(b"weights")
        killed.kill()  # SIGKILL: nothing of the writer's runs
        killed.wait()
        with swap_file("draft", {"w": torch.zeros(4)}, 4, None, ours) as path:
            assert path.is_file() and f"-p{os.getpid()}-" in path.name
            assert str(path.parent) == ours
            assert not orphan.exists() and live.exists()
        assert not path.exists()
        assert sweep_orphans(folder) == []
    finally:
        running.kill()
        running.wait()
        live.unlink(missing_ok=True)
        orphan.unlink(missing_ok=True)


def test_a_full_swap_folder_is_named_with_the_fix(monkeypatch):
    folder = engine_swap_folder("test-engine")

    def no_room(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", no_room)
    with pytest.raises(
        WeightSwapError,
        match=r"no room for the policy weights \(\d+ MiB\) in the swap folder .*--shm-size",
    ):
        with swap_file("policy", {"w": torch.zeros(1 << 20)}, 1, None, str(folder)):
            pass
    assert not list(folder.glob("policy-v1-p*"))  # the partial file is gone


def test_the_trainer_removes_the_folder_of_an_engine_whose_worker_was_killed():
    """vLLM kills a worker that takes over 5 s to end, before it removes its own folder."""
    from vllm_plugin.weights.trainer import LLMWeights

    folder = engine_swap_folder("killed-engine")
    llm = SimpleNamespace(collective_rpc=lambda method, *a, **k: [str(folder)])
    never_asked = LLMWeights(llm)
    never_asked.engine_stopped()  # it was never told a folder: nothing to remove
    assert folder.is_dir()
    weights = LLMWeights(llm)
    assert weights._client.swap_folder() == str(folder)
    weights.engine_stopped()
    assert not folder.exists()


def test_a_trainer_writes_only_to_an_engine_s_private_folder_inside_the_user_s(tmp_path):
    """An engine names its folder; a trainer writes there only if it is one of the user's
    engines' folders, private, so that a server answering with any other path (its own
    parent folder, another user's) is refused before a byte is written."""
    weights = {"w": torch.zeros(2)}
    made = engine_swap_folder("another-engine")
    (swap_folder() / "engine-opened").mkdir(mode=0o755, exist_ok=True)
    os.chmod(swap_folder() / "engine-opened", 0o755)
    for named, why in (
        (str(swap_folder()), "not inside this user's swap folder"),
        (str(tmp_path), "not inside this user's swap folder"),
        (str(swap_folder() / "not-an-engine"), "not inside this user's swap folder"),
        (str(swap_folder() / "engine-opened"), "has mode 0755, not 0700"),
    ):
        with pytest.raises(
            WeightSwapError, match=f"named {named} as its weight swap folder.*{why}"
        ):
            with swap_file("policy", weights, 1, None, named):
                pass
    with swap_file("policy", weights, 1, None, str(made)) as path:
        assert path.parent == made
    os.rmdir(swap_folder() / "engine-opened")


def test_an_engine_s_folder_goes_at_its_end_unless_a_live_trainer_s_file_is_in_it():
    """Engine ids are new at each start: a folder left behind would stay in shared memory."""
    swaps = WeightSwaps(SimpleNamespace(instance_id="ending-engine"))
    swaps.release_folder()  # no swap, no folder: nothing made only to be removed
    assert not (swap_folder() / "engine-ending-engine").exists()
    folder = swaps.folder
    killed, running = _sleeper(), _sleeper()
    killed.kill()
    killed.wait()
    orphan = folder / f"policy-v1-p{killed.pid}-0123abcd.safetensors"
    live = folder / f"policy-v2-p{running.pid}-89abcdef.safetensors"
    try:
        orphan.write_bytes(b"weights")
        live.write_bytes(b"weights")
        remove_engine_folder(folder)
        assert folder.is_dir() and not orphan.exists()  # kept for the live trainer's file
        live.unlink()
        swaps.release_folder()
        assert not folder.exists()
        remove_engine_folder(folder)  # another rank of the engine, after this one: no error
        # An engine that a trainer let go of serves on: its next swap makes the folder again.
        assert swaps.folder == folder and folder.is_dir()
    finally:
        running.kill()
        running.wait()
        live.unlink(missing_ok=True)
        orphan.unlink(missing_ok=True)
        swaps.release_folder()
