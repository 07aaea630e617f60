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
    from vllm.v1.sample import rejection_sampler

    import vllm_plugin
    from vllm_plugin.patches import cpu_rejection_sample_v0_32

    assert patch.applies()
    assert vllm_plugin.PATCHED == ["cpu_expand_kernel_v0_32", "cpu_rejection_sample_v0_32"]
    assert cpu_triton_utils._expand_kernel_impl is patch.expand_kernel_impl
    assert rejection_sampler.rejection_sample is cpu_rejection_sample_v0_32.rejection_sample


def test_sampled_speculation_follows_the_target(eagle_engine, plain_engine, questions):
    """At a temperature near 0 the sampled path must reproduce greedy decoding; without
    the fix the target probabilities are garbage and so is the text."""
    prompts = questions[:8]
    greedy = plain_engine.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=32))
    sampled = eagle_engine.generate(prompts, SamplingSettings(temperature=1e-4, max_tokens=32))
    assert [g[0].token_ids for g in sampled.outputs] == [g[0].token_ids for g in greedy.outputs]
    assert sampled.spec["mean_acceptance_length"] > 1.5


def _vllm_rejection_sample():
    """vLLM's own implementation (what the patch replaced, if it did)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from vllm_plugin.patches import cpu_rejection_sample_v0_32 as fast

    current_platform.register_triton_kernel_overrides()
    return fast._original or rejection_sampler.rejection_sample


def _output_distribution(sample, trials, draft_probs):
    from types import SimpleNamespace

    torch.manual_seed(0)
    logits = torch.log(
        torch.tensor(
            [
                [0.5, 0.3, 0.1, 0.05, 0.05, 0.0],
                [0.1, 0.1, 0.6, 0.1, 0.1, 0.0],
                [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
            ]
        )
    )
    draft = torch.tensor(
        [1, 2, 3], dtype=torch.int32
    )  # request 0 drafts [1, 2]; 1 drafts none; 2 drafts [3]
    meta = SimpleNamespace(
        all_greedy=False, all_random=True, generators={}, temperature=torch.ones(3)
    )
    seen: dict[tuple, int] = {}
    for _ in range(trials):
        out = sample(
            draft,
            [2, 0, 1],
            2,
            torch.tensor([2, 2, 3], dtype=torch.int32),
            draft_probs,
            logits.clone(),
            torch.tensor([[5], [4], [5]]),
            meta,
        )
        key = tuple(out.flatten().tolist())
        seen[key] = seen.get(key, 0) + 1
    return {k: v / trials for k, v in seen.items()}


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_fast_rejection_sampling_matches_vllm_distribution(with_draft_probs):
    from vllm_plugin.patches import cpu_rejection_sample_v0_32 as fast

    if fast._original is None:
        fast.apply()
    q = (
        torch.tensor(
            [
                [0.1, 0.6, 0.1, 0.1, 0.1, 0.0],
                [0.2, 0.1, 0.5, 0.1, 0.1, 0.0],
                [0.1, 0.1, 0.1, 0.5, 0.1, 0.1],
            ]
        )
        if with_draft_probs
        else None
    )
    ours = _output_distribution(fast.rejection_sample, 20_000, q)
    theirs = _output_distribution(_vllm_rejection_sample(), 20_000, q)
    tv = 0.5 * sum(abs(ours.get(k, 0) - theirs.get(k, 0)) for k in set(ours) | set(theirs))
    assert tv < 0.03, (tv, sorted(ours.items())[:5], sorted(theirs.items())[:5])
    # request 1 drafted nothing: its output is just the bonus token
    assert all(k[3] == 4 for k in ours)
