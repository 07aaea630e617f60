"""Is the draft paying for itself? Where a k = 0 step still runs the draft pass (vLLM's
Model Runner V2, CUDA's default; asynchronous scheduling; the free k = 0 patch off), an
engine whose controller keeps choosing k = 0 because the head is not accepted enough pays
the draft on every step and gains nothing: it is slower than the same engine without
speculation, and nothing else says so. So the scheduler counts its decode steps in windows
long enough to hold a rollout's tail, where drafting pays most, and, once, when nearly all
steps of a window drafted nothing on such an engine, says what it costs and what to do.

Where k = 0 steps skip the draft (Model Runner V1 with the patch, synchronous scheduling:
CPU by default) such an engine runs as fast as a plain one, and nothing is said."""

from __future__ import annotations

WINDOW = 2048  # decode steps judged together: a rollout's bulk and its tail
IDLE_SHARE = 0.9  # share of a window's steps at k = 0 that makes the draft unpaid


def k0_steps_draft(acting: list[str], async_scheduling: bool) -> bool:
    """Whether a step at k = 0 still runs the draft pass in an engine whose acting patches
    are `acting` (`patches.acting`: none of the V1 runner's on Model Runner V2): everywhere
    but where the free k = 0 patch acts and scheduling is synchronous (asynchronous, the
    patch stands aside)."""
    return "free_k0_v0_32" not in acting or async_scheduling


class UnpaidDraftCheck:
    def __init__(self, k0_steps_draft: bool, window: int = WINDOW):
        self.k0_steps_draft, self.window = k0_steps_draft, window
        self.steps = self.idle = 0  # decode steps in the current window, those at k = 0
        self.said = False

    def decode_step(self, k: int) -> str | None:
        """One decode step at `k`. Returns the message to say, the first time only."""
        if not self.k0_steps_draft or self.said:
            return None
        self.steps += 1
        self.idle += k == 0
        if self.steps < self.window:
            return None
        idle, self.steps, self.idle = self.idle, 0, 0
        if idle < IDLE_SHARE * self.window:
            return None
        self.said = True
        return (
            f"grpo-specdec: the draft head was used in {self.window - idle} of the last "
            f"{self.window} decode steps (k = 0 in the rest: drafting did not pay), and in "
            "this engine a k = 0 step still runs the draft pass (Model Runner V2, vLLM's CUDA "
            "default, or asynchronous scheduling), so over those steps it ran slower than the "
            "same engine without speculation. Train or replace the head, start the engine "
            "without a speculative_config, or let k = 0 steps skip the draft: "
            "VLLM_USE_V2_MODEL_RUNNER=0 with async_scheduling=False"
        )
