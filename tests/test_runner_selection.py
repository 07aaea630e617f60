"""Which vLLM model runner engines run, and which patches say they apply there.

vLLM 0.32 runs Model Runner V2 by default wherever Triton runs (CUDA), and V2 calls none of
the V1 classes the runner patches change. These tests stub the platform and Triton for CUDA
(no GPU here) and ask vLLM's own decision, `VllmConfig.use_v2_model_runner`, which runner
an engine then gets."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import vllm.config.vllm as vllm_config_module
from vllm.config import VllmConfig
from vllm.platforms import current_platform

import vllm_plugin
from grpo_specdec.engine import Engine
from grpo_specdec.vllm_compat import reread_environment
from tests.conftest import engine_kwargs, plugin_log_lines, tiny_engine_config, unset_until_teardown

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
V1_PATCHES = {"free_k0_v0_32", "group_drafts_v0_32"}
CPU_V1_PATCHES = {
    "cpu_expand_kernel_v0_32",
    "cpu_rejection_sample_v0_32",
    "cpu_sampled_drafts_v0_32",
    "cpu_seed_rewind_v0_32",
}
CPU_PATCHES = {"cpu_onednn_release_v0_32", "cpu_compile_cache_v0_32", "cpu_kernel_scan_v0_32"}
ANY_PATCHES = {"rpc_replies_v0_32", "weight_guard_v0_32"}  # whatever the platform and runner
TRITON_PATCHES = {"v2_graph_candidates_v0_32"}  # where Triton runs, so V2 can


def vllm_runs_v2() -> bool:
    """vLLM's decision for an engine with none of the features V2 lacks."""
    reread_environment()
    config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        watermark_config=None,
        _get_v2_model_runner_unsupported_features=lambda: [],
    )
    return VllmConfig.use_v2_model_runner.fget(config)


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin as a fresh process loads it, the patches already installed staying
    installed (each apply() is idempotent); VLLM_USE_V2_MODEL_RUNNER restored after."""
    monkeypatch.delenv("GRPO_SPECDEC_NO_PATCHES", raising=False)
    unset_until_teardown(monkeypatch, RUNNER_ENV)
    monkeypatch.setattr(vllm_plugin, "RUNNER", None, raising=False)
    monkeypatch.setattr(vllm_plugin, "PATCHED", [])
    monkeypatch.setattr(vllm_plugin, "SKIPPED", [])
    yield
    reread_environment()


@pytest.fixture
def on_cuda(monkeypatch, fresh_plugin):
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "device_type", "cuda")


def register(caplog) -> list[str]:
    return plugin_log_lines(caplog, logging.INFO, vllm_plugin.register)


def test_on_cuda_vllm_alone_runs_v2(on_cuda):
    assert vllm_runs_v2()


def test_on_cuda_the_plugin_leaves_v2_and_says_once_what_its_v1_patches_miss(on_cuda, caplog):
    lines = register(caplog)
    assert RUNNER_ENV not in os.environ  # nothing chosen for engines that do not use us
    assert vllm_runs_v2()
    assert vllm_plugin.RUNNER == "V2"
    assert set(vllm_plugin.PATCHED) == ANY_PATCHES | TRITON_PATCHES
    assert set(vllm_plugin.SKIPPED) == V1_PATCHES | CPU_V1_PATCHES | CPU_PATCHES
    said = [line for line in lines if "run Model Runner V2" in line]
    assert len(said) == 1, lines
    assert "group drafts are refused" in said[0] and "k = 0" in said[0]
    assert f"{RUNNER_ENV}=0" in said[0] and "PIECEWISE" in said[0]
    vllm_plugin.register()  # vLLM loads plugins once a process, but a second call is harmless
    assert set(vllm_plugin.PATCHED) == ANY_PATCHES | TRITON_PATCHES


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_a_user_who_forces_v2_gets_no_v1_patch_and_a_line_naming_what_is_lost(
    platform, request, fresh_plugin, monkeypatch, caplog
):
    if platform == "cuda":
        request.getfixturevalue("on_cuda")
    monkeypatch.setenv(RUNNER_ENV, "1")
    lines = register(caplog)
    assert vllm_runs_v2()
    assert not (V1_PATCHES | CPU_V1_PATCHES) & set(vllm_plugin.PATCHED)
    own = CPU_PATCHES if platform == "cpu" else TRITON_PATCHES
    assert set(vllm_plugin.PATCHED) == own | ANY_PATCHES
    assert vllm_plugin.RUNNER == "V2"
    said = [line for line in lines if "run Model Runner V2" in line]
    assert len(said) == 1, lines
    for name in V1_PATCHES:
        assert any(
            f"patch {name} not applied" in line and "Model Runner V2" in line for line in lines
        )


def test_a_user_who_chooses_v1_gets_its_patches(on_cuda, monkeypatch, caplog):
    monkeypatch.setenv(RUNNER_ENV, "0")
    lines = register(caplog)
    assert set(vllm_plugin.PATCHED) == V1_PATCHES | ANY_PATCHES | TRITON_PATCHES
    assert vllm_plugin.RUNNER == "V1"
    assert not any("Model Runner V2" in line for line in lines)


def test_on_cpu_v1_runs_without_the_plugin_choosing(fresh_plugin):
    vllm_plugin.register()
    assert RUNNER_ENV not in os.environ
    assert vllm_runs_v2() is False
    assert set(vllm_plugin.PATCHED) == V1_PATCHES | CPU_V1_PATCHES | CPU_PATCHES | ANY_PATCHES


def test_no_patches_leaves_vllm_to_choose(on_cuda, monkeypatch):
    monkeypatch.setenv("GRPO_SPECDEC_NO_PATCHES", "1")
    vllm_plugin.register()
    assert vllm_runs_v2()
    assert vllm_plugin.PATCHED == []


def test_on_another_vllm_the_plugin_leaves_the_runner_to_it(on_cuda, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    vllm_plugin.register()
    assert vllm_runs_v2()
    assert vllm_plugin.PATCHED == []


@pytest.mark.parametrize(
    "version, targeted",
    [("0.32.0+cu129", True), ("0.32.0+cpu", True), ("0.32.1", False), ("0.32.0rc1", False)],
)
def test_a_local_build_of_the_target_version_is_the_target(on_cuda, monkeypatch, version, targeted):
    """CUDA wheels carry a local label; the code the patches target is the same."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    vllm_plugin.register()
    assert set(vllm_plugin.PATCHED) == (ANY_PATCHES | TRITON_PATCHES if targeted else set())


