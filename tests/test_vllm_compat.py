"""The vLLM internals the adapters rely on (grpo_specdec.vllm_compat above the plugin,
vllm_plugin.compat and the group-drafts patch inside it), stopping one in-process engine,
and that no other module reaches into vLLM's internals."""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import vllm
import vllm.config.vllm as vllm_config_module
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import InprocClient

from grpo_specdec.engine import Engine, SamplingSettings
from grpo_specdec.vllm_compat import (
    in_process_scheduler,
    reread_environment,
)
from tests.conftest import ROOT, tiny_engine_config
from vllm_plugin import compat
from vllm_plugin.compat import dense_k_table
from vllm_plugin.patches.features.group_drafts_v0_32 import DRAFTER_ATTR, group_drafter


def _tree(function) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def _calls(function) -> set[str]:
    """The dotted names `function` calls, e.g. "self.scheduler.shutdown"."""
    return {
        ast.unparse(node.func)
        for node in ast.walk(_tree(function))
        if isinstance(node, ast.Call) and not ast.unparse(node.func).startswith("logger.")
    }


def _assigned(function) -> set[str]:
    """The dotted names `function` assigns to, e.g. "self.scheduler"."""
    return {
        ast.unparse(target)
        for node in ast.walk(_tree(function))
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    }


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_vllm_is_a_version_the_adapter_was_checked_against():
    from packaging.version import Version

    assert Version(vllm.__version__).public in compat.SUPPORTED_VERSIONS


def test_engine_core_shutdown_is_what_stop_engine_repeats_plus_the_process_teardown():
    # stop_engine repeats every step but the last; a new step here must be added there.
    assert _calls(EngineCore.shutdown) == {
        "self.structured_output_manager.clear_backend",
        "self.model_executor.shutdown",
        "self.scheduler.shutdown",
        "gc.unfreeze",
        "cleanup_dist_env_and_memory",
    }


def test_inproc_client_shuts_down_through_a_detachable_finalizer():
    assert "weakref.finalize" in _calls(InprocClient.__init__)
    assert "self._finalizer.detach" in _calls(InprocClient.shutdown)


def test_stopping_one_in_process_engine_leaves_the_others_running(
    tiny_target, plain_engine, questions
):
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    engine = Engine(tiny_engine_config(tiny_target, max_num_seqs=4))
    client = engine.llm.llm_engine.engine_core
    engine.shutdown()
    assert not client._finalizer.alive  # vLLM's full teardown will not run on collection
    assert model_parallel_is_initialized()
    out = plain_engine.generate(questions[:2], SamplingSettings(max_tokens=8))
    assert all(g[0].token_ids for g in out.outputs)


def test_an_in_process_engine_core_holds_its_scheduler_where_the_adapter_reads_it(plain_engine):
    assert "self.engine_core" in _assigned(InprocClient.__init__)
    assert "self.scheduler" in _assigned(EngineCore.__init__)
    assert isinstance(in_process_scheduler(plain_engine.llm), Scheduler)


def test_rereading_the_environment_sees_a_change_made_after_vllm_cached_it(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    envs.enable_envs_cache()  # as vLLM does once an engine has started
    try:
        assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is False  # cached
        reread_environment()
        assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is True
    finally:
        reread_environment()


def test_dense_k_table_is_the_lookup_vllms_scheduler_builds():
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    assert "build_dynamic_sd_schedule_lookup" in _calls(Scheduler.__init__)
    assert _parameters(build_dynamic_sd_schedule_lookup) == [
        "num_speculative_tokens_per_batch_size",
        "vllm_max_batch_size",
        "vllm_num_speculative_tokens",
    ]
    # Index = running requests; a gap between ranges keeps the previous range's k.
    assert dense_k_table([(1, 2, 3), (4, 8, 1)], 8, 3) == [0, 3, 3, 3, 1, 1, 1, 1, 1]


def test_vllms_sampled_draft_returns_tokens_and_the_distribution_q():
    from vllm.v1.spec_decode.llm_base_proposer import compute_probs_and_sample_next_token

    assert _parameters(compute_probs_and_sample_next_token)[:2] == ["logits", "sampling_metadata"]
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]])
    meta = SimpleNamespace(all_greedy=True)
    tokens, _ = compute_probs_and_sample_next_token(logits, meta)
    assert tokens.tolist() == [1, 0]
    meta = SimpleNamespace(
        all_greedy=False, all_random=True, temperature=torch.ones(2), generators={}
    )
    tokens, q = compute_probs_and_sample_next_token(logits, meta)
    assert torch.allclose(q, logits.softmax(-1))
    assert tokens.shape == (2,)


def test_layerwise_reload_calls_are_the_ones_the_adapter_makes():
    from vllm.config import set_current_vllm_config  # noqa: F401  (the adapter uses it)
    from vllm.model_executor.model_loader import reload

    assert {"initialize_layerwise_reload", "finalize_layerwise_reload"} <= set(reload.__all__)
    assert _parameters(reload.initialize_layerwise_reload) == ["model"]
    # finalize_layerwise_reload(*args, **kwargs) forwards to this one.
    assert "finalize_layerwise_processing" in _calls(reload.finalize_layerwise_reload)
    assert _parameters(reload.finalize_layerwise_processing) == ["model", "model_config"]


def test_ending_an_update_session_clears_what_vllms_worker_checks():
    """compat.end_weight_update clears the flag vLLM's worker refuses a new update on, and
    resets the transfer engine's target, as the worker does when an update fails on it."""
    from vllm.v1.worker.gpu_worker import Worker

    failed = inspect.getsource(Worker.update_weights)
    assert "self._weight_update_active = False" in failed
    assert "reset_weight_update_target()" in failed
    assert "if self._weight_update_active:" in inspect.getsource(Worker._start_weight_update)


