"""Whether a draft head folder is in its authors' published layout (which `formats.py`
imports) or in this project's: read from its config and tensor names, loading no tensor.
Apart from `formats.py` so that the model checks (`modelcheck.py`) can name an unimported
head without depending on the head and its import."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def _tensor_names(folder: Path) -> list[str]:
    """The head's tensor names, read from the safetensors headers (or the .bin's index)
    without loading the tensors."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        names = []
        for f in files:
            with safe_open(str(f), framework="pt") as opened:
                names += list(opened.keys())
        return names
    if (folder / "pytorch_model.bin").is_file():
        weights = torch.load(folder / "pytorch_model.bin", map_location="meta", weights_only=True)
        return list(weights)
    return []


def published_layout(folder: str | Path) -> str | None:
    """What marks the head at `folder` as published in its authors' layout rather than this
    project's (None: this project's, or no head at all): the parts `import_head` converts."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return None
    cfg = json.loads((folder / "config.json").read_text())
    marks = []
    if cfg.get("model_type") == "eagle" and isinstance(cfg.get("model"), dict):
        marks.append('a config nested under "model"')
    elif cfg.get("speculators_model_type") or "transformer_layer_config" in cfg:
        marks.append("a speculators config")
    elif "LlamaForCausalLM" in (cfg.get("architectures") or []):
        marks.append("a LlamaForCausalLM config")
    if not list(folder.glob("*.safetensors")) and (folder / "pytorch_model.bin").is_file():
        marks.append("pytorch_model.bin")
    names = _tensor_names(folder)
    plain = [n.removeprefix("model.") for n in names]
    if not any(n in ("fc.weight", "d2t") or n.startswith("midlayer.") for n in plain):
        return None  # no draft head at all (a whole model, say): not a layout to import
    if any(n.startswith("model.") for n in names):
        marks.append("model.* names")
    if any(n.startswith("midlayer.") for n in plain):
        marks.append("midlayer.*")
    marks += [n for n in ("embed_tokens.weight", "t2d", "fc.bias") if n in plain]
    return ", ".join(marks) or None
