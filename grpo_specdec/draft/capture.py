"""The target forward that GRPO already runs, returning hidden states for the draft too.

One forward over prompt + response gives the policy's log-probs (for the GRPO loss), its
last-layer post-norm hidden states (an EAGLE draft's input, and the draft's targets) and,
for an EAGLE-3 draft, the auxiliary layers it reads, so draft training data costs no extra
forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Sequence:
    """One rollout sample as the draft learner sees it."""

    token_ids: list[int]  # prompt + response
    prompt_len: int
    hidden: torch.Tensor | None = None  # [len(token_ids), H], filled by capture
    aux: torch.Tensor | None = None  # [len(token_ids), A*H]: an EAGLE-3 head's layers


def pad_batch(seqs: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B,T] and attention mask [B,T]."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


@contextmanager
def _recording(model: nn.Module, aux_layers: tuple[int, ...]):
    """Records, during one forward of a HF causal LM, its final norm's output and the
    hidden states at vLLM's auxiliary layer ids: id 0 is the embedding's output, id i the
    output of decoder layer i - 1 (residual included, before any norm), as vLLM's models
    collect them."""
    decoder = model.get_decoder()
    layers = len(decoder.layers)
    if not all(0 <= i <= layers for i in aux_layers):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {list(aux_layers)}: the target has {layers} "
            f"layers, so ids run 0..{layers}"
        )
    seen: dict = {}

    def keep(key):
        def hook(_module, _args, out):
            seen[key] = out[0] if isinstance(out, tuple) else out

        return hook

    modules = {"last": decoder.norm}
    modules |= {i: decoder.embed_tokens if i == 0 else decoder.layers[i - 1] for i in aux_layers}
    handles = [module.register_forward_hook(keep(key)) for key, module in modules.items()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def forward_with_hidden(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, aux_layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(last-layer post-norm hidden states [B,T,H], logits [B,T,V], the auxiliary layers
    concatenated in layer order [B,T,A*H] or None) of a HF causal LM, through the model's
    own forward (the one FSDP gathers the embedding, final norm and lm_head for)."""
    with _recording(model, aux_layers) as seen:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    aux = torch.cat([seen[i] for i in sorted(aux_layers)], -1) if aux_layers else None
    return seen["last"], logits, aux


@torch.no_grad()
def capture_hidden(
    model: nn.Module,
    seqs: list[Sequence],
    batch_size: int = 8,
    aux_layers: tuple[int, ...] = (),
) -> list[Sequence]:
    """Fill `hidden` (and `aux` for `aux_layers`) of each sequence, as float32 on CPU."""
    device = next(model.parameters()).device
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        ids, mask = pad_batch([s.token_ids for s in chunk])
        hidden, _, aux = forward_with_hidden(model, ids.to(device), mask.to(device), aux_layers)
        for row, s in enumerate(chunk):
            n = len(s.token_ids)
            s.hidden = hidden[row, :n].float().cpu()
            s.aux = aux[row, :n].float().cpu() if aux is not None else None
    return seqs
