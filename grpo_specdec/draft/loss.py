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


def make_batch(seqs: list[Sequence]) -> DraftBatch:
    width = max(len(s.token_ids) for s in seqs)
    hsize = seqs[0].hidden.shape[-1]
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    hidden = torch.zeros(len(seqs), width, hsize)
    mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for b, s in enumerate(seqs):
        n = len(s.token_ids)
        ids[b, :n] = torch.tensor(s.token_ids)
        hidden[b, :n] = s.hidden
        # Drafting starts after prefill, at the last prompt position (i = prompt_len - 1)
        # and needs h_{i+1}, so i runs up to n - 2. The prompt itself is masked.
        mask[b, max(s.prompt_len - 1, 0) : n - 1] = True
    positions = torch.arange(width - 1).expand(len(seqs), -1)
    return DraftBatch(ids[:, 1:], hidden[:, :-1], hidden[:, 1:], positions, mask)


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


def eagle_loss(
    head: DraftHead,
    batch: DraftBatch,
    hidden_weight: float = 2.0,
    ce_weight: float = 0.1,
    tv_weight: float = 0.0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    feats = head(batch.next_ids, batch.hidden_in, batch.positions)
    m = batch.mask
    pred, tgt = feats[m], batch.hidden_out[m].to(feats.dtype)
    l_hidden = F.smooth_l1_loss(pred, tgt)
    draft_logits = head.draft_logits(pred)
    with torch.no_grad():
        target_logits = head.target_logits(tgt)
        target_probs = target_logits.softmax(-1)
    l_ce = -(target_probs * draft_logits.log_softmax(-1)).sum(-1).mean()
    loss = hidden_weight * l_hidden + ce_weight * l_ce
    stats = {}
    if tv_weight:
        accepted = acceptance(head, draft_logits, tgt, temperature)["sampled"].mean()
        loss = loss + tv_weight * (1.0 - accepted)
        stats["sampled_acceptance"] = accepted.item()
    top1 = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return loss, {
        "loss": loss.item(),
        "hidden_loss": l_hidden.item(),
        "ce_loss": l_ce.item(),
        "top1": top1.item(),
        **stats,
    }
