"""vLLM 0.32.0 and 0.33.0: no step runs on weights that may be a mix, whichever client drove
the update.

vLLM's engine core runs a step whenever it holds requests: nothing stops it between the
calls of a weight update (`start_weight_update`, `update_weights`, `finish_weight_update`),
nor after an update that failed and could not be undone. The plugin's `Engine` and its
served route refuse to generate then, but a client that drives the update itself (vLLM's
RL routes and its HTTP client, a `collective_rpc` as verl's, a plain `LLM`) passes through
neither. Every such call reaches the workers through `EngineCore.collective_rpc`, which the
engine core runs between its steps: after each call of the update's lifecycle the guard
asks the workers what they hold (`WeightSwapExtension.grpo_weight_state`: an update session
open, a role whose weights may be a mix), and before each step it acts on the answer:

- an update session open: no step runs while it is (the requests wait; none is dropped),
  until it ends, or its trainer is found dead (asked at most once a second; the workers then
  end the session and undo its load), or it has been open past the swap deadline
  (GRPO_SPECDEC_SWAP_DEADLINE_S, 600 s by default), which counts as below;
- a role whose weights may be a mix: every request the engine holds, and each that arrives
  until an update of that role loads whole, ends at once with finish reason "error" and the
  reason as its stop reason (a served engine answers it as a failed request), said on vLLM's
  log at ERROR.

A scheduler that vLLM's own pause holds (`pause_generation(mode="keep")`, which the served
route and RL trainers call around an update) runs nothing anyway and is left to it. Acts
only in engines whose weights load through the plugin's worker extension.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

logger = logging.getLogger(f"vllm.{__name__}")

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = False
# vLLM's update lifecycle and the plugin's calls that end or undo an update.
LIFECYCLE = frozenset(
    {
        "start_weight_update",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
        "grpo_abort_weight_update",
        "grpo_end_stale_weight_update",
    }
)
RECHECK_S = 1.0  # how often a held engine asks whether the session's trainer still lives
HOLD_S = 0.005  # a held engine's pause between the steps it skips (the loop would spin)


@dataclass
class WeightGuard:
    """What the workers last said they hold; plain, so that tests use it without vLLM."""

    deadline_s: float
    session: str | None = None  # why an update session is open, in the workers' words
    opened_at: float = 0.0
    mixed: dict[str, str] = field(default_factory=dict)
    unanswered: str | None = None  # why the workers could not be asked
    asked_at: float = 0.0

    def learn(self, per_rank: list[dict], now: float) -> None:
        from vllm_plugin.weights.rank_weights import merged_mixed

        sessions = sorted({r["session"] for r in per_rank if r["session"]})
        if sessions and self.session is None:
            self.opened_at = now
        self.session = "; ".join(sessions) or None
        self.mixed = merged_mixed([r["mixed"] for r in per_rank])
        self.unanswered, self.asked_at = None, now

    def cannot_ask(self, err: Exception, now: float) -> None:
        self.unanswered = f"the workers could not say what they hold ({type(err).__name__}: {err})"
        self.asked_at = now

    @property
    def clear(self) -> bool:
        return self.session is None and not self.mixed and self.unanswered is None

    def refusal(self, now: float) -> str | None:
        """Why every request must end now; None where the engine may run, or hold them."""
        from vllm_plugin.weights.rank_weights import mixed_reasons

        reasons = mixed_reasons(self.mixed)
        if self.unanswered:
            reasons.append(self.unanswered)
        if self.session is not None and now - self.opened_at > self.deadline_s:
            from vllm_plugin.settings import DEADLINE_ENV

            reasons.append(
                f"a weight update session has been open {now - self.opened_at:.0f} s, past the "
                f"{self.deadline_s:g} s deadline ({DEADLINE_ENV}): {self.session}"
            )
        return "; ".join(reasons) or None


def guarded(vllm_config) -> bool:
    """Whether an engine of `vllm_config` loads weights through the plugin's worker
    extension (`WeightSwapExtension`, or a class made from it), whose workers can say what
    they hold."""
    if getattr(vllm_config, "weight_transfer_config", None) is None:
        return False
    name = vllm_config.parallel_config.worker_extension_cls
    if not name:
        return False
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_plugin.weight_swap import WeightSwapExtension

    try:
        extension = resolve_obj_by_qualname(name)
    except (ImportError, AttributeError, ValueError):
        return False  # vLLM says so when it builds the workers
    return isinstance(extension, type) and issubclass(extension, WeightSwapExtension)


def _guard(core) -> WeightGuard | None:
    """The engine core's guard, made at its first update; None where the engine's weights
    do not load through the plugin."""
    if "_grpo_weight_guard" not in core.__dict__:
        from vllm_plugin.settings import swap_deadline_s

        ours = guarded(core.vllm_config)
        core._grpo_weight_guard = WeightGuard(swap_deadline_s()) if ours else None
    return core._grpo_weight_guard


def _ask(core, guard: WeightGuard) -> None:
    from vllm.v1.engine.core import EngineCore

    now = time.monotonic()
    was_mixed = dict(guard.mixed)
    try:
        guard.learn(EngineCore.collective_rpc._grpo_original(core, "grpo_weight_state"), now)
    except Exception as err:  # workers gone or wedged: nothing they hold can be trusted
        guard.cannot_ask(err, now)
    if guard.mixed and guard.mixed != was_mixed or guard.unanswered:
        logger.error("grpo-specdec: this engine generates nothing now: %s", guard.refusal(now))
    elif was_mixed and not guard.mixed:
        logger.info("grpo-specdec: every role's weights are whole again; generating")


def _held(core) -> list:
    return [r for r in core.scheduler.requests.values() if not r.is_finished()]


def _finish_all(core, held: list, why: str) -> dict:
    """The requests the scheduler `held`, finished with finish reason "error"."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    logger.error("grpo-specdec: refusing %d request(s): %s", len(held), why)
    core.scheduler.finish_requests([r.request_id for r in held], RequestStatus.FINISHED_ERROR)
    by_client: dict[int, list[str]] = defaultdict(list)
    for r in held:
        by_client[r.client_index].append(r.request_id)
    return {
        client: EngineCoreOutputs(
            finished_requests=set(ids),
            outputs=[
                EngineCoreOutput(i, [], finish_reason=FinishReason.ERROR, stop_reason=why)
                for i in ids
            ],
        )
        for client, ids in by_client.items()
    }


