"""What a weight swap must look like, checked before anything in the engine is touched.

The manifest of a model is the name -> (shape, dtype) table of its checkpoint on disk,
read from the safetensors headers (no tensor data). Incoming weights must match it
exactly and be finite; anything else is rejected with a message that names the problem.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

# safetensors header dtype names -> torch dtypes
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

Manifest = dict[str, tuple[tuple[int, ...], torch.dtype]]


def header_entry(tensor_slice) -> tuple[tuple, object]:
    """(shape, dtype) of a tensor as its safetensors header declares it, without reading it
    (a `safe_open` slice); an unknown dtype stays its header name."""
    dtype = tensor_slice.get_dtype()
    return tuple(tensor_slice.get_shape()), _DTYPES.get(dtype, dtype)


class WeightSwapError(ValueError):
    """A rejected swap. The engine still serves the weights it had before."""


class MixedWeightsError(RuntimeError):
    """A swap failed and so did reloading the last good weights: that role's weights may
    be a mix, and the engine refuses to generate until a swap of that role succeeds."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise WeightSwapError(f"{model_dir} holds no *.safetensors files")
    return files


def read_manifest(model_dir: str | Path) -> Manifest:
    manifest: Manifest = {}
    for f in checkpoint_files(model_dir):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        if not isinstance(header, dict):
            raise WeightSwapError(f"{f}: its safetensors header is not a JSON object")
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            got = meta.get("dtype") if isinstance(meta, dict) else meta
            dtype = _DTYPES.get(got) if isinstance(got, str) else None
            if dtype is None:
                raise WeightSwapError(
                    f"{f}: tensor {name} has dtype {got}, which weight swaps do not handle "
                    f"({', '.join(_DTYPES)}; quantised checkpoints such as FP8 are not supported)"
                )
            manifest[name] = (tuple(meta["shape"]), dtype)
    return manifest


def validate_metadata(metadata: dict[str, str], hf_config: object, what: str) -> None:
    """Config facts the sender declares (e.g. vocab_size) must match the model being served."""
    problems = [
        f"built for {key}={value}, the engine serves {key}={getattr(hf_config, key)}"
        for key, value in sorted(metadata.items())
        if hasattr(hf_config, key) and str(getattr(hf_config, key)) != value
    ]
    if problems:
        raise WeightSwapError(f"rejected {what} weights: " + "; ".join(problems))


def validate_layout(layout: dict[str, tuple[tuple, object]], manifest: Manifest, what: str) -> None:
    """Names, shapes and dtypes (`layout`: name -> (shape, dtype), as a file's header gives
    them) against the manifest, before any tensor is read: a wrong model's file is refused
    without being loaded whole."""
    missing = sorted(set(manifest) - set(layout))
    unexpected = sorted(set(layout) - set(manifest))
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(
            f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    for name in sorted(set(layout) & set(manifest)):
        shape, dtype = manifest[name]
        got_shape, got_dtype = layout[name]
        if tuple(got_shape) != shape:
            problems.append(f"{name}: shape {tuple(got_shape)}, expected {shape}")
        elif got_dtype != dtype:
            problems.append(f"{name}: dtype {got_dtype}, expected {dtype}")
    if problems:
        raise WeightSwapError(f"rejected {what} weights: " + "; ".join(problems))


def validate_weights(weights: dict[str, torch.Tensor], manifest: Manifest, what: str) -> None:
    validate_layout({n: (tuple(t.shape), t.dtype) for n, t in weights.items()}, manifest, what)
    problems = [
        f"{name}: holds NaN or Inf values"
        for name, t in sorted(weights.items())
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if problems:
        raise WeightSwapError(f"rejected {what} weights: " + "; ".join(problems))
