"""The target forward that GRPO already runs, returning hidden states for the draft too.

One forward over prompt + response gives the policy's log-probs (for the GRPO loss) and
its last-layer post-norm hidden states (the EAGLE draft's input and regression target),
so draft training data costs no extra forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Sequence:
    """One rollout sample as the draft learner sees it."""

    token_ids: list[int]  # prompt + response
    prompt_len: int
    hidden: torch.Tensor | None = None  # [len(token_ids), H], filled by capture


def pad_batch(seqs: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B,T] and attention mask [B,T]."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def forward_with_hidden(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(last-layer post-norm hidden states [B,T,H], logits [B,T,V]) of a HF causal LM."""
    out = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)
    hidden = out.last_hidden_state
    return hidden, model.get_output_embeddings()(hidden)


@torch.no_grad()
def capture_hidden(model: nn.Module, seqs: list[Sequence], batch_size: int = 8) -> list[Sequence]:
    """Fill `hidden` for each sequence (stored as float32 on CPU)."""
    device = next(model.parameters()).device
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        ids, mask = pad_batch([s.token_ids for s in chunk])
        hidden, _ = forward_with_hidden(model, ids.to(device), mask.to(device))
        for s, h in zip(chunk, hidden, strict=True):
            s.hidden = h[: len(s.token_ids)].float().cpu()
    return seqs
