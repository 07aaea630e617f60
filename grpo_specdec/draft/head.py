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

Both share the target's embedding (frozen, not exported), exactly as vLLM shares it at
load time. forward() returns what the next draft step receives as its hidden state; that
is also the regression target (the target's next hidden state).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from grpo_specdec.modelcheck import check_draft_matches_target, read_config

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

    def forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """next_ids [B,T] (the token after each hidden state), hidden [B,T,H], positions [B,T]."""
        x = self.fc(
            torch.cat(
                [self._embed(next_ids, self.fc.weight), hidden.to(self.fc.weight.dtype)], dim=-1
            )
        )
        cos_sin = self.rotary(x, positions)
        return self.layer(
            x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin
        )

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

    def forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        dtype = self.lm_head.weight.dtype
        hidden = hidden.to(dtype)
        x = torch.cat(
            [
                self.input_layernorm(self._embed(next_ids, self.lm_head.weight)),
                self.hidden_norm(hidden),
            ],
            -1,
        )
        cos_sin = self.rotary(hidden, positions)
        attn, _ = self.self_attn(
            x, position_embeddings=cos_sin, attention_mask=None, position_ids=positions
        )
        residual = hidden + attn
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
        sd = {
            "lm_head.weight": self.lm_head.weight,
            "norm.weight": self.norm.weight,
            "d2t": self.d2t,
        }
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


def draft_vocabulary(seqs, size: int, always: list[int]) -> torch.Tensor:
    """The `size` token ids most frequent in the responses of `seqs` (plus `always`, e.g. EOS)."""
    counts = torch.zeros(max(max(s.token_ids) for s in seqs) + 1, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(
            torch.tensor(s.token_ids[s.prompt_len :], dtype=torch.long), minlength=len(counts)
        )
    counts[always] = counts.max() + 1
    return counts.argsort(descending=True)[:size].sort().values


def target_embeddings(target: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding, lm_head) weights of a HF causal LM."""
    return target.get_input_embeddings().weight, target.get_output_embeddings().weight


def new_head(
    target_dir: str | Path, target: nn.Module, seed: int = 0, vocab_ids: torch.Tensor | None = None
) -> DraftHead:
    """A freshly initialised head: EAGLE over the full vocabulary, or over `vocab_ids`."""
    cfg = read_config(target_dir, "target")
    embed, lm_head = target_embeddings(target)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = (
            EagleHead(cfg, embed, lm_head)
            if vocab_ids is None
            else ReducedVocabHead(cfg, embed, lm_head, vocab_ids)
        )
    return head.float()


def load_head(draft_dir: str | Path, target_dir: str | Path, target: nn.Module) -> DraftHead:
    check_draft_matches_target(draft_dir, target_dir)
    weights = load_file(str(Path(draft_dir) / WEIGHTS_FILE))
    vocab_ids = None
    if ReducedVocabHead.ARCHITECTURE in read_config(draft_dir, "draft").get("architectures", []):
        vocab_ids = weights["d2t"] + torch.arange(len(weights["d2t"]))
    head = new_head(target_dir, target, vocab_ids=vocab_ids)
    head.load_export_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    )
    # The engine checks every swap against the head it serves, so the head goes out in the
    # dtype it came in (a float32 head beside a bfloat16 target stays float32).
    stored = {v.dtype for v in weights.values() if v.is_floating_point()}
    if len(stored) == 1:
        head.config["dtype"] = str(stored.pop()).removeprefix("torch.")
        head.config.pop("torch_dtype", None)
    return head
