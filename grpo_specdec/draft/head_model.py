"""EAGLE draft heads that compute what vLLM's draft models compute, in vLLM's formats.

`EagleHead` is vLLM's `EagleLlamaForCausalLM`. Draft step at position i:
f_i = layer(fc(concat(embed(x_{i+1}), h_i))), where h_i is the target's last-layer
(post-norm) hidden state and the single decoder layer has no input norm; the next-token
logits are the target's lm_head applied to f_i, with no final norm.

`ReducedVocabHead` is vLLM's `LlamaForCausalLMEagle3` with one hidden state in (no
auxiliary layers): the layer attends over concat(norm(embed(x_{i+1})), norm(h_i)), the
residual stream carries h_i, and its own lm_head covers a draft vocabulary of the most
frequent tokens (d2t maps draft ids to target ids). On a small model the lm_head is most
of a draft step, so a few thousand rows instead of the full vocabulary cut its cost.

`Eagle3Head` is the same layer as EAGLE-3 proper: its first step reads three of the target's
layers (vLLM's auxiliary hidden states) fused by `fc` (3H -> H) instead of the last one, and
its later steps read its own features, so it is trained unrolled on them (training-time
test, `loss.py`) and not regressed onto the target's hidden states.

All share the target's embedding (frozen, not exported), exactly as vLLM shares it at
load time. forward() returns what the next draft step receives as its hidden state; for
the first two that is also the regression target (the target's next hidden state).

Every head is one decoder layer split in three (`_attention_input`, attention,
`_after_attention`), so that the loss can run the attention unrolled, each later draft
step attending over the earlier steps' keys as vLLM's drafter does (`unrolled_attention`).

A new head for a target, and a saved one read back: `head.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

WEIGHTS_FILE = "model.safetensors"
# Target config keys that describe the target's own layer stack or loading, not a one-layer
# Llama head: Qwen2/Qwen3's per-layer attention types and sliding-window plan (a LlamaConfig
# with one layer refuses a layer_types list of the target's length), quantisation, remote code.
TARGET_ONLY_KEYS = (
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "quantization_config",
    "auto_map",
)


@dataclass
class DraftStep:
    """One draft step's attention inputs, [B, heads, T, head_dim] each, and its residual."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor


def unrolled_attention(
    step: DraftStep, earlier: list[DraftStep], groups: int, scale: float
) -> torch.Tensor:
    """Attention of draft step j = len(earlier) + 1 over all T origins at once, as vLLM's
    drafter computes it: the draft drafting from origin t has in its cache the first
    step's keys at positions <= t (written from the target's hidden states) and, at
    positions t+1 .. t+j-1, the keys its own later steps wrote from origin t. So the
    queries attend causally over the first step's keys and to the diagonal of each later
    step's (SpecForge and EAGLE-3 train with this mask). Returns [B, heads, T, head_dim]."""
    steps = [*earlier, step]
    keys = torch.cat([s.k for s in steps], dim=2).repeat_interleave(groups, dim=1)
    values = torch.cat([s.v for s in steps], dim=2).repeat_interleave(groups, dim=1)
    t = step.q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=step.q.device).tril()
    diagonal = torch.eye(t, dtype=torch.bool, device=step.q.device)
    mask = torch.cat([causal] + [diagonal] * (len(steps) - 1), dim=1)
    return nn.functional.scaled_dot_product_attention(
        step.q, keys, values, attn_mask=mask, scale=scale
    )


