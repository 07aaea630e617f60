"""Weight swaps into a running engine, validated, versioned, all or none.

Loading is the `grpo_shm` weight-transfer engine's (vllm_plugin/shm_transfer.py), driven
through vLLM's RL API: `start_weight_update` (or `start_draft_weight_update`),
`update_weights({"path", "version"})`, `finish_weight_update`. Weights travel as a
safetensors file that the caller put in the private swap folder (`swap_folder`; files
anywhere else are refused), so nothing is pickled tensor by tensor and the same call works
with the engine in-process, in its own process or on several tensor-parallel ranks. Each
rank opens the file first and keeps it open while it is the last good one: the caller may
remove it at any time.

Loading goes through vLLM's layerwise reload (`initialize_layerwise_reload` ...
`finalize_layerwise_reload`, in vllm_plugin/compat.py), which re-runs each layer's
post-load processing (on CPU, linear weights are repacked after loading). A load that
fails partway reloads the last good weights (the file kept open, or the checkpoint), so the
rank never serves a mix. A load that succeeded stays uncommitted until
`finish_weight_update`: if another rank failed, `grpo_abort_weight_update` (this module's
worker extension) takes every rank back to the weights it had. Where a restore fails too,
the role is marked mixed and the engine refuses to generate until a load of that role
succeeds.

`WeightSwapExtension` (`LLM(..., worker_extension_cls=...)`) adds the calls vLLM's API has
no room for: per-role versions from every rank, the abort, and the group drafter's.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_plugin.compat import end_weight_update, layerwise_reload
from vllm_plugin.manifest import (
    Manifest,
    MixedWeightsError,
    WeightSwapError,
    checkpoint_files,
    read_manifest,
    validate_metadata,
    validate_weights,
)
from vllm_plugin.patches.group_drafts_v0_32 import group_drafter
from vllm_plugin.swap_folder import open_swap_file

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
        held = os.fdopen(open_swap_file(path), "rb")
        opened = f"/proc/self/fd/{held.fileno()}"
        try:
            with safe_open(opened, "pt") as f:
                metadata = f.metadata() or {}
            validate_metadata(metadata, model_config.hf_config, what)
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


class WeightSwapExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _grpo_transfer(self):
        from vllm_plugin.shm_transfer import BACKEND, ShmWeightTransferEngine

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, ShmWeightTransferEngine):
            raise WeightSwapError(
                "weight swaps need the engine started with weight_transfer_config="
                f'{{"backend": "{BACKEND}"}} (vllm serve: --weight-transfer-config '
                f'\'{{"backend": "{BACKEND}"}}\')'
            )
        return engine

    def grpo_abort_weight_update(self) -> dict[str, int]:
        """End this rank's update session, taking back a load it did not commit (vLLM's
        worker ends a session that failed on this rank by itself, and has no way to end
        one that succeeded here but failed on another rank). Its versions after."""
        engine = self._grpo_transfer()
        try:
            engine.abort()
        finally:
            end_weight_update(self)
        return dict(engine.swaps.versions)

    def grpo_last_swap_report(self) -> dict:
        """Seconds this rank spent validating and loading in its last update."""
        return dict(self._grpo_transfer().swaps.last_report)

    def grpo_declare_weight_versions(self, versions: dict[str, int]) -> None:
        """The versions of the weights the engine was started from (e.g. a checkpoint's),
        reported until the first swap of each role."""
        self._grpo_transfer().swaps.declare(versions)

    def grpo_end_stale_weight_update(self) -> dict:
        """End an update session that no live trainer holds (a trainer that died between
        `start_*` and `finish_weight_update` leaves vLLM's worker refusing every later
        start), undoing what it loaded. {"ended": bool, "reason": str}."""
        engine = self._grpo_transfer()
        if not getattr(self, "_weight_update_active", False):
            return {"ended": False, "reason": "no weight update session is open"}
        why = engine.stale_session()
        if why is None:
            return {"ended": False, "reason": engine.describe_session()}
        logger.warning("ending a weight update session: %s; its load is undone", why)
        self.grpo_abort_weight_update()
        return {"ended": True, "reason": why}

    def grpo_mixed_weights(self) -> dict[str, str]:
        """Role -> why its weights may be a mix; empty while every role holds a whole set.
        Weights loaded by a trainer that died before committing them are undone first: the
        engine would otherwise serve them under the old version."""
        engine = self._grpo_transfer()
        if engine.sender is not None and engine.stale_session() is not None:
            self.grpo_end_stale_weight_update()
        return dict(engine.swaps.mixed)

    def _grpo_group_drafter(self):
        drafter = group_drafter(self.model_runner)
        if drafter is None:
            raise RuntimeError("group drafts are off in this engine (controller.group.enabled)")
        return drafter

    def grpo_group_draft_stats(self) -> dict | None:
        """Counts of the group drafter (drafts and acceptance per source, history size);
        None when group drafts are off."""
        drafter = group_drafter(self.model_runner)
        return None if drafter is None else drafter.snapshot()

    def grpo_group_draft_reset(self) -> None:
        self._grpo_group_drafter().reset()

    def grpo_group_draft_add_history(self, prompts: list[list[int]], outputs) -> None:
        """outputs[i]: finished answers (token lists) to prompts[i]."""
        drafter = self._grpo_group_drafter()
        for prompt, answers in zip(prompts, outputs, strict=True):
            drafter.add_history(prompt, answers)

    def grpo_weight_versions(self) -> dict[str, int]:
        return dict(self._grpo_transfer().swaps.versions)