def test_is_registered_follows_the_default_registry():
    import prometheus_client

    collector = prometheus_client.Counter("grpo_specdec_compat_probe", "probe", registry=None)
    assert not compat.is_registered(collector)
    prometheus_client.REGISTRY.register(collector)
    try:
        assert compat.is_registered(collector)
    finally:
        prometheus_client.REGISTRY.unregister(collector)
    assert not compat.is_registered(collector)


def test_multiprocess_metrics_write_to_the_directory_vllm_sets_up(monkeypatch):
    import prometheus_client
    from prometheus_client import values
    from vllm.v1.metrics import prometheus as vllm_prometheus

    # setenv first: delenv of an unset variable records nothing to undo, and the folder
    # vLLM sets would leak into later tests' subprocesses.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    monkeypatch.setattr(vllm_prometheus, "_prometheus_multiproc_dir", None)
    compat.enable_multiprocess_metrics()
    folder = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    try:
        prometheus_client.Counter("grpo_specdec_compat_mp_probe", "probe", registry=None).inc()
        assert list(folder.glob("counter_*.db"))
    finally:
        vllm_prometheus._prometheus_multiproc_dir.cleanup()


def test_the_worker_holds_the_runner_the_group_drafts_patch_builds_on(plain_engine):
    def drafter_slot(worker):
        runner = worker.model_runner
        return hasattr(runner, DRAFTER_ATTR), group_drafter(runner)

    assert plain_engine.llm.collective_rpc(drafter_slot) == [(True, None)]
    assert group_drafter(SimpleNamespace()) is None


@pytest.mark.parametrize(("value", "parsed"), [(None, None), ("0", False), ("1", True)])
def test_the_runner_setting_is_read_as_vllm_reads_it(monkeypatch, value, parsed):
    if value is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    reread_environment()
    assert compat.v2_model_runner_setting() is parsed
    assert vllm.envs.VLLM_USE_V2_MODEL_RUNNER is parsed


def test_has_triton_is_the_flag_vllms_runner_decision_reads(monkeypatch):
    assert "HAS_TRITON" in vllm_config_module.VllmConfig.use_v2_model_runner.fget.__code__.co_names
    for flag in (True, False):
        monkeypatch.setattr(vllm_config_module, "HAS_TRITON", flag)
        assert compat.has_triton() is flag


# ---- no vLLM internals outside the adapters ----------------------------------------------
ADAPTERS = {"grpo_specdec/vllm_compat.py", "vllm_plugin/compat.py"}
SCANNED = ("grpo_specdec", "vllm_plugin", "benchmarks")
# vLLM modules its documentation makes public (LLM and SamplingParams, configs, platforms,
# plugins, and the Scheduler classes that `scheduler_cls` subclasses).
PUBLIC_VLLM = {
    "vllm",
    "vllm.config",
    "vllm.platforms",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.sched.async_scheduler",
    # the RL weight-transfer API: engines subclass its base and register with its factory
    "vllm.distributed.weight_transfer.base",
    "vllm.distributed.weight_transfer.factory",
    "vllm.distributed.weight_transfer.clients",
}
# Private names of other libraries, not of vLLM.
NOT_VLLM = {("grpo_specdec/draft/head_model.py", "_attn_implementation")}  # transformers' config


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _on_own_object(node: ast.AST) -> bool:
    """`self`, `cls` or `super()`: a class reaching into what it defines or inherits."""
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def internal_uses(path: str, source: str) -> list[str]:
    """Where `source` (the file at `path`) reaches into vLLM internals: an import of a vLLM
    module outside PUBLIC_VLLM, a private attribute of an object not its own (directly or
    through getattr and kin), or vLLM's engine-core chain."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            )
            for module in modules:
                if module and module.split(".")[0] == "vllm" and module not in PUBLIC_VLLM:
                    found.append(f"{path}:{node.lineno}: imports {module}")
        elif isinstance(node, ast.Attribute):
            if node.attr == "engine_core" or (
                _is_private(node.attr)
                and not _on_own_object(node.value)
                and (path, node.attr) not in NOT_VLLM
            ):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and not _on_own_object(node.args[0])
        ):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_internal_uses_finds_each_kind_of_reach_into_vllm():
    source = textwrap.dedent(
        """
        import vllm.envs
        from vllm import LLM
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
        llm.llm_engine.engine_core.engine_core.scheduler
        registry._collector_to_names
        getattr(self.model_runner, "_grpo_group", None)
        self._mine, getattr(self, "_mine"), obj.__class__, super()._mine
        super(Other, obj)._theirs
        """
    )
    assert sorted(use.split(": ", 1)[1] for use in internal_uses("x.py", source)) == [
        "getattr(self.model_runner, '_grpo_group', None)",
        "imports vllm.envs",
        "imports vllm.v1.spec_decode.dynamic.utils",
        "llm.llm_engine.engine_core",
        "llm.llm_engine.engine_core.engine_core",
        "registry._collector_to_names",
        "super(Other, obj)._theirs",
    ]


def test_only_the_adapters_and_patches_reach_into_vllm_internals():
    found = []
    for top in SCANNED:
        for file in sorted((ROOT / top).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            if path in ADAPTERS or path.startswith("vllm_plugin/patches/"):
                continue
            found += internal_uses(path, file.read_text())
    assert not found, "vLLM internals outside the adapters:\n" + "\n".join(found)