def _wrap_rpc(original):
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        guard = _guard(self) if isinstance(method, str) and method in LIFECYCLE else None
        if guard is None:
            return original(self, method, timeout, args, kwargs)
        try:
            return original(self, method, timeout, args, kwargs)
        finally:
            _ask(self, guard)

    collective_rpc._grpo_original = original
    return collective_rpc


def _wrap_step(original):
    def step(self):
        guard = self.__dict__.get("_grpo_weight_guard")
        if guard is None or guard.clear:
            return original(self)
        from vllm.v1.core.sched.interface import PauseState

        if self.scheduler.pause_state == PauseState.PAUSED_ALL:
            return original(self)  # vLLM's pause: nothing runs
        now = time.monotonic()
        if guard.session is not None and now - guard.asked_at >= RECHECK_S:
            _ask(self, guard)  # a dead trainer's session is ended there
            if guard.clear:
                return original(self)
        held = _held(self)
        if not held:  # only finished requests to free: a step runs no model
            return original(self)
        why = guard.refusal(now)
        if why is None:  # a live trainer's update: its requests wait
            time.sleep(HOLD_S)
            return {}, False
        outputs = _finish_all(self, held, why)
        # With no request left to run, the step only frees the finished ones (a pause waits
        # for that), running no model.
        freed, executed = original(self)
        for client, eco in (freed or {}).items():
            if client in outputs:
                outputs[client].outputs.extend(eco.outputs)
            else:
                outputs[client] = eco
        return outputs, executed

    step._grpo_original = original
    return step


def weight_refusal(core) -> str | None:
    """Why this engine refuses every request now (`EngineCore.grpo_weight_refusal`, a utility
    call the served route makes before it admits a request); None while it generates or
    holds requests for an update in progress."""
    guard = core.__dict__.get("_grpo_weight_guard")
    return None if guard is None or guard.clear else guard.refusal(time.monotonic())


def applies() -> bool:
    from vllm_plugin.patches import vllm_is

    return vllm_is(TARGET_VERSIONS)


def apply() -> bool:
    if not applies():
        return False
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore.collective_rpc, "_grpo_original"):
        EngineCore.collective_rpc = _wrap_rpc(EngineCore.collective_rpc)
        EngineCore.step = _wrap_step(EngineCore.step)
        EngineCore.step_with_batch_queue = _wrap_step(EngineCore.step_with_batch_queue)
        EngineCore.grpo_weight_refusal = weight_refusal
    return True
