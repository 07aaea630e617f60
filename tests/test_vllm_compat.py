"""The vLLM internals grpo_specdec.vllm_compat relies on, and stopping one in-process engine."""

from __future__ import annotations

import ast
import inspect
import textwrap

import vllm
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import InprocClient

from grpo_specdec.engine import Engine, SamplingSettings
from grpo_specdec.vllm_compat import TARGET_VERSION
from tests.conftest import tiny_engine_config


def _calls(function) -> set[str]:
    """The dotted names `function` calls, e.g. "self.scheduler.shutdown"."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        ast.unparse(node.func)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and not ast.unparse(node.func).startswith("logger.")
    }


def test_vllm_is_the_version_the_adapter_targets():
    assert vllm.__version__.startswith(TARGET_VERSION + ".")


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
