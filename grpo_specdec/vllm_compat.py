"""The one place grpo_specdec and the benchmarks reach into vLLM's internals (0.32.0 and
0.33.0, `vllm_plugin.compat.SUPPORTED_VERSIONS`, read in each):
stopping one in-process engine while others in the process keep running, reaching an
in-process engine's scheduler, re-reading the environment, and two functions of vLLM's
speculative decoding that the benchmarks compare against.

vllm_plugin must not import grpo_specdec, so the plugin's own reads of vLLM internals live
in vllm_plugin/compat.py (and each patch in vllm_plugin/patches/ owns what it patches);
everything above the plugin goes through this module. tests/test_vllm_compat.py fails
when the internals named here change, and checks that no other module reaches into them.

vLLM stops an in-process engine with `EngineCore.shutdown()`, which ends by tearing
down the process-wide distributed state (`cleanup_dist_env_and_memory`) that every
other in-process engine still uses; vLLM's finalizer runs the same when the client is
collected. vLLM 0.32 and 0.33 have no public way to stop one engine only, so `stop_engine` does
the rest of `EngineCore.shutdown()` itself.
"""

from __future__ import annotations

import gc


def stop_engine(llm, others_alive: bool) -> None:
    """Shut down the engine of vLLM `LLM` object `llm`; with `others_alive`, leave the
    process-wide state that other in-process engines share in place (vLLM 0.32.0:
    `InprocClient._finalizer` and the steps of `EngineCore.shutdown`)."""
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    if not (others_alive and isinstance(client, InprocClient)):
        client.shutdown()
        return
    if client._finalizer.detach() is None:
        return  # already shut down
    core = client.engine_core
    core.structured_output_manager.clear_backend()
    core.model_executor.shutdown()
    core.scheduler.shutdown()
    gc.unfreeze()  # objects the engine froze at start-up become collectable again


def in_process_scheduler(llm):
    """The scheduler object of vLLM `LLM` object `llm` whose engine core runs in this
    process (vLLM 0.32.0: `llm.llm_engine.engine_core` is an `InprocClient`, its
    `engine_core` the `EngineCore`, whose `scheduler` is the `scheduler_cls` instance)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def reread_environment() -> None:
    """Make vLLM read its environment variables afresh (vLLM 0.32.0 caches them once an
    engine runs; `vllm.envs.disable_envs_cache` drops that cache)."""
    import vllm.envs as envs

    envs.disable_envs_cache()
