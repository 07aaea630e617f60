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
