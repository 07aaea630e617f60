"""The vLLM 0.32/0.33 CPU patches: the expand-kernel fix, and how the plugin installs them
(the rejection sampler has its own tests in test_rejection_sampler.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from grpo_specdec.engine import SamplingSettings
from tests.conftest import plugin_log_lines
from vllm_plugin.patches.fixes import cpu_expand_kernel_v0_32 as patch


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
    from vllm_plugin.patches.fixes import cpu_rejection_sample_v0_32

    assert patch.applies()
    assert {"cpu_expand_kernel_v0_32", "cpu_rejection_sample_v0_32"} <= set(vllm_plugin.PATCHED)
    assert cpu_triton_utils._expand_kernel_impl is patch.expand_kernel_impl
    assert rejection_sampler.rejection_sample is cpu_rejection_sample_v0_32.rejection_sample


def test_sampled_speculation_follows_the_target(eagle_engine, plain_engine, questions):
    """At a temperature near 0 the sampled path must all but reproduce greedy decoding;
    without the fix the target probabilities are garbage and so is the text. vLLM raises
    any temperature below 0.01 to 0.01, where a runner-up within ~0.03 in log-probability
    still has a few per cent: the tiny model has such near-ties, so a prompt or two of
    eight may legitimately part from greedy (measured: 3 of 64 sequences over 8 runs, each
    a runner-up of probability 0.03-0.2 at T = 0.01)."""
    prompts = questions[:8]
    greedy = plain_engine.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=32))
    sampled = eagle_engine.generate(prompts, SamplingSettings(temperature=1e-4, max_tokens=32))
    same = [
        s[0].token_ids == g[0].token_ids
        for s, g in zip(sampled.outputs, greedy.outputs, strict=True)
    ]
    assert sum(same) >= 5, same
    assert sampled.spec["mean_acceptance_length"] > 1.5


def test_another_vllm_gets_one_console_line_and_no_patch(monkeypatch, caplog, capsys):
    import vllm

    import vllm_plugin

    monkeypatch.delenv("GRPO_SPECDEC_NO_PATCHES", raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setattr(vllm_plugin, "PATCHED", [])
    monkeypatch.setattr(vllm_plugin, "SKIPPED", [])
    monkeypatch.setattr(vllm_plugin, "SAID", set())

    def twice():
        vllm_plugin.register()
        vllm_plugin.register()

    lines = plugin_log_lines(caplog, logging.WARNING, twice)
    console = [line for line in capsys.readouterr().err.splitlines() if "grpo-specdec" in line]
    assert len(lines) == len(console) == 1, (lines, console)  # the second register(): nothing
    for said in (lines[0], console[0]):
        assert "vLLM 0.34.0" in said and "0.32.0, 0.33.0" in said
        assert "none of its patches" in said and "still runs" in said
    assert vllm_plugin.PATCHED == []


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0+cu130"])
def test_a_supported_vllm_says_nothing_of_versions(version, monkeypatch, capsys):
    import vllm

    import vllm_plugin

    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.setattr(vllm_plugin, "SAID", set())
    vllm_plugin.register()
    assert "checked against" not in capsys.readouterr().err
    assert not vllm_plugin.SAID


def test_patches_turned_off_by_the_user_are_said_on_the_console(monkeypatch, capsys):
    import vllm_plugin

    monkeypatch.setenv("GRPO_SPECDEC_NO_PATCHES", "1")
    monkeypatch.setattr(vllm_plugin, "SAID", set())
    vllm_plugin.register()
    vllm_plugin.register()
    said = [line for line in capsys.readouterr().err.splitlines() if "grpo-specdec" in line]
    assert len(said) == 1 and "GRPO_SPECDEC_NO_PATCHES=1 leaves vLLM unpatched" in said[0]
