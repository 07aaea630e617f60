"""Worker extension: swap draft or policy weights into a running engine, validated and versioned.

Used as `LLM(..., worker_extension_cls="vllm_plugin.weight_swap.WeightSwapExtension")`
and driven through `llm.collective_rpc("grpo_swap_weights", ...)`. Weights travel as a
safetensors file that the caller put in the private swap folder (`swap_folder`; files
anywhere else are refused), so nothing is pickled tensor by tensor and the same call
works with the engine in-process or in its own process. The worker opens the file first
and keeps it open while it is the last good one: the caller may remove it at any time.

Loading goes through vLLM's layerwise reload (`initialize_layerwise_reload` ...
`finalize_layerwise_reload`, in vllm_plugin/compat.py), the same lifecycle its weight-transfer engines use; it
re-runs each layer's post-load processing, which matters on CPU where linear weights
are repacked after loading. If loading fails partway, the last good weights (the file
kept open, or the checkpoint) are loaded again, so the engine never serves a mix; if that fails
too, the role is marked mixed and the engine refuses to generate until a load of that
role succeeds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_plugin.compat import layerwise_reload
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

ROLES = ("policy", "draft")


class WeightSwapExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _grpo_state(self) -> dict:
        state = getattr(self, "_grpo_swap_state", None)
        if state is None:
            # last_good: role -> files to reload it from (the checkpoint's, or an open swap file);
            # held: role -> the open swap file of its last good weights;
            # mixed: role -> why its weights may be a mix (a failed load, then a failed restore)
            state = {
                "versions": {r: 0 for r in ROLES},
                "manifests": {},
                "last_good": {},
                "held": {},
                "mixed": {},
            }
            self._grpo_swap_state = state
        return state

    def _grpo_target(self, role: str) -> tuple[torch.nn.Module, object]:
        if role == "policy":
            return self.get_model(), self.vllm_config.model_config
        if role == "draft":
            model = self.get_draft_model()
            spec = self.vllm_config.speculative_config
            if model is None or spec is None or spec.draft_model_config is None:
                raise WeightSwapError("draft swap requested, but this engine runs no draft model")
            return model, spec.draft_model_config
        raise WeightSwapError(f"role must be one of {ROLES}, got {role!r}")

    def _grpo_manifest(self, role: str) -> Manifest:
        state = self._grpo_state()
        if role not in state["manifests"]:
            _, model_config = self._grpo_target(role)
            state["manifests"][role] = read_manifest(model_config.model)
            state["last_good"][role] = [str(f) for f in checkpoint_files(model_config.model)]
        return state["manifests"][role]

    def _grpo_load(self, role: str, weights: dict[str, torch.Tensor]) -> None:
        model, model_config = self._grpo_target(role)
        with layerwise_reload(model, model_config, self.vllm_config):
            model.load_weights(iter(weights.items()))

    def grpo_swap_weights(self, role: str, path: str, version: int) -> dict:
        """Validate then load the safetensors file at `path` (in the swap folder) as the
        `role` model, version `version`."""
        t0 = time.perf_counter()
        manifest = self._grpo_manifest(role)
        what = f"{role} (version {version}, {Path(path).name})"
        # A file object, not a bare descriptor: the one kept for restores closes when the
        # worker goes, freeing its unlinked shared memory.
        held = os.fdopen(open_swap_file(path), "rb")
        opened = f"/proc/self/fd/{held.fileno()}"
        state = self._grpo_state()
        try:
            with safe_open(opened, "pt") as f:
                metadata = f.metadata() or {}
            validate_metadata(metadata, self._grpo_target(role)[1].hf_config, what)
            weights = load_file(opened)
            validate_weights(weights, manifest, what)
            t1 = time.perf_counter()
            try:
                self._grpo_load(role, weights)
            except Exception as err:
                failure = f"loading {role} version {version} failed ({type(err).__name__}: {err})"
                self._grpo_restore(role, failure)
                raise WeightSwapError(
                    f"{failure}; restored version {state['versions'][role]}"
                ) from err
        except BaseException:
            held.close()
            raise
        previous = state["held"].pop(role, None)
        if previous is not None:
            previous.close()
        state["held"][role] = held
        state["versions"][role] = version
        state["last_good"][role] = [opened]
        state["mixed"].pop(role, None)
        drafter = group_drafter(self.model_runner)
        if role == "policy" and drafter is not None:
            drafter.new_policy()
        return {"version": version, "validate_s": t1 - t0, "load_s": time.perf_counter() - t1}

    def _grpo_restore(self, role: str, failure: str) -> None:
        """Reload the last good `role` weights after `failure`. If that fails as well, part
        of the model may hold new weights and part old: mark the role mixed and say so."""
        state = self._grpo_state()
        try:
            previous = {}
            for f in state["last_good"][role]:
                previous.update(load_file(f))
            self._grpo_load(role, previous)
        except Exception as err:
            state["mixed"][role] = (
                f"{failure}, and restoring version {state['versions'][role]} failed too "
                f"({type(err).__name__}: {err})"
            )
            raise MixedWeightsError(
                f"{state['mixed'][role]}; the {role} weights may be a mix, so the engine "
                f"refuses to generate until a {role} swap succeeds"
            ) from err
        state["mixed"].pop(role, None)

    def grpo_declare_weight_versions(self, versions: dict[str, int]) -> None:
        """The versions of the weights the engine was started from (e.g. a checkpoint's),
        reported until the first swap of each role."""
        unknown = sorted(set(versions) - set(ROLES))
        if unknown:
            raise WeightSwapError(f"unknown weight roles {unknown}; expected some of {ROLES}")
        self._grpo_state()["versions"].update(versions)

    def grpo_mixed_weights(self) -> dict[str, str]:
        """Role -> why its weights may be a mix; empty while every role holds a whole set."""
        return dict(self._grpo_state()["mixed"])

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
        return dict(self._grpo_state()["versions"])
