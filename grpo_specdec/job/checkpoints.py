"""Checkpoint folders of the GRPO job: finding the newest complete one, and checking
one is whole before any work starts from it."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import torch

from grpo_specdec.modelcheck import check_model_dir

LATEST = "latest"  # file naming the newest complete checkpoint, replaced atomically


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under root, or None if there is none yet."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise FileNotFoundError(
            f"checkpoint {path} named by {pointer} is incomplete (no state.json)"
        )
    return path


def read_state(path: Path) -> dict:
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {path}: state.json is unreadable ({err})") from None
    missing = {"iteration", "cursor", "python_rng"} - set(state)
    if missing:
        raise ValueError(f"checkpoint {path}: state.json lacks {sorted(missing)}")
    return state


def load_learner_state(path: Path, mmap: bool = False) -> dict:
    """A learner's state file, unpickled as data only (tensors, numbers, strings and their
    containers): unpickling anything else can run code, and a checkpoint may come from
    elsewhere."""
    try:
        return torch.load(path, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds more than tensors and plain data; refusing to load it "
            "(unpickling other objects can run code)"
        ) from err


def check_checkpoint(path: Path) -> None:
    """Every file a resume needs is present and uncorrupted (torch files are zip archives
    with per-member CRCs, and must hold data only; safetensors files must match their
    headers)."""
    read_state(path)
    check_model_dir(path / "policy", f"checkpoint {path} policy")
    if (path / "draft").is_dir():
        check_model_dir(path / "draft", f"checkpoint {path} draft")
    for name in ("policy_state.pt", "draft_state.pt"):
        f = path / name
        if name == "draft_state.pt" and not f.exists():
            continue
        try:
            with zipfile.ZipFile(f) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as err:
            raise ValueError(f"checkpoint {path}: {name} is missing or corrupt ({err})") from None
        if bad is not None:
            raise ValueError(f"checkpoint {path}: {name} is corrupt (member {bad} fails its CRC)")
        load_learner_state(f, mmap=True)  # mapped, not read: only the pickled structure is checked
