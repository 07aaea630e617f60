"""Drafts looked up in text a GRPO group has already produced: plain Python, no vLLM.

A group is every sequence answering one prompt: the G samples running side by side and
the finished rollouts of earlier iterations. Their texts overlap (restated quantities,
equations, the answer format), so the tokens that followed the current context
elsewhere in the group are likely to follow it here.

`GroupIndex` maps each n-gram (n = 1..max_match) of the group's sequences to where it
occurred. A draft starts from the longest suffix of the context seen before and follows
the occurrences: at each depth the most common next token wins and the occurrences that
disagree drop out. Its confidence at depth j is agreeing / (occurrences + 1): the share
of earlier continuations that went this way, shrunk toward 0 for small counts. At
temperature 1 that share estimates the target's probability of the token, which is the
chance that verification accepts it (a one-hot draft q is accepted with probability
p(token)); docs/benchmarks/group_drafts.md holds how well it was calibrated.

Memory is bounded in indexed positions: `GroupHistory` keeps the groups under a budget,
dropping the least recently used first; `approx_bytes` reports what they take.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from operator import itemgetter


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    confidence: list[float]  # cumulative: P(tokens[: j + 1] all accepted), non-increasing
    match_len: int = 0


NO_DRAFT = Draft([], [])

# CPython memory per occurrence (one n-gram at one position), keys and sequences included,
# measured with tracemalloc: 161 bytes on repetitive text, 177 when every n-gram is new
# (tests/test_group_drafts.py holds the estimate to within 30%).
OCCURRENCE_BYTES = 170
_SHIFT = 32  # an occurrence is seq_id << _SHIFT | position
_MASK = (1 << _SHIFT) - 1
_count = itemgetter(1)


class GroupIndex:
    """n-gram occurrences over the sequences of one group."""

    def __init__(self, max_match: int = 4, max_occurrences: int = 64):
        self.max_match = max_match
        self.max_occurrences = max_occurrences  # the most recent ones per n-gram are followed
        self.sequences: list[list[int]] = []
        self.versions: list[float] = []  # policy version that wrote each sequence
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.positions = 0
        self.occurrences = 0

    def add_sequence(self, tokens=(), version: float = 0) -> int:
        self.sequences.append([])
        self.versions.append(version)
        seq_id = len(self.sequences) - 1
        self.extend(seq_id, tokens)
        return seq_id

    def extend(self, seq_id: int, tokens) -> None:
        """Append tokens to a sequence and index the n-grams that now have a next token."""
        seq = self.sequences[seq_id]
        table, cap = self.table, self.max_occurrences
        base = seq_id << _SHIFT
        for token in tokens:
            end = len(seq)
            seq.append(token)
            for n in range(1, min(self.max_match, end) + 1):
                key = tuple(seq[end - n : end])
                occ = table.get(key)
                if occ is None:
                    table[key] = [base | end]
                else:
                    occ.append(base | end)
                    if len(occ) > 2 * cap:
                        self.occurrences -= len(occ) - cap
                        del occ[:-cap]
                self.occurrences += 1
            self.positions += 1

    def draft(self, context, max_len: int, min_confidence: float = 0.0) -> Draft:
        """Up to max_len tokens likely to follow `context` (its last max_match tokens are
        used), stopping where the cumulative confidence falls below min_confidence."""
        if max_len <= 0:
            return NO_DRAFT
        context = list(context[-self.max_match :])
        for n in range(len(context), 0, -1):
            occ = self.table.get(tuple(context[-n:]))
            if occ:
                return self._follow(occ[-self.max_occurrences :], max_len, min_confidence, n)
        return NO_DRAFT

    def _follow(self, occ, max_len, min_confidence, match_len) -> Draft:
        total = len(occ) + 1
        need = min_confidence * total  # agreeing occurrences a token needs
        if len(occ) < need:
            return NO_DRAFT
        seqs = self.sequences
        live = [(seqs[o >> _SHIFT], o & _MASK) for o in occ]  # (sequence, next position)
        tokens, confidence = [], []
        for _ in range(max_len):
            counts: dict[int, int] = {}
            for seq, p in live:
                if p < len(seq):
                    counts[seq[p]] = counts.get(seq[p], 0) + 1
            if not counts:
                break
            token, agree = max(counts.items(), key=_count)
            if agree < need:
                break
            tokens.append(token)
            confidence.append(agree / total)
            live = [(seq, p + 1) for seq, p in live if p < len(seq) and seq[p] == token]
        return Draft(tokens, confidence, match_len)

    def drop_versions_before(self, version: int, in_use=frozenset()) -> dict[int, int]:
        """Forget sequences written by a policy older than `version`, except those whose
        ids are `in_use` (still being extended), and re-index the rest. Returns the new id
        of each kept sequence, by its old id."""
        kept = [i for i, v in enumerate(self.versions) if v >= version or i in in_use]
        if len(kept) == len(self.sequences):
            return {i: i for i in kept}
        sequences, versions = self.sequences, self.versions
        self.sequences, self.versions, self.table = [], [], {}
        self.positions = self.occurrences = 0
        return {i: self.add_sequence(sequences[i], versions[i]) for i in kept}

    @property
    def approx_bytes(self) -> int:
        return self.occurrences * OCCURRENCE_BYTES


class GroupHistory:
    """One GroupIndex per prompt, within a budget of indexed positions (least recently
    used groups go first; a group in use is never dropped)."""

    def __init__(self, max_positions: int, max_match: int = 4, max_occurrences: int = 64):
        self.max_positions = max_positions
        self.max_match, self.max_occurrences = max_match, max_occurrences
        self.groups: OrderedDict[tuple[int, ...], GroupIndex] = OrderedDict()
        self.evicted_groups = 0

    def group(self, prompt: tuple[int, ...]) -> GroupIndex:
        index = self.groups.get(prompt)
        if index is None:
            index = self.groups[prompt] = GroupIndex(self.max_match, self.max_occurrences)
        self.groups.move_to_end(prompt)
        return index

    @property
    def positions(self) -> int:
        return sum(g.positions for g in self.groups.values())

    @property
    def approx_bytes(self) -> int:
        return sum(g.approx_bytes for g in self.groups.values())

    def evict(self, in_use: set) -> None:
        total = self.positions
        for prompt in list(self.groups):
            if total <= self.max_positions:
                break
            if prompt in in_use:
                continue
            total -= self.groups.pop(prompt).positions
            self.evicted_groups += 1

    def drop_versions_before(self, version: int, in_use: dict) -> dict:
        """`GroupIndex.drop_versions_before` for every group; `in_use` holds the ids in use
        by prompt, and the new ids come back by prompt."""
        return {
            prompt: index.drop_versions_before(version, in_use.get(prompt, ()))
            for prompt, index in self.groups.items()
        }
