"""Making and loading EAGLE draft heads: a new head for a target (`new_head`, its draft
vocabulary and, for EAGLE-3, the target layers it reads), and a saved head read back in
the class its config names (`load_head`). The heads themselves are in `head_model.py`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from grpo_specdec.draft.head_model import (
    WEIGHTS_FILE,
    DraftHead,
    Eagle3Head,
    EagleHead,
    ReducedVocabHead,
)
from grpo_specdec.modelcheck import check_draft_matches_target, read_config


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default auxiliary layers, (2, L // 2, L - 3), where they are three distinct
    layers; else (0, L // 2, L) (an id is the input of that layer, L the last one's output:
    vLLM reads each id once, so a repeated one would leave `fc` a layer short)."""
    if num_layers < 2:
        raise ValueError(f"an EAGLE-3 head needs a target of 2 or more layers, not {num_layers}")
    default = (2, num_layers // 2, num_layers - 3)
    if len(set(default)) == 3 and min(default) >= 0:
        return tuple(sorted(default))
    return (0, num_layers // 2, num_layers)


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
    target_dir: str | Path,
    target: nn.Module,
    seed: int = 0,
    vocab_ids: torch.Tensor | None = None,
    aux_layers: tuple[int, ...] | None = None,
) -> DraftHead:
    """A freshly initialised head: EAGLE over the full vocabulary, or over `vocab_ids`;
    with `aux_layers`, EAGLE-3 reading those target layers (over `vocab_ids`, by default
    the whole vocabulary)."""
    cfg = read_config(target_dir, "target")
    embed, lm_head = target_embeddings(target)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if aux_layers is not None:
            ids = torch.arange(len(lm_head)) if vocab_ids is None else vocab_ids
            head = Eagle3Head(cfg, embed, lm_head, ids, tuple(aux_layers))
        elif vocab_ids is None:
            head = EagleHead(cfg, embed, lm_head)
        else:
            head = ReducedVocabHead(cfg, embed, lm_head, vocab_ids)
    return head.float()


def aux_layers_of(draft_config: dict) -> tuple[int, ...] | None:
    """The auxiliary layers an EAGLE-3 head's config names; None for a head that reads the
    target's last layer."""
    eagle = draft_config.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", False):
        return None
    layers = eagle.get("eagle_aux_hidden_state_layer_ids") or draft_config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if not layers:
        raise ValueError(
            "draft config: eagle_config.use_aux_hidden_state is set but "
            "eagle_config.eagle_aux_hidden_state_layer_ids is missing (vLLM would pick the "
            "target's defaults, which a head trained elsewhere may not have been)"
        )
    return tuple(layers)


def load_head(draft_dir: str | Path, target_dir: str | Path, target: nn.Module) -> DraftHead:
    check_draft_matches_target(draft_dir, target_dir)
    weights = load_file(str(Path(draft_dir) / WEIGHTS_FILE))
    draft_config = read_config(draft_dir, "draft")
    vocab_ids = None
    if ReducedVocabHead.ARCHITECTURE in draft_config.get("architectures", []):
        vocab_ids = (
            weights["d2t"] + torch.arange(len(weights["d2t"]))
            if "d2t" in weights
            else torch.arange(draft_config["vocab_size"])
        )
    aux = aux_layers_of(draft_config)
    head = new_head(target_dir, target, vocab_ids=vocab_ids, aux_layers=aux)
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
