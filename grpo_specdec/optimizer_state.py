"""An optimiser's saved state loaded without its saved settings.

`torch.optim.Optimizer.load_state_dict` restores each parameter group's settings (lr,
weight decay, betas) as they were saved, so a run resumed with `policy.lr=1e-7` would go on
at the checkpoint's rate and say nothing. The moments and step counts are the state worth
keeping; the settings are the config's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def configured_settings_kept(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Whatever state is loaded into `opt` inside, its groups keep the settings they were
    built with."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    yield
    for group, kept in zip(opt.param_groups, settings, strict=True):
        group.update(kept)
