"""Draft heads as they are published, read into the layout vLLM serves and this project keeps
learning (`head.py`): `grpo-specdec draft import --head SRC --target T --out OUT`, and on the
fly wherever a head is handed over (`ready_head`: generate, profile, draft train's --init, the
job's model.draft, `OnlineDraft`), into a cache keyed by the source's content.

Layouts read, with vLLM's own renames:
- EAGLE-1 (the EAGLE authors' heads): `pytorch_model.bin` or safetensors; a `LlamaForCausalLM`
  config, or one nested under "model" with model_type "eagle"; `fc.weight` [H, 2H],
  `layers.0.*`, often `embed_tokens.weight` and `fc.bias`.
- EAGLE-3 (the authors' and SpecForge's): `LlamaForCausalLMEagle3`, `midlayer.*` (vLLM reads it
  as `layers.0.`), a draft vocabulary (`lm_head.weight` [V_d, H], `d2t`, `t2d`), `norm.weight`.
- `speculators` (vLLM's library): `Eagle3Speculator` (speculators_model_type "eagle3"), the
  layer's config under `transformer_layer_config`. The library itself is not used: it
  requires torchvision and torchaudio (whose CUDA builds break `import transformers` beside
  the CPU torch) and datasets<=5.1.
What becomes of the parts that are not in this project's layout:
- `embed_tokens.weight`: the head is trained on the target's frozen embedding and vLLM then
  shares the target's; dropped when it equals the target's, else refused.
- `t2d`: vLLM drops it; so does the import.
- `fc.bias`: vLLM 0.32's EAGLE head has no bias there, so it could not serve it: dropped when
  all zeros, else refused.
- `fc.weight` over three auxiliary target layers ([H, 3H], a true EAGLE-3 head): kept, with the
  layers the config names (`eagle_aux_hidden_state_layer_ids`), else vLLM's default for the
  target, written into the imported config; vLLM's fc/residual norm variants are refused.
A head whose shapes do not fit the target is refused with the field or tensor named.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from grpo_specdec.draft.head import new_head, target_embeddings
from grpo_specdec.draft.layout import published_layout
from grpo_specdec.fingerprint import fingerprint
from grpo_specdec.modelcheck import read_config
from vllm_plugin.settings import cache_dir


class HeadFormatError(ValueError):
    """A published head this project cannot serve or train; the message names the part."""


def head_config(folder: Path) -> dict:
    """The head's own config: top level, nested under "model" (model_type "eagle"), or a
    speculators config's `transformer_layer_config` with the draft vocabulary, auxiliary
    layers and residual-norm option added."""
    cfg = read_config(folder, "draft")
    if cfg.get("model_type") == "eagle" and isinstance(cfg.get("model"), dict):
        return cfg["model"]
    if cfg.get("speculators_model_type") or "transformer_layer_config" in cfg:
        layer = dict(cfg.get("transformer_layer_config") or {})
        for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual"):
            if key in cfg:
                layer[key] = cfg[key]
        layer["architectures"] = cfg.get("architectures", [])
        return layer
    return cfg


def head_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head, under vLLM's names (`model.` stripped, `midlayer.` read as
    `layers.0.`): from its safetensors files, or a `pytorch_model.bin`."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        raw = {k: v for f in files for k, v in load_file(str(f)).items()}
    elif (folder / "pytorch_model.bin").is_file():
        raw = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise HeadFormatError(f"draft: {folder} holds no *.safetensors or pytorch_model.bin")
    weights = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        weights[name] = tensor
    return weights


def _check_fits(cfg: dict, target_cfg: dict, folder: Path) -> None:
    for key in ("hidden_size", "vocab_size"):
        if key in cfg and cfg[key] != target_cfg.get(key):
            raise HeadFormatError(
                f"draft: {folder} was built for {key}={cfg[key]}, but the target has "
                f"{key}={target_cfg.get(key)}"
            )


# vLLM's EAGLE-3 variants this project's head does not compute; refused rather than served
# as a head they would change.
UNSUPPORTED_EAGLE3_OPTIONS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


def _aux_layers(cfg: dict, target_cfg: dict, fc: torch.Tensor, folder: Path) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head's fc fuses: its config's
    eagle_aux_hidden_state_layer_ids, else vLLM's default for the target."""
    hidden = target_cfg["hidden_size"]
    for option in UNSUPPORTED_EAGLE3_OPTIONS:
        if cfg.get(option) or (cfg.get("eagle_config") or {}).get(option):
            raise HeadFormatError(f"draft: {folder} sets {option}, which this project's head lacks")
    layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if not layers:
        n = target_cfg["num_hidden_layers"]
        layers = (2, n // 2, n - 3)  # what vLLM reads when the head names none
    if fc.shape[1] != len(layers) * hidden:
        raise HeadFormatError(
            f"draft: {folder}'s fc.weight is {list(fc.shape)}: it fuses "
            f"{fc.shape[1] / hidden:g} target layers of hidden_size={hidden}, but "
            f"eagle_aux_hidden_state_layer_ids names {len(layers)} ({list(layers)})"
        )
    return tuple(layers)


def _drop_extras(weights: dict, target_embed: torch.Tensor, folder: Path) -> None:
    """Drop what vLLM drops or shares (embedding, t2d, a zero fc bias); refuse the rest."""
    weights.pop("t2d", None)
    if "embed_tokens.weight" in weights:
        own = weights.pop("embed_tokens.weight")
        target = target_embed.detach()
        if own.shape != target.shape or not torch.equal(own.to(target.dtype), target):
            raise HeadFormatError(
                f"draft: {folder}'s embed_tokens.weight differs from the target's: heads here "
                "learn on the target's frozen embedding (as vLLM shares it), so this head's "
                "drafts would change"
            )
    bias = weights.pop("fc.bias", None)
    if bias is not None and bias.abs().max() > 0:
        raise HeadFormatError(
            f"draft: {folder} has a non-zero fc.bias; vLLM 0.32's EAGLE head has no bias there "
            "and could not serve it"
        )


def import_head(src: str | Path, target_dir: str | Path, out: str | Path) -> Path:
    """Read the head at `src` in any layout above and write it in this project's (vLLM's
    `EagleLlamaForCausalLM`, or `LlamaForCausalLMEagle3` with a draft vocabulary) to `out`."""
    from transformers import AutoModelForCausalLM

    folder, target_dir = Path(src), Path(target_dir)
    cfg, target_cfg = head_config(folder), read_config(target_dir, "model")
    _check_fits(cfg, target_cfg, folder)
    weights = head_weights(folder)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    _drop_extras(weights, target_embeddings(target)[0], folder)
    hidden = target_cfg["hidden_size"]
    fc = weights.get("fc.weight")
    aux = None
    if fc is not None and fc.shape[1] != 2 * hidden:
        aux = _aux_layers(cfg, target_cfg, fc, folder)
    if fc is not None and fc.shape[0] != hidden:
        raise HeadFormatError(
            f"draft: {folder}'s fc.weight is {list(fc.shape)}, expected [{hidden}, {2 * hidden}] "
            f"(EAGLE-1) or [{hidden}, 3 x {hidden}] (EAGLE-3) for a target of hidden_size={hidden}"
        )
    vocab_ids = None
    if aux is not None or fc is None:
        if fc is None and "d2t" not in weights:
            raise HeadFormatError(
                f"draft: {folder} has neither fc.weight (EAGLE-1) nor d2t (a draft vocabulary)"
            )
        if "d2t" in weights:
            d2t = weights["d2t"].long()
            vocab_ids = d2t + torch.arange(len(d2t))
    try:
        head = new_head(target_dir, target, vocab_ids=vocab_ids, aux_layers=aux)
    except ValueError as err:
        raise HeadFormatError(f"draft: {folder}: {err}") from None
    expected = {k: v.shape for k, v in head.export_state_dict().items()}
    for name, shape in expected.items():
        if name in weights and weights[name].shape != shape:
            raise HeadFormatError(
                f"draft: {folder}'s {name} is {list(weights[name].shape)}, a head for this "
                f"target has {list(shape)}"
            )
    try:
        head.load_export_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
        )
    except ValueError as err:
        raise HeadFormatError(f"draft: {folder}: {err}") from None
    out = head.save(out)
    (out / "imported_from.json").write_text(json.dumps({"source": str(folder)}, indent=1))
    return out


