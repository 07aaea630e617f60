"""The context length an engine runs with, resolved from the model unless given."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from grpo_specdec.modelcheck import KV_BLOCK_SLACK, resolve_max_model_len
from tests.conftest import tiny_engine_config

LAYOUT = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
KV_VALUES = 2 * 2 * 2 * 32  # K and V, 2 layers, 2 KV heads of 32


def _model(tmp_path, name="model", **cfg):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_default_is_the_position_limit_when_the_kv_cache_holds_it(tmp_path):
    model = _model(tmp_path, max_position_embeddings=1024, dtype="float32", **LAYOUT)
    assert resolve_max_model_len(None, model, kv_cache_gib=1.0) == 1024


def test_default_is_capped_by_the_kv_cache(tmp_path):
    model = _model(tmp_path, max_position_embeddings=131072, dtype="float32", **LAYOUT)
    kv_bytes = 1 << 24  # 16 MiB: 16384 float32 tokens of this layout
    got = resolve_max_model_len(None, model, kv_cache_gib=kv_bytes / (1 << 30))
    assert got == kv_bytes // (KV_VALUES * 4) - KV_BLOCK_SLACK
    # bfloat16 values are half as wide; a draft's layers share the cache
    wider = resolve_max_model_len(None, model, kv_bytes / (1 << 30), dtype="bfloat16")
    assert wider == kv_bytes // (KV_VALUES * 2) - KV_BLOCK_SLACK
    draft = _model(
        tmp_path, "draft", max_position_embeddings=131072, **LAYOUT | {"num_hidden_layers": 1}
    )
    with_draft = resolve_max_model_len(None, model, kv_bytes / (1 << 30), draft=draft)
    assert with_draft == kv_bytes // (KV_VALUES * 3 // 2 * 4) - KV_BLOCK_SLACK


def test_smallest_position_key_counts(tmp_path):
    model = _model(tmp_path, max_position_embeddings=4096, seq_length=512, **LAYOUT)
    assert resolve_max_model_len(None, model, kv_cache_gib=1.0) == 512


def test_explicit_value_is_kept_or_rejected_naming_the_field(tmp_path):
    model = _model(tmp_path, max_position_embeddings=1024, **LAYOUT)
    assert resolve_max_model_len(256, model, kv_cache_gib=1.0) == 256
    with pytest.raises(ValueError, match=r"max_model_len=2048 exceeds .* allows 1024 tokens"):
        resolve_max_model_len(2048, model, kv_cache_gib=1.0)


def test_a_model_without_a_position_limit_needs_an_explicit_value(tmp_path):
    model = _model(tmp_path, **LAYOUT)
    with pytest.raises(ValueError, match="declares no position limit.*set max_model_len"):
        resolve_max_model_len(None, model, kv_cache_gib=1.0)
    assert resolve_max_model_len(300, model, kv_cache_gib=1.0) == 300


def test_a_kv_cache_too_small_for_one_sequence_is_an_error(tmp_path):
    model = _model(tmp_path, max_position_embeddings=1024, dtype="float32", **LAYOUT)
    with pytest.raises(ValueError, match="kv_cache_gib=.* raise kv_cache_gib"):
        resolve_max_model_len(None, model, kv_cache_gib=(KV_VALUES * 4 * 200) / (1 << 30))


def test_engine_config_resolves_from_the_tiny_model(tiny_target, tiny_draft):
    assert tiny_engine_config(tiny_target, max_model_len=None).max_model_len == 1024
    spec = tiny_engine_config(tiny_target, tiny_draft, max_model_len=None, kv_cache_gib=0.001)
    assert 16 <= spec.max_model_len < 1024
    with pytest.raises(ValidationError, match="max_model_len=2048 exceeds"):
        tiny_engine_config(tiny_target, max_model_len=2048)
