"""The EAGLE distillation loss: regress the next hidden state, match the next-token
distribution; optionally also the acceptance of sampled drafting; optionally unrolled
over several draft steps (training-time test).

With sampled drafting (the draft samples x ~ q and verification accepts it with
probability min(1, p(x)/q(x))) a draft token is accepted with probability
sum_x min(p(x), q(x)) = 1 - TV(p, q), at the rollout temperature. `tv_weight` adds
TV(p, q) to the loss, p over the target's whole vocabulary (a reduced draft vocabulary
forgoes the mass outside it). Soft cross-entropy alone aims q at p too; on SmolLM2 the
added term measured no better (docs/benchmarks/sampled_drafts.md), so it is off by
default."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from grpo_specdec.draft.capture import Sequence
from grpo_specdec.draft.head_model import DraftHead


@dataclass
class DraftBatch:
    """Right-padded sequences. Draft step j (1-based) from origin t reads token x_{t+j}
    and predicts the target's distribution at t+j; step 1 reads the target's features
    at t, later steps the draft's own from the step before."""

    ids: torch.Tensor  # [B,W]
    hidden: torch.Tensor  # [B,W,H] the target's last-layer (post-norm) hidden states
    aux: torch.Tensor | None  # [B,W,A*H] its auxiliary layers, for an EAGLE-3 head
    starts: torch.Tensor  # [B] the first origin drafted from: the last prompt position
    ends: torch.Tensor  # [B] the last position of each sequence

    def origins(self, step: int) -> torch.Tensor:
        """[B,W-1] bool: the origins whose step `step` exists (its token inside the
        sequence) and drafts a response token (drafting starts after prefill, at the last
        prompt position)."""
        t = torch.arange(self.ids.shape[1] - 1, device=self.ids.device)
        return (t >= self.starts[:, None]) & (t + step <= self.ends[:, None])

    def shifted(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """x at t + step for each origin t, zero past the end: [B,W-1,...]."""
        out = torch.zeros_like(x[:, 1:])
        out[:, : x.shape[1] - step] = x[:, step:]
        return out

    def step_positions(self, step: int) -> torch.Tensor:
        t = torch.arange(self.ids.shape[1] - 1, device=self.ids.device)
        return (t + step - 1).expand(len(self.ids), -1)

    # The first, teacher-forced step, as the names the evaluation code reads.
    @property
    def next_ids(self) -> torch.Tensor:
        return self.ids[:, 1:]

    @property
    def hidden_in(self) -> torch.Tensor:
        return self.hidden[:, :-1]

    @property
    def hidden_out(self) -> torch.Tensor:
        return self.hidden[:, 1:]

    @property
    def positions(self) -> torch.Tensor:
        return self.step_positions(1)

    @property
    def mask(self) -> torch.Tensor:
        return self.origins(1)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


def make_batch(seqs: list[Sequence], device: torch.device | str = "cpu") -> DraftBatch:
    """The batch on `device` (the head's), hidden states in the dtype they arrived in."""
    width = max(len(s.token_ids) for s in seqs)
    first = seqs[0]
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)

    def padded(rows: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(len(seqs), width, rows[0].shape[-1], dtype=rows[0].dtype, device=device)
        for b, row in enumerate(rows):
            out[b, : len(row)] = row.to(device)
        return out

    for b, s in enumerate(seqs):
        ids[b, : len(s.token_ids)] = torch.tensor(s.token_ids, device=device)
    aux = None
    if first.aux is not None:
        if any(s.aux is None for s in seqs):
            raise ValueError("draft batch: some sequences carry auxiliary hidden states, some not")
        aux = padded([s.aux for s in seqs])
    lengths = torch.tensor([len(s.token_ids) for s in seqs], device=device)
    starts = torch.tensor([max(s.prompt_len - 1, 0) for s in seqs], device=device)
    return DraftBatch(ids, padded([s.hidden for s in seqs]), aux, starts, lengths - 1)


# Rows of [rows, vocabulary] logits the loss holds at once: 2^26 elements (256 MiB in
# float32) whatever the vocabulary; at 152k entries (Qwen2) one chunk is 441 rows.
LOGIT_ELEMENTS = 1 << 26


def logit_rows(vocab_size: int, elements: int = LOGIT_ELEMENTS) -> int:
    return max(1, elements // vocab_size)


def acceptance(head: DraftHead, draft_logits, target_hidden, temperature: float) -> dict:
    """Per row, at `temperature`: the chance a sampled draft is accepted, sum(min(p, q));
    a greedy draft's, p(argmax q); and the ceiling of greedy drafting, max p."""
    p = (head.full_target_logits(target_hidden) / temperature).softmax(-1)
    q = (draft_logits / temperature).softmax(-1)
    p_draft = head.draft_columns(p)
    return {
        "sampled": torch.minimum(p_draft, q).sum(-1),
        "greedy": p_draft.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1),
        "ceiling": p.max(-1).values,
    }


def _vocabulary_terms(head: DraftHead, pred, tgt, tv_weight: float, temperature: float):
    """Sums over rows of the soft cross-entropy, and of the sampled acceptance where
    `tv_weight` asks for it; the count of rows whose argmax agrees with the target's."""
    draft_logits = head.draft_logits(pred)
    with torch.no_grad():
        target_logits = head.target_logits(tgt)
        target_probs = target_logits.softmax(-1)
        agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).sum()
    ce = -(target_probs * draft_logits.log_softmax(-1)).sum()
    accepted = (
        acceptance(head, draft_logits, tgt, temperature)["sampled"].sum()
        if tv_weight
        else ce.new_zeros(())
    )
    return ce, accepted, agree


