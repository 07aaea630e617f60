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
    from vllm.v1.sample import rejection_sampler

    from vllm_plugin.patches import cpu_recovered_tokens_v0_32

    assert vllm_plugin.PATCHED == ["cpu_expand_kernel_v0_32", "cpu_recovered_tokens_v0_32"]
    assert cpu_triton_utils._expand_kernel_impl is patch.expand_kernel_impl
    assert (
        rejection_sampler.sample_recovered_tokens
        is cpu_recovered_tokens_v0_32.sample_recovered_tokens
    )


def test_sampled_speculation_follows_the_target(eagle_engine, plain_engine, questions):
    """At a temperature near 0 the sampled path must reproduce greedy decoding; without
    the fix the target probabilities are garbage and so is the text."""
    prompts = questions[:8]
    greedy = plain_engine.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=32))
    sampled = eagle_engine.generate(prompts, SamplingSettings(temperature=1e-4, max_tokens=32))
    assert [g[0].token_ids for g in sampled.outputs] == [g[0].token_ids for g in greedy.outputs]
    assert sampled.spec["mean_acceptance_length"] > 1.5


def test_recovered_tokens_follow_the_residual_distribution():
    from vllm_plugin.patches import cpu_recovered_tokens_v0_32 as recovered

    target = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).repeat(20_000, 1)
    draft = torch.zeros(20_000, dtype=torch.int32)  # the draft proposed token 0
    got = recovered.sample_recovered_tokens(1, [1] * 20_000, None, draft, None, target, None, "cpu")
    freq = torch.bincount(got.long(), minlength=4).float() / len(got)
    assert freq[0] == 0 and freq[3] == 0  # never the rejected token, never an impossible one
    assert freq[1].item() == pytest.approx(0.6, abs=0.02) and freq[2].item() == pytest.approx(
        0.4, abs=0.02
    )
    with_q = recovered.sample_recovered_tokens(
        1,
        [1] * 20_000,
        None,
        draft,
        torch.tensor([[0.1, 0.3, 0.0, 0.6]]).repeat(20_000, 1),
        target,
        None,
        "cpu",
    )
    freq = torch.bincount(with_q.long(), minlength=4).float() / len(with_q)
    # max(p - q, 0) = [0.4, 0, 0.2, 0] -> 2/3, 0, 1/3, 0
    assert freq[0].item() == pytest.approx(2 / 3, abs=0.02) and freq[2].item() == pytest.approx(
        1 / 3, abs=0.02
    )
    empty = torch.empty(0, dtype=torch.int32)
    assert (
        recovered.sample_recovered_tokens(
            0, [0], None, empty, None, torch.empty(0, 4), None, "cpu"
        ).numel()
        == 0
    )
