"""Weight swaps into a running engine: the worker extension beside vLLM's RL API.

Loading is the `grpo_shm` weight-transfer engine's (vllm_plugin/weights/shm_transfer.py),
driven through vLLM's RL API: `start_weight_update` (or `start_draft_weight_update`),
`update_weights({"path", "version"})`, `finish_weight_update`. Weights travel as a
safetensors file that the caller put in the engine's private swap folder
(`grpo_swap_folder`, `weights.swap_folder`; files anywhere else are refused), so nothing is
pickled tensor by tensor and the same call works with the engine in-process, in its own
process or on several tensor-parallel ranks.
Each rank opens the file first and keeps it open while it is the last good one: the caller
may remove it at any time. What a rank holds per role is `weights.rank_weights.WeightSwaps`.

`WeightSwapExtension` (`LLM(..., worker_extension_cls=...)`) adds the calls vLLM's API has
no room for: per-role versions from every rank, the abort (if another rank failed,
`grpo_abort_weight_update` takes every rank back to the weights it had), and the group
drafter's.
"""

from __future__ import annotations

import logging

from vllm_plugin.compat import end_weight_update
from vllm_plugin.patches.features.group_drafts_v0_32 import group_drafter
from vllm_plugin.weights.manifest import WeightSwapError
from vllm_plugin.weights.shm_transfer import BACKEND, ShmWeightTransferEngine

logger = logging.getLogger(__name__)


class WeightSwapExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _grpo_transfer(self):
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

    def grpo_weight_state(self) -> dict:
        """What the engine core's weight guard (patches/features/weight_guard_v0_32.py) asks
        after each call of an update: {"session": why an update session is open, or None;
        "mixed": role -> why its weights may be a mix}. A session whose trainer died is ended
        first, its load undone."""
        mixed = self.grpo_mixed_weights()
        session = None
        if getattr(self, "_weight_update_active", False):
            session = self._grpo_transfer().describe_session()
        return {"session": session, "mixed": mixed}

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

    def grpo_swap_folder(self) -> str:
        """The folder a trainer writes this engine's weight files to (`weights.swap_folder`):
        its own, so that no caller of another engine can have it load theirs."""
        return str(self._grpo_transfer().swaps.folder)

    def grpo_weight_versions(self) -> dict[str, int]:
        return dict(self._grpo_transfer().swaps.versions)