# Later unrolled steps count less, as EAGLE-3 and SpecForge weight them: a draft rarely
# gets to use them unless the earlier ones were accepted.
STEP_DECAY = 0.8


def eagle_loss(
    head: DraftHead,
    batch: DraftBatch,
    hidden_weight: float = 2.0,
    ce_weight: float = 0.1,
    tv_weight: float = 0.0,
    temperature: float = 1.0,
    rows_per_chunk: int | None = None,
    steps: int = 1,
) -> tuple[torch.Tensor, dict]:
    """The loss over the batch's response positions, the draft unrolled `steps` steps on
    its own features (training-time test; 1: teacher-forced). Step j's terms weigh
    STEP_DECAY^(j-1); the hidden-state term applies to heads that regress onto the
    target's hidden states. The vocabulary-sized terms run over `rows_per_chunk` rows at
    a time (default: `logit_rows` of the head's vocabulary), each chunk's logits
    recomputed in the backward pass instead of kept, so a step holds one chunk's
    [rows, vocabulary] tensors whatever the batch."""
    rows = rows_per_chunk or logit_rows(head.vocab_size)
    features = head.first_hidden(batch.hidden, batch.aux)[:, :-1]
    earlier = []
    loss = features.new_zeros(())
    stats: dict[str, float] = {}
    for step in range(1, steps + 1):
        qkv = head.step_qkv(batch.shifted(batch.ids, step), features, batch.step_positions(step))
        features = head.finish_step(qkv, earlier)
        earlier.append(qkv)
        m = batch.origins(step)
        pred = features[m]
        tgt = batch.shifted(batch.hidden, step)[m].to(pred.dtype)
        if not len(pred):
            break
        l_hidden = F.smooth_l1_loss(pred, tgt) if head.regresses_hidden else pred.new_zeros(())
        ce = accepted = pred.new_zeros(())
        agree = 0
        for start in range(0, len(pred), rows):
            chunk = (pred[start : start + rows], tgt[start : start + rows], tv_weight, temperature)
            c, a, g = (
                checkpoint(_vocabulary_terms, head, *chunk, use_reentrant=False)
                if len(pred) > rows
                else _vocabulary_terms(head, *chunk)
            )
            ce, accepted, agree = ce + c, accepted + a, agree + int(g)
        n = len(pred)
        step_loss = hidden_weight * l_hidden + ce_weight * ce / n
        if tv_weight:
            step_loss = step_loss + tv_weight * (1.0 - accepted / n)
        loss = loss + STEP_DECAY ** (step - 1) * step_loss
        suffix = "" if step == 1 else f"_{step}"
        stats |= {f"hidden_loss{suffix}": l_hidden.item(), f"ce_loss{suffix}": (ce / n).item()}
        stats[f"top1{suffix}"] = agree / n
        if tv_weight:
            stats[f"sampled_acceptance{suffix}"] = (accepted / n).item()
    return loss, {"loss": loss.item(), **stats}