def test_the_cpu_engine_runs_the_v1_runner_the_patches_change(eagle_engine):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert eagle_engine.llm.llm_engine.vllm_config.use_v2_model_runner is False
    assert eagle_engine.llm.collective_rpc(
        lambda worker: isinstance(worker.model_runner, GPUModelRunner)
    ) == [True]


# ---- engine arguments ------------------------------------------------------------------------
def group_config(target: str, draft: str | None):
    speculative = {"draft": draft, "k": 3, "controller": {"group": {"enabled": True}}}
    return tiny_engine_config(target, draft, speculative=speculative)


@pytest.mark.parametrize("with_draft", [True, False])
def test_group_drafts_turn_async_scheduling_off(monkeypatch, tiny_target, tiny_draft, with_draft):
    kwargs = engine_kwargs(
        monkeypatch, group_config(tiny_target, tiny_draft if with_draft else None)
    )
    assert kwargs["async_scheduling"] is False


def test_without_group_drafts_vllm_chooses_the_scheduling(monkeypatch, tiny_target, tiny_draft):
    kwargs = engine_kwargs(monkeypatch, tiny_engine_config(tiny_target, tiny_draft))
    assert "async_scheduling" not in kwargs


def test_group_drafts_refuse_an_engine_on_v2(on_cuda, monkeypatch, tiny_target, tiny_draft):
    """vLLM's default on CUDA: the message says how to get the V1 runner they need."""
    vllm_plugin.register()
    with pytest.raises(
        ValueError, match=r"group.enabled.*Model Runner V2.*VLLM_USE_V2_MODEL_RUNNER=0"
    ):
        engine_kwargs(monkeypatch, group_config(tiny_target, tiny_draft))


def test_group_drafts_start_on_the_v1_runner_a_user_chooses(
    on_cuda, monkeypatch, tiny_target, tiny_draft
):
    monkeypatch.setenv(RUNNER_ENV, "0")
    vllm_plugin.register()
    kwargs = engine_kwargs(monkeypatch, group_config(tiny_target, tiny_draft))
    assert kwargs["async_scheduling"] is False


# ---- the runner an engine actually got ----------------------------------------------------------
class StubConfig:
    """What vLLM's `VllmConfig.use_v2_model_runner` reads, with the features that force V2."""

    use_v2_model_runner = VllmConfig.use_v2_model_runner

    def __init__(self, watermark=None, hisparse=None):
        self.attention_config = SimpleNamespace(hisparse_config=hisparse)
        self.watermark_config = watermark

    def _get_v2_model_runner_unsupported_features(self):
        return []


def test_watermarking_gets_v2_whatever_the_variable_and_no_v1_patch_acts_there(
    fresh_plugin, monkeypatch
):
    from vllm_plugin import patches

    monkeypatch.setenv(RUNNER_ENV, "0")
    reread_environment()
    vllm_plugin.register()
    assert patches.engine_runner(StubConfig()) == "V1"
    assert patches.engine_runner(StubConfig(watermark=object())) == "V2"
    applied = set(vllm_plugin.PATCHED)
    assert set(patches.acting(vllm_plugin.PATCHED, "V1")) == applied
    assert set(patches.acting(vllm_plugin.PATCHED, "V2")) == applied - V1_PATCHES - CPU_V1_PATCHES


def test_an_engine_on_v2_refuses_group_drafts_and_warns_that_k0_steps_draft(
    fresh_plugin, caplog, tiny_target, tiny_draft
):
    """vLLM gave the engine V2 (as for a watermarking config): group drafts would never
    draft, so the engine refuses them by name; without them it starts, and says that its
    k = 0 steps still run the draft pass."""
    from vllm_plugin import patches

    vllm_plugin.register()
    engine = Engine.__new__(Engine)  # as started: only the runner vLLM chose matters here
    engine.runner = "V2"
    engine.patches = patches.acting(vllm_plugin.PATCHED, "V2")
    group = group_config(tiny_target, tiny_draft).speculative
    with pytest.raises(ValueError, match=r"group.enabled.*Model Runner V2.*watermarking"):
        engine._check_runner(group)
    aware = tiny_engine_config(
        tiny_target, tiny_draft, speculative={"draft": tiny_draft, "concurrency_aware": True}
    ).speculative
    with caplog.at_level(logging.WARNING, logger="grpo_specdec.engine"):
        engine._check_runner(aware)
    assert any("free k = 0 patch does not act" in r.getMessage() for r in caplog.records)
    engine.runner, engine.patches = "V1", list(vllm_plugin.PATCHED)
    engine._check_runner(group)  # on V1 both act


def test_an_engine_says_which_runner_it_got_and_which_patches_act_in_it(eagle_engine):
    assert eagle_engine.runner == "V1"
    assert set(eagle_engine.patches) == set(vllm_plugin.PATCHED)
    assert {"free_k0_v0_32", "group_drafts_v0_32"} <= set(eagle_engine.patches)
