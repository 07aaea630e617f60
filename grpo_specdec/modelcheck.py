"""Early checks on model folders, so a wrong path or a mismatched draft fails before vLLM starts."""

from __future__ import annotations

import json
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


def check_model_dir(path: str | Path, what: str) -> dict:
    cfg = read_config(path, what)
    if not any(Path(path).glob("*.safetensors")):
        raise ValueError(f"{what}: {path} holds no *.safetensors weights")
    return cfg


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
