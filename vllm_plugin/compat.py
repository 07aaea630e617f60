"""The plugin's side of the one adapter for vLLM internals: what vllm_plugin reads of vLLM
0.32.0 and 0.33.0 (and of prometheus_client, as vLLM itself uses it) beyond its documented extension
points, outside the patches in vllm_plugin/patches/ (each of which owns what it patches).

vllm_plugin must not import grpo_specdec, so the internals are split by layer: the ones the
plugin needs live here, the ones grpo_specdec and the benchmarks need live in
grpo_specdec/vllm_compat.py. tests/test_vllm_compat.py fails when anything named here moves,
and checks that no other module reaches into vLLM's internals.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# The vLLM releases whose internals (named here, in grpo_specdec/vllm_compat.py and in each
# patch) were read and are tested (`make test` on 0.32.0, `make test-vllm033` on 0.33.0's own
# code). Any other release loads the plugin with every patch off, and says so on the console.
SUPPORTED_VERSIONS = ("0.32.0", "0.33.0")


@contextmanager
def layerwise_reload(model, model_config, vllm_config):
    """Load weights into a running `model` inside this block (vLLM 0.32.0:
    `vllm.model_executor.model_loader.reload.initialize_layerwise_reload` before,
    `finalize_layerwise_reload` after, under `set_current_vllm_config`): each layer's
    post-load processing runs again, which on CPU repacks the linear weights."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    with set_current_vllm_config(vllm_config):
        initialize_layerwise_reload(model)
        try:
            yield
        finally:
            finalize_layerwise_reload(model, model_config)


def engine_instance_id(vllm_config) -> str:
    """vLLM's id of one engine (`VllmConfig.instance_id`, 0.32 and 0.33), the same on each of
    its ranks: they receive the config the engine was built with."""
    return str(vllm_config.instance_id)


def full_weights(source) -> Iterator[tuple[str, object]]:
    """A trainer's `WeightSource` as full (name, tensor) pairs: vLLM 0.33's sources yield
    them from `iter_full()`, vLLM 0.32's from iterating the source."""
    return source.iter_full() if hasattr(source, "iter_full") else iter(source)


def end_weight_update(worker) -> None:
    """End vLLM 0.32/0.33 worker `worker`'s weight-update session whatever its state: vLLM's
    `finish_weight_update` refuses one that failed on this rank and would commit one that
    must be undone; this clears `Worker._weight_update_active` and resets the transfer
    engine's target, as the worker itself does when an update fails on it."""
    worker._weight_update_active = False
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is not None:
        engine.reset_weight_update_target()
    if getattr(worker, "_weight_update_is_draft", False):
        # vLLM 0.33 loads a draft through the target's unquantized LM head under
        # draft_lm_head_quantization, and puts the quantized copies back as its own failure
        # paths do (`Worker.update_weights`); 0.32 has no such swap.
        try:
            from vllm.model_executor.layers.quantization.online.lm_head import (
                restore_quantized_lm_heads,
            )
        except ImportError:
            return
        draft = worker.get_draft_model()
        if draft is not None:
            restore_quantized_lm_heads(draft, refresh=False)


def is_registered(collector) -> bool:
    """Whether `collector` is in prometheus_client's default registry. prometheus_client
    has no public query for it; this reads `REGISTRY._collector_to_names`, as vLLM 0.32.0's
    own `vllm.v1.metrics.prometheus.unregister_vllm_metrics` does."""
    import prometheus_client

    return collector in prometheus_client.REGISTRY._collector_to_names


def enable_multiprocess_metrics() -> None:
    """Switch this process's metrics to prometheus_client's multiprocess mode, after it was
    first imported: vLLM 0.32.0's `vllm.v1.metrics.prometheus.setup_multiprocess_prometheus`
    (a temporary PROMETHEUS_MULTIPROC_DIR that vLLM removes at exit), then
    `prometheus_client.values.ValueClass`, which prometheus_client picks once at import."""
    from prometheus_client import values
    from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

    setup_multiprocess_prometheus()
    values.ValueClass = values.MultiProcessValue()


def v2_model_runner_setting() -> bool | None:
    """VLLM_USE_V2_MODEL_RUNNER as vLLM 0.32.0 parses it (`vllm.envs.environment_variables`,
    read afresh: `vllm.envs` caches its reads once an engine runs): None where unset, when
    `VllmConfig.use_v2_model_runner` decides by itself."""
    from vllm import envs

    return envs.environment_variables["VLLM_USE_V2_MODEL_RUNNER"]()


def has_triton() -> bool:
    """Whether vLLM 0.32.0 runs Triton kernels in this process: the `HAS_TRITON` that
    `vllm.config.vllm` imports and `VllmConfig.use_v2_model_runner` reads (V2 by default
    where it is true; false on CPU)."""
    from vllm.config import vllm as config_module

    return config_module.HAS_TRITON


def load_general_plugins() -> None:
    """Run vLLM 0.32.0's `vllm.general_plugins` entry points in this process, once, as vLLM
    does before it builds engine arguments (`vllm.plugins.load_general_plugins`)."""
    from vllm.plugins import load_general_plugins as load

    load()


def dense_k_table(table, max_batch: int, k_max: int) -> list[int]:
    """vLLM's static batch-size -> k lookup (index: running requests) for the ranges `table`
    of `num_speculative_tokens_per_batch_size`, as vLLM 0.32.0's scheduler builds it
    (`vllm.v1.spec_decode.dynamic.utils.build_dynamic_sd_schedule_lookup`)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    return build_dynamic_sd_schedule_lookup(table, max_batch, k_max)


async def engine_core_utility(engine, method: str):
    """A method of the engine core (`EngineCore.METHOD`) called from an `AsyncLLM`'s
    process: vLLM 0.32 and 0.33 route any of them through the core client's utility call."""
    return await engine.engine_core.call_utility_async(method)
