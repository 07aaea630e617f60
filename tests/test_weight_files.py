"""Weight files that are not what a loader expects are named, not a KeyError or an
AttributeError from deep inside: a safetensors header that is not an object, a tensor in a
dtype weight swaps do not handle (FP8 checkpoints)."""

from __future__ import annotations

import json
import struct

import pytest

from grpo_specdec.modelcheck import check_safetensors_complete
from vllm_plugin.weights.manifest import WeightSwapError, read_manifest


def _safetensors(path, header, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_header_that_is_not_an_object_is_named(tmp_path):
    weights = tmp_path / "model.safetensors"
    _safetensors(weights, [1, 2])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        check_safetensors_complete(weights)
    with pytest.raises(WeightSwapError, match="its safetensors header is not a JSON object"):
        read_manifest(tmp_path)


def test_a_dtype_swaps_do_not_handle_is_named_with_its_tensor(tmp_path):
    header = {"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}
    _safetensors(tmp_path / "model.safetensors", header, b"\0\0")
    with pytest.raises(WeightSwapError, match="tensor w has dtype F8_E4M3, which weight swaps"):
        read_manifest(tmp_path)
