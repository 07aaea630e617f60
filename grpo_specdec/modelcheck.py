"""Early checks on model folders, so a wrong path or a mismatched draft fails before vLLM starts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

EAGLE_ARCHITECTURES = {"EagleLlamaForCausalLM", "LlamaForCausalLMEagle3"}


def read_config(path: str | Path, what: str) -> dict:
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{what}: folder {folder} does not exist")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{what}: {folder} holds no config.json, so it is not a model folder")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{what}: {cfg} is not valid JSON ({err})") from None


def check_safetensors_complete(path: Path) -> None:
    """A safetensors file whose header and data are all there (a cut-off copy is not)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
    except (
        struct.error,
        json.JSONDecodeError,
        UnicodeDecodeError,
        MemoryError,
        OverflowError,
    ) as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({type(err).__name__})"
        ) from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a readable safetensors file (its header is not an object)")
    end = max((m["data_offsets"][1] for k, m in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        raise ValueError(
            f"{path} is truncated or corrupt: {size} bytes, its header describes {8 + header_len + end}"
        )


def check_tokenizer(path: str | Path, vocab_size: int, what: str) -> None:
    """The folder's tokenizer must only produce ids the model has embeddings for."""
    tok_file = Path(path) / "tokenizer.json"
    if not tok_file.is_file():
        return
    tok = json.loads(tok_file.read_text())
    vocab = (tok.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t["id"] for t in tok.get("added_tokens", [])]
    if ids and max(ids) >= vocab_size:
        raise ValueError(
            f"{what}: the tokenizer in {path} has token ids up to {max(ids)}, but the model's "
            f"vocab_size is {vocab_size}: tokenizer and model do not match"
        )


def check_model_dir(path: str | Path, what: str) -> dict:
    cfg = read_config(path, what)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{what}: {path} holds no *.safetensors weights")
    for f in files:
        check_safetensors_complete(f)
    if "vocab_size" in cfg:
        check_tokenizer(path, cfg["vocab_size"], what)
    return cfg


def draft_method(draft: str | Path) -> str:
    """vLLM's speculative method for a draft folder: "eagle3" for the reduced-vocabulary
    (EAGLE-3 format) heads, else "eagle"."""
    arch = read_config(draft, "draft").get("architectures") or []
    return "eagle3" if "LlamaForCausalLMEagle3" in arch else "eagle"


def check_draft_matches_target(draft: str | Path, target: str | Path) -> None:
    from grpo_specdec.draft.layout import published_layout

    layout = published_layout(draft)
    if layout is not None:
        raise ValueError(
            f"draft: {draft} is a head as published ({layout}), not in the layout this project "
            f"serves and trains: `grpo-specdec draft import --head {draft} --target {target} "
            "--out DIR` converts it (generate, profile, draft train --init, the job's "
            "model.draft and OnlineDraft import it themselves)"
        )
    d = check_model_dir(draft, "draft")
    t = read_config(target, "model")
    arch = set(d.get("architectures") or [])
    if not arch & EAGLE_ARCHITECTURES:
        raise ValueError(
            f"draft: {draft} has architectures {sorted(arch)}, expected one of "
            f"{sorted(EAGLE_ARCHITECTURES)}"
        )
    for key in ("hidden_size", "vocab_size"):
        if d.get(key) != t.get(key):
            raise ValueError(
                f"draft: {draft} was built for {key}={d.get(key)}, but the target {target} "
                f"has {key}={t.get(key)}"
            )


# The config.json keys vLLM reads a position limit from; it takes the smallest present.
POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# vLLM allocates KV cache in whole blocks (128 tokens on CPU) and holds one block back.
KV_BLOCK_SLACK = 256


def position_limit(cfg: dict) -> int | None:
    return min((cfg[k] for k in POSITION_KEYS if isinstance(cfg.get(k), int)), default=None)


def kv_values_per_token(cfg: dict) -> int | None:
    """Numbers cached per token (K and V of every layer), or None for a config of
    another shape."""
    try:
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return 2 * cfg["num_hidden_layers"] * (cfg.get("num_key_value_heads") or heads) * head_dim
    except (KeyError, TypeError):
        return None


def default_kv_cache_gib() -> float | None:
    """1 GiB of KV cache where engines run on the CPU; on a GPU None, leaving vLLM its own
    default (`gpu_memory_utilization` of the device, less the weights and activations)."""
    import torch

    return None if torch.cuda.is_available() else 1.0


def resolve_max_model_len(
    requested: int | None,
    model: str | Path,
    kv_cache_gib: float | None,
    dtype: str = "auto",
    draft: str | Path | None = None,
) -> int:
    """The context length an engine runs with: `requested`, checked against the model's
    position limit, or by default (None) that limit, lowered to the longest sequence
    the KV cache holds: vLLM refuses to start unless one full-length sequence fits, and
    the draft's layers share the cache. With dtype "auto" the checkpoint's dtype is
    assumed, an upper bound, as vLLM's "auto" keeps or narrows it (x86 CPUs run float32
    checkpoints in bfloat16): the cap may fall short of what fits, not beyond it. With no
    `kv_cache_gib` (a GPU: vLLM sizes the cache from its memory share) the limit stands and
    vLLM checks the fit itself as it starts."""
    cfg = read_config(model, "model")
    limit = position_limit(cfg)
    if requested is not None:
        if limit is not None and requested > limit:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's position limit: "
                f"{Path(model) / 'config.json'} allows {limit} tokens"
            )
        return requested
    if limit is None:
        raise ValueError(
            f"max_model_len: {Path(model) / 'config.json'} declares no position limit "
            f"({', '.join(POSITION_KEYS[:2])}, ...); set max_model_len"
        )
    values = [kv_values_per_token(cfg)]
    if draft is not None:
        values.append(kv_values_per_token(read_config(draft, "draft")))
    if None in values or kv_cache_gib is None:
        return limit  # a layout this estimate does not know; vLLM checks the memory itself
    if dtype == "auto":
        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    fits = int(kv_cache_gib * (1 << 30)) // (sum(values) * DTYPE_BYTES.get(dtype, 4))
    fits -= KV_BLOCK_SLACK
    if fits < 16:
        raise ValueError(
            f"kv_cache_gib={kv_cache_gib} holds too few tokens of {model} for one sequence; "
            "raise kv_cache_gib"
        )
    return min(limit, fits)