def imported_heads_dir() -> Path:
    return cache_dir() / "imported-heads"


def _content_key(folder: Path, target_dir: Path) -> str:
    """A key for the head's files and the target it is imported for (the import reads the
    target's embedding and config)."""
    key = f"{fingerprint(folder)['sha256']}:{target_dir.resolve()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def ready_head(
    draft: str | Path, target_dir: str | Path, field: str, log: Callable[[str], None] = print
) -> str:
    """The head at `draft` as this project serves and trains it: the folder itself when it is
    in this project's layout, else its import (`import_head`) into a cache keyed by its
    content, said in one line. A published head that cannot be imported is refused naming
    `field`, the layout found and why."""
    folder, target_dir = Path(draft), Path(target_dir)
    layout = published_layout(folder)
    if layout is None:
        return str(draft)
    out = imported_heads_dir() / _content_key(folder, target_dir)
    if not (out / "imported_from.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".import-", dir=out.parent))
        try:
            import_head(folder, target_dir, staging)
            try:
                staging.rename(out)
            except OSError:  # another process imported it first: the same content
                pass
        except HeadFormatError as err:
            raise HeadFormatError(
                f"{field}: {folder} is a head as published ({layout}) that cannot be imported "
                f"for {target_dir}: {err}. `grpo-specdec draft import --head {folder} --target "
                f"{target_dir} --out DIR` says the same"
            ) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log(
        f"{field}: {folder} is a head as published ({layout}); serving and training its "
        f"import in {out} (what `grpo-specdec draft import` writes)"
    )
    return str(out)
