"""A learner's saved state, loaded as data and without its optimiser's saved settings.

A state file is unpickled as data only: a checkpoint may come from elsewhere, and
unpickling anything else can run code. `torch.optim.Optimizer.load_state_dict` restores each parameter group's settings (lr,
weight decay, betas) as they were saved, so a run resumed with `policy.lr=1e-7` would go on
at the checkpoint's rate and say nothing. The moments and step counts are the state worth
keeping; the settings are the config's.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def load_learner_state(path: Path, mmap: bool = False) -> dict:
    """A learner's state file, unpickled as data only (tensors, numbers, strings and their
    containers)."""
    try:
        return torch.load(path, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds more than tensors and plain data; refusing to load it "
            "(unpickling other objects can run code)"
        ) from err


@contextmanager
def configured_settings_kept(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Whatever state is loaded into `opt` inside, its groups keep the settings they were
    built with."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    yield
    for group, kept in zip(opt.param_groups, settings, strict=True):
        group.update(kept)
