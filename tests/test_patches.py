"""The vLLM 0.32 CPU fix for sampled speculative decoding."""

from __future__ import annotations

import pytest
import torch

from grpo_specdec.engine import SamplingSettings
from vllm_plugin.patches import cpu_expand_kernel_v0_32 as patch


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_keeps_dtype_and_replaces(dtype):
    values = torch.tensor([3, 0, 7], dtype=dtype)
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2 tokens, 0 tokens, 3 tokens
    out = torch.full((5,), -9, dtype=dtype)
    patch.expand_kernel_impl(out, values, cu, 7, 1)
    assert out.tolist() == [3, 3, 1, 1, 1]


def test_patch_is_installed_in_engine_processes_on_cpu(eagle_engine):
    from vllm.utils import cpu_triton_utils

    import vllm_plugin

    assert patch.applies()
    assert "cpu_expand_kernel_v0_32" in vllm_plugin.PATCHED
    assert cpu_triton_utils._expand_kernel_impl is patch.expand_kernel_impl


def test_sampled_speculation_follows_the_target(eagle_engine, plain_engine, questions):
    """At a temperature near 0 the sampled path must reproduce greedy decoding; without
    the fix the target probabilities are garbage and so is the text."""
    prompts = questions[:8]
    greedy = plain_engine.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=32))
    sampled = eagle_engine.generate(prompts, SamplingSettings(temperature=1e-4, max_tokens=32))
    assert [g[0].token_ids for g in sampled.outputs] == [g[0].token_ids for g in greedy.outputs]
    assert sampled.spec["mean_acceptance_length"] > 1.5
