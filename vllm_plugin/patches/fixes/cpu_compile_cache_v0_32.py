"""vLLM 0.32.0 and 0.33.0, CPU only: the torch.compile cache never loads, so every start recompiles.

On CPU vLLM compiles with torch's own inductor backend (compilation mode
DYNAMO_TRACE_ONCE). The cached artifact it saves is therefore torch's
`BundledAOTAutogradSerializableCallable`, not vLLM's `VllmSerializableFunction`, yet
vLLM's loader (`_try_load_aot_compiled_fn`) ends every load with
`compiled_fn.finalize_loading(vllm_config)`, which only vLLM's own artifact has. The
AttributeError is logged as "Compiling model again due to a load failure" and the
model is traced and compiled from scratch on every start.

Torch's artifact is complete once deserialised: there is nothing to finalise. The fix
gives it the missing method as a no-op (0.33 still calls it unconditionally:
`compilation/decorators.py`, `_try_load_aot_compiled_fn`).
"""

from __future__ import annotations

from vllm_plugin.patches import running_on_cpu

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = False


def finalize_loading(self, vllm_config) -> None:
    """Nothing to do: torch's bundled artifact is loaded in full when deserialised."""


def applies() -> bool:
    return running_on_cpu(TARGET_VERSIONS)


def apply() -> bool:
    if not applies():
        return False
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    BundledAOTAutogradSerializableCallable.finalize_loading = finalize_loading
    return True
