"""Each step, which draft tokens to verify: the model draft's, or the group's text's.

Plain Python, testable without vLLM; `patches/features/group_drafts_v0_32.py` calls it once
per engine step with the batch's requests (prompt and output so far) and the drafts the
engine's own drafter made (EAGLE's k tokens per request, or none).

Per request, the group's candidate comes from `GroupIndex` over the outputs of every
request with the same prompt: its running siblings, and finished ones kept in the
history (bounded in positions; a policy swap ages out the versions past
`history_versions`, but not the sequences still running). Its confidence estimates each
token's chance of acceptance; the model draft's comes from its measured per-position
acceptance. A request gets the source with more expected accepted tokens. Group tokens cost
no draft time, only verification, so they are priced one by one with the latency model: the
most confident first, for as long as each raises the step's goodput (tokens per
millisecond) - many when the step is memory-bound, only near-certain ones when it is
compute-bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from vllm_plugin.acceptance import AcceptanceEstimator
from vllm_plugin.controller import LatencyModel
from vllm_plugin.group.suffix_index import Draft, GroupHistory

MODEL, GROUP = "model", "group"


@dataclass
class SourceStats:
    steps: int = 0  # request-steps that verified this source's drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def observe(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted


class ConfidenceCalibration:
    """Measured acceptance of group tokens, per (match length, depth, raw confidence tenth).

    The index's raw confidence is overconfident where evidence is thin (a context seen once
    scores 0.5; measured acceptance 0.16-0.47 by match length, docs/benchmarks/
    group_drafts.md), so each token's chance is learnt from outcomes, starting from raw
    squared (what those measurements follow) and fading old evidence as the policy moves."""

    def __init__(self, max_match: int, k_max: int, prior_weight: float = 4.0, decay: float = 0.999):
        shape = (max_match + 1, k_max, 11)
        self.tried, self.accepted = np.zeros(shape), np.zeros(shape)
        self.max_match, self.prior_weight, self.decay = max_match, prior_weight, decay

    def keys(self, draft: Draft) -> list[tuple[int, int, int]]:
        m = min(draft.match_len, self.max_match)
        return [(m, j, int(c * 10)) for j, c in enumerate(draft.confidence)]

    def chances(self, draft: Draft) -> list[float]:
        """P(tokens[: j + 1] all accepted) for each j, non-increasing."""
        out, previous = [], 1.0
        for key, raw in zip(self.keys(draft), draft.confidence):
            w = self.prior_weight
            p = (self.accepted[key] + w * raw * raw) / (self.tried[key] + w)
            previous = min(previous, float(p))
            out.append(previous)
        return out

    def step(self) -> None:
        self.tried *= self.decay
        self.accepted *= self.decay

    def observe(self, keys, accepted: int) -> None:
        for j, key in enumerate(keys):
            self.tried[key] += 1
            self.accepted[key] += j < accepted


class PendingDraft(NamedTuple):
    """A draft sent to verification, until the request's next output shows what was kept."""

    source: str  # MODEL or GROUP
    drafted: int
    output_len: int  # the request's output length when it was drafted
    calibration_keys: list  # of each group token; none for the model's


@dataclass
class _Tracked:
    prompt: tuple[int, ...]
    seq_id: int
    indexed: int = 0  # output tokens already in the index
    pending: PendingDraft | None = None


# The policy weights' version, stamped on the policy model by whatever loads it (the
# `grpo_shm` transfer backend) and read by the drafter each step: rollouts of older
# policies age out, whoever drives the update.
POLICY_VERSION_ATTR = "_grpo_policy_version"


def stamp_policy_version(model, version: int) -> None:
    setattr(model, POLICY_VERSION_ATTR, version)


def policy_version(model) -> int:
    return getattr(model, POLICY_VERSION_ATTR, 0)


@dataclass
class GroupDrafterStats:
    sources: dict[str, SourceStats] = field(
        default_factory=lambda: {MODEL: SourceStats(), GROUP: SourceStats()}
    )
    history_positions: int = 0
    history_bytes: int = 0
    history_groups: int = 0
    evicted_groups: int = 0
    policy_version: int = 0  # of the policy weights the history was last aged for

    def to_dict(self) -> dict:
        return asdict(self)


