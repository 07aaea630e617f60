"""The EAGLE distillation loss: regress the next hidden state, match the next-token
distribution; optionally also the acceptance of sampled drafting.

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
from grpo_specdec.draft.head import DraftHead


@dataclass
class DraftBatch:
    """Teacher-forced draft inputs: at index i the draft sees (x_{i+1}, h_i) and predicts h_{i+1}."""

    next_ids: torch.Tensor  # [B,T-1]
    hidden_in: torch.Tensor  # [B,T-1,H]
    hidden_out: torch.Tensor  # [B,T-1,H]
    positions: torch.Tensor  # [B,T-1]
    mask: torch.Tensor  # [B,T-1] bool: positions whose next token belongs to the response

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


def make_batch(seqs: list[Sequence], device: torch.device | str = "cpu") -> DraftBatch:
    """The batch on `device` (the head's), hidden states in the dtype they arrived in."""
    width = max(len(s.token_ids) for s in seqs)
    first = seqs[0].hidden
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    hidden = torch.zeros(len(seqs), width, first.shape[-1], dtype=first.dtype, device=device)
    mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool, device=device)
    for b, s in enumerate(seqs):
        n = len(s.token_ids)
        ids[b, :n] = torch.tensor(s.token_ids, device=device)
        hidden[b, :n] = s.hidden.to(device)
        # Drafting starts after prefill, at the last prompt position (i = prompt_len - 1)
        # and needs h_{i+1}, so i runs up to n - 2. The prompt itself is masked.
        mask[b, max(s.prompt_len - 1, 0) : n - 1] = True
    positions = torch.arange(width - 1, device=device).expand(len(seqs), -1)
    return DraftBatch(ids[:, 1:], hidden[:, :-1], hidden[:, 1:], positions, mask)


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


def eagle_loss(
    head: DraftHead,
    batch: DraftBatch,
    hidden_weight: float = 2.0,
    ce_weight: float = 0.1,
    tv_weight: float = 0.0,
    temperature: float = 1.0,
    rows_per_chunk: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """The loss over the batch's response positions. The vocabulary-sized terms run over
    `rows_per_chunk` rows at a time (default: `logit_rows` of the head's vocabulary), each
    chunk's logits recomputed in the backward pass instead of kept, so a step holds one
    chunk's [rows, vocabulary] tensors whatever the batch."""
    feats = head(batch.next_ids, batch.hidden_in, batch.positions)
    m = batch.mask
    pred, tgt = feats[m], batch.hidden_out[m].to(feats.dtype)
    l_hidden = F.smooth_l1_loss(pred, tgt)
    rows = rows_per_chunk or logit_rows(head.vocab_size)
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
    n = max(len(pred), 1)
    l_ce = ce / n
    loss = hidden_weight * l_hidden + ce_weight * l_ce
    stats = {}
    if tv_weight:
        loss = loss + tv_weight * (1.0 - accepted / n)
        stats["sampled_acceptance"] = (accepted / n).item()
    return loss, {
        "loss": loss.item(),
        "hidden_loss": l_hidden.item(),
        "ce_loss": l_ce.item(),
        "top1": agree / n,
        **stats,
    }
