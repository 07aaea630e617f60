"""An EAGLE draft head that computes what vLLM's `EagleLlamaForCausalLM` computes.

Draft step at position i: f_i = layer(fc(concat(embed(x_{i+1}), h_i))), where h_i is the
target's last-layer (post-norm) hidden state and the single decoder layer has no input
norm; the draft's next-token logits are the target's lm_head applied to f_i, with no
final norm. Embedding and lm_head are the target's, frozen and not exported, exactly as
vLLM shares them at load time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from grpo_specdec.modelcheck import check_draft_matches_target, read_config

ARCHITECTURE = "EagleLlamaForCausalLM"
WEIGHTS_FILE = "model.safetensors"


def draft_config(target_config: dict) -> dict:
    """The checkpoint config of a draft head for a target with this config.json."""
    cfg = {k: v for k, v in target_config.items() if not k.startswith("_")}
    cfg.update(architectures=[ARCHITECTURE], num_hidden_layers=1, model_type="llama")
    for key in ("quantization_config", "auto_map"):
        cfg.pop(key, None)
    return cfg


class EagleHead(nn.Module):
    def __init__(self, config: dict, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.config = draft_config(config)
        hf_cfg = LlamaConfig(**{k: v for k, v in self.config.items() if k != "architectures"})
        hf_cfg._attn_implementation = "sdpa"
        hidden = hf_cfg.hidden_size
        if embed_weight.shape[1] != hidden or lm_head_weight.shape[1] != hidden:
            raise ValueError(
                f"target embedding width {embed_weight.shape[1]} / lm_head width "
                f"{lm_head_weight.shape[1]} do not match hidden_size={hidden}"
            )
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(hf_cfg, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(hf_cfg)
        # Frozen and shared with the target; buffers so optimisers and exports skip them.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    def forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """next_ids [B,T] (the token after each hidden state), hidden [B,T,H], positions [B,T]."""
        emb = nn.functional.embedding(next_ids, self.embed_weight).to(self.fc.weight.dtype)
        x = self.fc(torch.cat([emb, hidden.to(self.fc.weight.dtype)], dim=-1))
        cos_sin = self.rotary(x, positions)
        return self.layer(
            x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin
        )

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.lm_head_weight.to(features.dtype).T

    # ---- vLLM checkpoint format ----------------------------------------------------------
    def export_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Trainable weights under the names vLLM's EAGLE loader expects."""
        sd = {"fc.weight": self.fc.weight}
        sd.update({f"layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return {k: v.detach().to(dtype or v.dtype).contiguous().clone() for k, v in sd.items()}

    def load_export_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        expected = set(self.export_state_dict())
        missing, unexpected = expected - set(sd), set(sd) - expected
        if missing or unexpected:
            raise ValueError(
                f"draft weights: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        with torch.no_grad():
            self.fc.weight.copy_(sd["fc.weight"])
            self.layer.load_state_dict(
                {k[len("layers.0.") :]: v for k, v in sd.items() if k.startswith("layers.0.")}
            )

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


def target_embeddings(target: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding, lm_head) weights of a HF causal LM."""
    return target.get_input_embeddings().weight, target.get_output_embeddings().weight


def new_head(target_dir: str | Path, target: nn.Module, seed: int = 0) -> EagleHead:
    cfg = read_config(target_dir, "target")
    embed, lm_head = target_embeddings(target)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = EagleHead(cfg, embed, lm_head)
    return head.float()


def load_head(draft_dir: str | Path, target_dir: str | Path, target: nn.Module) -> EagleHead:
    check_draft_matches_target(draft_dir, target_dir)
    head = new_head(target_dir, target)
    head.load_export_state_dict(
        {k: v.float() for k, v in load_file(str(Path(draft_dir) / WEIGHTS_FILE)).items()}
    )
    return head
