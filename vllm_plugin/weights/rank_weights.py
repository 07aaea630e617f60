"""One rank's weights per role, validated, versioned, all or none (`WeightSwaps`), and how
the ranks' reports combine. The `grpo_shm` weight-transfer engine (shm_transfer.py) loads
through it; the worker extension (vllm_plugin/weight_swap.py) reads and aborts through it.

Loading goes through vLLM's layerwise reload (`initialize_layerwise_reload` ...
`finalize_layerwise_reload`, in vllm_plugin/compat.py), which re-runs each layer's
post-load processing (on CPU, linear weights are repacked after loading). A load that
fails partway reloads the last good weights (the file kept open, or the checkpoint), so the
rank never serves a mix. A load that succeeded stays uncommitted until the session's
finish; a role whose restore failed too is marked mixed, and the engine refuses to generate
until a load of that role succeeds.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_plugin.compat import engine_instance_id, layerwise_reload
from vllm_plugin.weights.manifest import (
    Manifest,
    MixedWeightsError,
    WeightSwapError,
    checkpoint_files,
    header_entry,
    read_manifest,
    validate_layout,
    validate_metadata,
    validate_weights,
)
from vllm_plugin.weights.swap_folder import (
    engine_swap_folder,
    open_swap_file,
    remove_engine_folder,
)

logger = logging.getLogger(__name__)

ROLES = ("policy", "draft")


class WeightSwaps:
    """One rank's weights per role: their versions, the files of the last good ones (a
    checkpoint's, or an open swap file), a loaded but uncommitted update, and why a role's
    weights may be a mix."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.versions = {r: 0 for r in ROLES}
        self.manifests: dict[str, Manifest] = {}
        self.last_good: dict[str, list[str]] = {}
        self.held: dict[str, object] = {}  # role -> the open swap file of its last good weights
        self.pending: dict[str, tuple[object, int]] = {}  # role -> (open file, version)
        self.mixed: dict[str, str] = {}
        self.last_report: dict = {}

    @functools.cached_property
    def folder(self) -> Path:
        """This engine's swap folder, the only place its weight files are read from."""
        return engine_swap_folder(engine_instance_id(self.vllm_config))

    def release_folder(self) -> None:
        """Remove this engine's swap folder, if it was made, unless a live trainer's file is
        in it (`remove_engine_folder`); a later swap, or a trainer's ask, makes it again."""
        folder = self.__dict__.pop("folder", None)  # what the cached property made
        if folder is not None:
            remove_engine_folder(folder)

    def _manifest(self, role: str, model_config) -> Manifest:
        if role not in self.manifests:
            self.manifests[role] = read_manifest(model_config.model)
            self.last_good[role] = [str(f) for f in checkpoint_files(model_config.model)]
        return self.manifests[role]

    def _load(self, model, model_config, weights: dict[str, torch.Tensor]) -> None:
        with layerwise_reload(model, model_config, self.vllm_config):
            model.load_weights(iter(weights.items()))

    def load(self, role: str, model, model_config, path: str, version: int) -> None:
        """Validate then load the safetensors file at `path` (in the swap folder) as the
        `role` model, version `version`, uncommitted. A rejected or failed load leaves the
        last good weights serving (or the role marked mixed) and raises."""
        if role not in ROLES:
            raise WeightSwapError(f"role must be one of {ROLES}, got {role!r}")
        t0 = time.perf_counter()
        manifest = self._manifest(role, model_config)
        what = f"{role} (version {version}, {Path(path).name})"
        # A file object, not a bare descriptor: the one kept for restores closes when the
        # worker goes, freeing its unlinked shared memory.
        held = os.fdopen(open_swap_file(path, self.folder), "rb")
        opened = f"/proc/self/fd/{held.fileno()}"
        try:
            with safe_open(opened, "pt") as f:
                metadata = f.metadata() or {}
                layout = {n: header_entry(f.get_slice(n)) for n in f.keys()}
            validate_metadata(metadata, model_config.hf_config, what)
            validate_layout(layout, manifest, what)
            weights = load_file(opened)
            validate_weights(weights, manifest, what)
            t1 = time.perf_counter()
            try:
                self._load(model, model_config, weights)
            except Exception as err:
                failure = f"loading {role} version {version} failed ({type(err).__name__}: {err})"
                self._restore(role, model, model_config, failure)
                raise WeightSwapError(f"{failure}; restored version {self.versions[role]}") from err
        except BaseException:
            held.close()
            raise
        self._drop_pending(role)
        self.pending[role] = (held, version)
        self.last_report = {"validate_s": t1 - t0, "load_s": time.perf_counter() - t1}

    def commit(self, role: str | None) -> int | None:
        """The loaded update of `role` becomes its last good weights; its version, or None
        if nothing was loaded. Never raises (vLLM's worker cannot leave an update that
        failed to finish)."""
        if role not in self.pending:
            return None
        held, version = self.pending.pop(role)
        previous = self.held.pop(role, None)
        if previous is not None:
            previous.close()
        self.held[role] = held
        self.versions[role] = version
        self.last_good[role] = [f"/proc/self/fd/{held.fileno()}"]
        self.mixed.pop(role, None)
        return version

    def roll_back(self, role: str, model, model_config) -> None:
        """Undo a loaded, uncommitted update of `role` (another rank failed its part)."""
        if role in self.pending:
            self._drop_pending(role)
            self._restore(role, model, model_config, f"{role} update aborted on another rank")

    def _drop_pending(self, role: str) -> None:
        pending = self.pending.pop(role, None)
        if pending is not None:
            pending[0].close()

    def _restore(self, role: str, model, model_config, failure: str) -> None:
        """Reload the last good `role` weights after `failure`. If that fails as well, part
        of the model may hold new weights and part old: mark the role mixed and say so."""
        try:
            previous = {}
            for f in self.last_good[role]:
                previous.update(load_file(f))
            self._load(model, model_config, previous)
        except Exception as err:
            self.mixed[role] = (
                f"{failure}, and restoring version {self.versions[role]} failed too "
                f"({type(err).__name__}: {err})"
            )
            raise MixedWeightsError(
                f"{self.mixed[role]}; the {role} weights may be a mix, so the engine "
                f"refuses to generate until a {role} swap succeeds"
            ) from err
        self.mixed.pop(role, None)

    def declare(self, versions: dict[str, int]) -> None:
        unknown = sorted(set(versions) - set(ROLES))
        if unknown:
            raise WeightSwapError(f"unknown weight roles {unknown}; expected some of {ROLES}")
        self.versions.update(versions)


def agreed_versions(per_rank: list[dict[str, int]]) -> dict[str, int]:
    """The weight versions every rank reports (`grpo_weight_versions` through
    collective_rpc); ranks that disagree, named, are an error."""
    if any(v != per_rank[0] for v in per_rank[1:]):
        ranks = "; ".join(f"rank {i}: {v}" for i, v in enumerate(per_rank))
        raise MixedWeightsError(f"the ranks serve different weight versions ({ranks})")
    return dict(per_rank[0])


def merged_mixed(per_rank: list[dict[str, str]]) -> dict[str, str]:
    """Role -> why its weights may be a mix, on any rank (`grpo_mixed_weights`)."""
    merged: dict[str, str] = {}
    for rank, mixed in enumerate(per_rank):
        for role, why in mixed.items():
            merged.setdefault(role, f"rank {rank}: {why}" if len(per_rank) > 1 else why)
    return merged


def mixed_reasons(mixed: dict[str, str]) -> list[str]:
    """Why nothing may be generated, one reason per role of `mixed` (`merged_mixed`), in the
    words every refusal uses: the trainer's, the served route's and the engine core's guard."""
    return [
        f"the {role} weights may be a mix ({why}); a {role} update that loads whole clears this"
        for role, why in mixed.items()
    ]
