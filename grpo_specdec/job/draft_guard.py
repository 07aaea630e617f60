"""The driver's guard over the draft heads the engines serve, once per iteration.

An engine that rolls its draft back (`draft_watch.DraftWatch`) says so in its rollout; the
draft learner must go back with it, or it would train on from the collapsed head and
publish its descendants. With several engines each one's own watch is off (each would judge
its share of the drafts and go back alone, and engines that disagree on the draft's version
stop the job): here the engines' drafts are pooled to judge the head they all serve, and a
collapsed one is replaced in every engine at once. A slow decline of acceptance, which no
rollback catches, is said (`draft_watch.SlowDecline`).
"""

from __future__ import annotations

from collections.abc import Callable

from grpo_specdec.draft_watch import DraftWatch, Head, SlowDecline
from grpo_specdec.job.roles import Published, Roles
from grpo_specdec.job.rollout_worker import Rollout


class DraftGuard:
    def __init__(self, roles: Roles, log: Callable[[str], None] = print):
        """For roles just started: the head they serve now is the one judged first."""
        self.roles, self.log = roles, log
        self.decline = SlowDecline()
        served = roles.weights.served.get("draft")
        several = len(roles.rollouts) > 1
        self.judge = DraftWatch(Head(*served)) if served and several else None

    def rolled_out(self, rollout: Rollout, running: int) -> dict:
        """Iteration `running`'s rollout judged: its draft rollbacks (the engines' and, with
        several engines, the pooled judge's) reach the draft learner. -> record fields."""
        if self.judge is not None:
            self._judge(rollout, running)
        for rollback in rollout.draft_rollbacks:
            returned = self.roles.return_draft_to(rollback.to)
            self.log(
                f"iteration {running}: {rollback.describe()}; the draft learner "
                + (
                    f"learns on from version {rollback.to}"
                    if returned
                    else f"no longer holds version {rollback.to} and learns on from its newest"
                )
            )
        first = rollout.spec.get("per_position_acceptance") or []
        decline = self.decline.observe(first[0]) if first else None
        if decline is None:
            return {}
        self.log(f"iteration {running}: {decline}")
        return {"draft_decline": decline}

    def published(self, published: Published) -> None:
        """A new head the engines took is the one judged from the next rollout on."""
        if self.judge is not None and "draft" in published.sync:
            self.judge.swapped(Head(*self.roles.weights.served["draft"]))

    def _judge(self, rollout: Rollout, running: int) -> None:
        """The engines' drafts of this rollout, pooled, judge the head they served; a head
        that collapsed is replaced in every engine by the one before it (the rollback joins
        the rollout's, which the learner then follows)."""
        judge = self.judge
        spec = rollout.spec
        rollback = judge.observe(spec.get("draft_tokens", 0), spec.get("accepted_tokens", 0))
        if rollback is None:
            return
        head = judge.fallback
        _, why = self.roles.weights.draft(head.state_dict(), head.version, head.metadata, running)
        if why is not None:
            self.log(
                f"iteration {running}: draft head version {rollback.version} collapsed "
                f"({rollback.rate:.3f} of its drafts accepted against {rollback.previous_rate:.3f}), "
                f"and the engines refused version {rollback.to} back ({why}): they serve it still"
            )
            return
        judge.rolled_back()
        rollout.draft_rollbacks.append(rollback)