class DraftHead(nn.Module):
    """What both heads share: config, the target's frozen embedding and lm_head, rotary
    positions, and saving in vLLM's checkpoint layout."""

    ARCHITECTURE = ""

    def __init__(
        self, target_config: dict, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor
    ):
        super().__init__()
        cfg = {k: v for k, v in target_config.items() if not k.startswith("_")}
        for key in TARGET_ONLY_KEYS:
            cfg.pop(key, None)
        cfg.update(architectures=[self.ARCHITECTURE], num_hidden_layers=1, model_type="llama")
        self.config = cfg
        self.hf_config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
        self.hf_config._attn_implementation = "sdpa"
        hidden = self.hf_config.hidden_size
        if embed_weight.shape[1] != hidden or lm_head_weight.shape[1] != hidden:
            raise ValueError(
                f"target embedding width {embed_weight.shape[1]} / lm_head width "
                f"{lm_head_weight.shape[1]} do not match hidden_size={hidden}"
            )
        self.rotary = LlamaRotaryEmbedding(self.hf_config)
        # Frozen and shared with the target; buffers so optimisers and exports skip them.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    def _embed(self, ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.embed_weight).to(like.dtype)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """vLLM's ids of the target layers whose hidden states the first step reads fused;
        () for a head that reads the target's last layer."""
        return ()

    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """What the first draft step reads from the target: its last layer's hidden states."""
        return hidden

    @property
    def regresses_hidden(self) -> bool:
        """Whether the head's features are trained towards the target's next hidden state."""
        return True

    def _attention_input(self, next_ids, hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the attention reads, the residual stream) of a draft step."""
        raise NotImplementedError

    def _after_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _attention(self) -> LlamaAttention:
        raise NotImplementedError

    def step_qkv(self, next_ids, hidden, positions) -> DraftStep:
        """One draft step up to its attention: rotated queries and keys, values, residual."""
        x, residual = self._attention_input(next_ids, hidden)
        attn = self._attention()
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q, k, v = (
            proj(x).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        cos, sin = self.rotary(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return DraftStep(q, k, v, residual)

    def finish_step(self, step: DraftStep, earlier: list[DraftStep]) -> torch.Tensor:
        """The step's features, its queries attending over `earlier` steps' keys (see
        `unrolled_attention`)."""
        attn = self._attention()
        out = unrolled_attention(step, earlier, attn.num_key_value_groups, attn.scaling)
        out = attn.o_proj(out.transpose(1, 2).flatten(2))
        return self._after_attention(out, step.residual)

    def forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """next_ids [B,T] (the token after each hidden state), hidden [B,T,H] (what
        `first_hidden` gives), positions [B,T]: the first draft step, teacher-forced."""
        return self.finish_step(self.step_qkv(next_ids, hidden, positions), [])

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's next-token logits over the draft vocabulary."""
        return self.full_target_logits(hidden)

    def full_target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's next-token logits over its whole vocabulary."""
        return hidden @ self.lm_head_weight.to(hidden.dtype).T

    def draft_columns(self, x: torch.Tensor) -> torch.Tensor:
        """The columns of a [..., target vocabulary] tensor that the draft vocabulary covers."""
        return x

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def export_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Trainable weights under the names vLLM's loader expects."""
        sd = self._export()
        return {
            k: v.detach()
            .to(dtype if dtype and v.is_floating_point() else v.dtype)
            .contiguous()
            .clone()
            for k, v in sd.items()
        }

    def _export(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_export_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        expected = set(self._export())
        missing, unexpected = expected - set(sd), set(sd) - expected
        if missing or unexpected:
            raise ValueError(
                f"draft weights: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        with torch.no_grad():
            for name, tensor in self._export().items():
                tensor.copy_(sd[name])

    def swap_metadata(self) -> dict[str, str]:
        """What the head was built for, checked by the engine before a hot-swap."""
        return {"hidden_size": str(self.hidden_size), "vocab_size": str(self.vocab_size)}

    def export_dtype(self) -> torch.dtype:
        name = self.config.get("dtype") or self.config.get("torch_dtype") or "float32"
        return getattr(torch, name)

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.config, indent=2))
        save_file(self.export_state_dict(self.export_dtype()), str(out / WEIGHTS_FILE))
        return out


