"""The one place the project reaches into vLLM 0.32's private engine internals: stopping
one in-process engine while others in the process keep running.

vLLM stops an in-process engine with `EngineCore.shutdown()`, which ends by tearing
down the process-wide distributed state (`cleanup_dist_env_and_memory`) that every
other in-process engine still uses; vLLM's finalizer runs the same when the client is
collected. vLLM 0.32 has no public way to stop one engine only, so `stop_engine` does
the rest of `EngineCore.shutdown()` itself. tests/test_vllm_compat.py fails when the
internals named here change.
"""

from __future__ import annotations

import gc

TARGET_VERSION = "0.32"


def stop_engine(llm, others_alive: bool) -> None:
    """Shut down the engine of vLLM `LLM` object `llm`; with `others_alive`, leave the
    process-wide state that other in-process engines share in place."""
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