class Proposal(NamedTuple):
    drafts: list[list[int]]  # per request, to verify next step
    sources: list[str]  # MODEL or GROUP, per request
    # Per request, the model draft's tokens that a group draft replaced: the model draft
    # ran for nothing there, which is what its scheduler should price.
    model_discarded: list[int]


class GroupDrafter:
    def __init__(
        self,
        latency: LatencyModel,
        k_max: int,
        *,
        max_match: int = 4,
        history_positions: int = 300_000,
        history_versions: int = 1,
        min_confidence: float = 0.05,
        model_acceptance: AcceptanceEstimator | None = None,
    ):
        self.latency, self.k_max = latency, k_max
        self.max_match, self.min_confidence = max_match, min_confidence
        self.history_versions = history_versions
        self.history_positions = history_positions
        self.model_acceptance = model_acceptance or AcceptanceEstimator(k_max)
        self.version = 0  # policy swaps seen; sequences are tagged with it
        self.policy_version = 0  # the version of the policy weights last seen
        self.reset()

    def reset(self) -> None:
        """Forget every sequence, the calibration and the counts (benchmarks compare
        configurations from a fresh state)."""
        self.history = GroupHistory(self.history_positions, self.max_match)
        self.calibration = ConfidenceCalibration(self.max_match, self.k_max)
        self.tracked: dict[str, _Tracked] = {}
        self.stats = GroupDrafterStats()

    def _add_sequence(self, prompt: tuple[int, ...], tokens=()) -> int:
        group = self.history.group(prompt)
        if group.positions == 0:
            group.add_sequence(prompt, version=math.inf)  # the prompt never ages out
        # Each answer starts with the prompt's end, so matches reach across the boundary.
        return group.add_sequence([*prompt[-self.max_match :], *tokens], self.version)

    def add_history(self, prompt, outputs) -> None:
        """Finished answers to `prompt` produced elsewhere (another engine, an earlier run)."""
        for tokens in outputs:
            self._add_sequence(tuple(prompt), tokens)
        self.history.evict({t.prompt for t in self.tracked.values()})

    # ---- what happened --------------------------------------------------------------
    def _follow(self, req_id: str, prompt, output) -> _Tracked:
        t = self.tracked.get(req_id)
        if t is None:
            key = tuple(prompt)
            t = self.tracked[req_id] = _Tracked(key, self._add_sequence(key))
        pending = t.pending
        if pending is not None:
            accepted = min(max(len(output) - pending.output_len - 1, 0), pending.drafted)
            self.stats.sources[pending.source].observe(pending.drafted, accepted)
            if pending.source == MODEL:
                self.model_acceptance.observe(pending.drafted, accepted)
            else:
                self.calibration.observe(pending.calibration_keys, accepted)
            t.pending = None
        if len(output) > t.indexed:
            self.history.group(t.prompt).extend(t.seq_id, output[t.indexed :])
            t.indexed = len(output)
        return t

    def forget(self, alive: set[str]) -> None:
        """Stop following requests that finished (their text stays in the history)."""
        for req_id in [r for r in self.tracked if r not in alive]:
            del self.tracked[req_id]

    def follow_policy(self, version: int) -> None:
        """Called each step with the version of the policy weights the engine serves."""
        if version != self.policy_version:
            self.policy_version = version
            self.new_policy()

    def new_policy(self) -> None:
        """The engine now serves new policy weights: rollouts older than the last
        `history_versions` swaps age out."""
        self.version += 1
        running: dict[tuple[int, ...], set[int]] = {}
        for t in self.tracked.values():
            running.setdefault(t.prompt, set()).add(t.seq_id)
        # Requests still running keep their sequences (and drafts still being verified),
        # whichever policy began them; the re-indexed history renumbers them.
        new_ids = self.history.drop_versions_before(self.version - self.history_versions, running)
        for t in self.tracked.values():
            t.seq_id = new_ids[t.prompt][t.seq_id]

    # ---- what to verify next ----------------------------------------------------------
    def propose(self, rows, model_drafts: list[list[int]]) -> Proposal:
        """rows: (request id, prompt ids, output ids) in batch order; model_drafts: the
        engine drafter's tokens per row (all of one length k, or empty)."""
        k_model = max((len(d) for d in model_drafts), default=0)
        batch = len(rows)
        # Verified tokens are priced at the batch's mean context, as the controller prices k.
        mean_context = sum(len(p) + len(o) for _, p, o in rows) / batch if rows else None
        self.calibration.step()
        model_expected = float(self.model_acceptance.expected_tokens()[k_model]) - 1.0
        # No group token whose chance is below what one more verified token costs can pay;
        # the index stops its drafts there (raw confidence over-states the chance).
        floor = max(
            self.min_confidence, self._marginal_price(batch, k_model, model_expected, mean_context)
        )
        group_drafts = []
        for req_id, prompt, output in rows:
            t = self._follow(req_id, prompt, output)
            context = list(prompt[-self.max_match :]) + list(output[-self.max_match :])
            index = self.history.group(t.prompt)
            group_drafts.append(index.draft(context, self.k_max, floor))
        self.history.evict({t.prompt for t in self.tracked.values()})

        chances = [self.calibration.chances(g) for g in group_drafts]
        use_group = [sum(c) > model_expected for c in chances]
        # Price the chosen group tokens, most likely accepted first.
        candidates = sorted(
            (-c, depth, row)
            for row, cs in enumerate(chances)
            if use_group[row]
            for depth, c in enumerate(cs)
        )
        model_rows = sum(1 for u, d in zip(use_group, model_drafts) if not u and d)
        base_tokens = batch + k_model * model_rows
        base_expected = batch + model_expected * model_rows
        gain = np.concatenate([[0.0], np.cumsum([-c for c, _, _ in candidates])])
        tokens = base_tokens + np.arange(len(candidates) + 1)
        speculating = (np.arange(len(candidates) + 1) > 0) | (model_rows > 0)
        step_ms = (
            self.latency.target(tokens)
            + speculating * float(self.latency.speculation(batch))
            + k_model * float(self.latency.draft(batch))
            + self.latency.attention_ms(batch, tokens, mean_context)
        )
        keep = int(np.argmax((base_expected + gain) / step_ms))
        length = [0] * batch
        for _, depth, row in candidates[:keep]:
            length[row] = max(length[row], depth + 1)

        out = Proposal([], [], [])
        for row, (req_id, _, output) in enumerate(rows):
            if use_group[row] and length[row]:
                draft, source = group_drafts[row].tokens[: length[row]], GROUP
                keys = self.calibration.keys(group_drafts[row])[: length[row]]
            else:
                draft, source, keys = list(model_drafts[row]), MODEL, []
            out.drafts.append(draft)
            out.sources.append(source)
            out.model_discarded.append(len(model_drafts[row]) if source == GROUP else 0)
            if draft:
                self.tracked[req_id].pending = PendingDraft(source, len(draft), len(output), keys)
        return out

    def _marginal_price(
        self, batch: int, k_model: int, model_expected: float, context: float | None
    ) -> float:
        """The chance of acceptance at which one more verified token leaves the step's
        goodput unchanged, with every request on the model draft."""
        tokens = batch * (1 + k_model)
        step_ms = float(self.latency.step_ms(batch, k_model, context))
        extra_ms = float(
            self.latency.target(tokens + 1)
            - self.latency.target(tokens)
            + self.latency.attention_ms(0, 1, context)
        )
        return batch * (1 + model_expected) * extra_ms / step_ms

    def snapshot(self) -> dict:
        s = self.stats
        s.history_positions = self.history.positions
        s.history_bytes = self.history.approx_bytes
        s.history_groups = len(self.history.groups)
        s.evicted_groups = self.history.evicted_groups
        s.policy_version = self.policy_version
        return s.to_dict()
