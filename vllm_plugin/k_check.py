"""Does vLLM run the k the scheduler chooses? The scheduler hands vLLM a k per step through
its per-batch-size lookup; a vLLM that caps or recomputes k (a release that reads another
table, a drafter that proposes fewer) would leave the controller choosing into the void.
So after each step the scheduler compares the k that sized the step's drafts (the k chosen
when the step before it was scheduled: the drafter proposes after a step for the next one)
with the most drafts vLLM verified for one request that no limit clipped, and says so,
once, when they disagree on several steps in a row (a single step may legitimately verify
fewer: a request that finished its prefill in chunks, one resumed after preemption)."""

from __future__ import annotations

MISMATCHED_STEPS = 3  # steps in a row before the engine says k is not honoured


class KHonouredCheck:
    def __init__(self):
        self.mismatched = 0  # steps in a row whose drafts disagreed with the k that sized them
        self.seen: tuple[int, int] | None = None  # (k chosen, most verified) when said

    def step_verified(self, chosen: int | None, longest: int | None) -> str | None:
        """One step's verification: `chosen` the k that sized its drafts (None: unknown),
        `longest` the most drafts verified for one request far from its length limits (None:
        no such request). Returns the message to say, the first time only."""
        if chosen is None or longest is None:
            return None
        self.mismatched = self.mismatched + 1 if longest != chosen else 0
        if self.mismatched < MISMATCHED_STEPS or self.seen is not None:
            return None
        self.seen = (chosen, longest)
        return (
            f"grpo-specdec: vLLM did not run the k this scheduler chose: {MISMATCHED_STEPS} "
            f"steps in a row verified at most {longest} draft tokens per request where k = "
            f"{chosen} was chosen. The controller's choices are not honoured (a vLLM that caps "
            "or recomputes k), so its speed is not what it models; report it with your vLLM "
            "version"
        )