class EagleHead(DraftHead):
    ARCHITECTURE = "EagleLlamaForCausalLM"

    def __init__(
        self, target_config: dict, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor
    ):
        super().__init__(target_config, embed_weight, lm_head_weight)
        self.fc = nn.Linear(2 * self.hidden_size, self.hidden_size, bias=False)
        self.layer = LlamaDecoderLayer(self.hf_config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()

    def _attention_input(self, next_ids, hidden):
        w = self.fc.weight
        x = self.fc(torch.cat([self._embed(next_ids, w), hidden.to(w.dtype)], dim=-1))
        return x, x  # no input norm: the attention reads what the residual carries

    def _attention(self) -> LlamaAttention:
        return self.layer.self_attn

    def _after_attention(self, attn, residual):
        residual = residual + attn
        return residual + self.layer.mlp(self.layer.post_attention_layernorm(residual))

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.target_logits(features)

    def _export(self) -> dict[str, torch.Tensor]:
        sd = {"fc.weight": self.fc.weight}
        sd.update({f"layers.0.{k}": v for k, v in self.layer.state_dict(keep_vars=True).items()})
        return sd


class ReducedVocabHead(DraftHead):
    ARCHITECTURE = "LlamaForCausalLMEagle3"

    def __init__(
        self,
        target_config: dict,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        vocab_ids: torch.Tensor,
    ):
        super().__init__(target_config, embed_weight, lm_head_weight)
        vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long).sort().values
        h, cfg = self.hidden_size, self.hf_config
        self.config.update(
            draft_vocab_size=len(vocab_ids), eagle_config={"use_aux_hidden_state": False}
        )
        self.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embedding; hidden]
            proj = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * h, proj.out_features, bias=False))
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, len(vocab_ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight[vocab_ids])
        self.register_buffer("vocab_ids", vocab_ids)
        self.register_buffer("d2t", vocab_ids - torch.arange(len(vocab_ids)))

    def _attention_input(self, next_ids, hidden):
        hidden = hidden.to(self.lm_head.weight.dtype)
        embedded = self.input_layernorm(self._embed(next_ids, self.lm_head.weight))
        return torch.cat([embedded, self.hidden_norm(hidden)], -1), hidden

    def _attention(self) -> LlamaAttention:
        return self.self_attn

    def _after_attention(self, attn, residual):
        residual = residual + attn
        return residual + self.mlp(self.post_attention_layernorm(residual))

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head_weight[self.vocab_ids].to(hidden.dtype).T

    def draft_columns(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.vocab_ids]

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(features))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_ids[ids]

    def _export(self) -> dict[str, torch.Tensor]:
        sd = {"lm_head.weight": self.lm_head.weight, "norm.weight": self.norm.weight}
        if len(self.vocab_ids) < len(self.lm_head_weight):
            sd["d2t"] = self.d2t  # vLLM keeps no map for a draft over the whole vocabulary
        for part in (
            "input_layernorm",
            "hidden_norm",
            "self_attn",
            "post_attention_layernorm",
            "mlp",
        ):
            sd.update(
                {
                    f"layers.0.{part}.{k}": v
                    for k, v in getattr(self, part).state_dict(keep_vars=True).items()
                }
            )
        return sd


class Eagle3Head(ReducedVocabHead):
    """EAGLE-3: the first draft step reads fc(concat of the target's auxiliary layers)."""

    def __init__(
        self,
        target_config: dict,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        vocab_ids: torch.Tensor,
        aux_layers: tuple[int, ...],
    ):
        super().__init__(target_config, embed_weight, lm_head_weight, vocab_ids)
        layers = target_config["num_hidden_layers"]
        if len(set(aux_layers)) != len(aux_layers) or not all(0 <= i <= layers for i in aux_layers):
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids {list(aux_layers)}: distinct layer ids in "
                f"0..{layers} (the target's num_hidden_layers) are needed"
            )
        self._aux = tuple(sorted(aux_layers))  # vLLM concatenates them in layer order
        self.config["eagle_config"] = {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": list(self._aux),
        }
        self.fc = nn.Linear(len(self._aux) * self.hidden_size, self.hidden_size, bias=False)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self._aux

    @property
    def regresses_hidden(self) -> bool:
        return False  # its features start from fused layers, not the target's last one

    def first_hidden(self, hidden, aux):
        if aux is None:
            raise ValueError(
                f"an EAGLE-3 head reads the target's layers {list(self._aux)}: capture them "
                "(capture_hidden(..., aux_layers=head.aux_layers))"
            )
        return self.fc(aux.to(self.fc.weight.dtype))

    def _export(self) -> dict[str, torch.Tensor]:
        return {"fc.weight": self.fc.weight, **super()._export()}
