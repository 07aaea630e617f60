"""vLLM 0.32.0 and 0.33.0, CPU only: no engine can start in a process that has imported numba.

When an engine starts, the CPU platform swaps C++ stand-ins in for vLLM's Triton kernels
(`register_triton_kernel_overrides`). To find every reference to a kernel,
`vllm.triton_utils.dispatcher._rebind_kernels` walks the globals of every loaded module
and, for each value that has a `__dict__`, reads `vars(value).get("kernel")`. llvmlite's
library wrapper (loaded with numba, e.g. by vLLM's own ngram proposer) answers every
attribute lookup, `__dict__` included, with a function wrapper, so `vars()` returns no
mapping and the start fails with "'_lib_fn_wrapper' object has no attribute 'get'":
the engine after an ngram engine in one process, or any engine after `import numba`.

The scan only looks for kernels stored in instance dictionaries, so a value without a
real one holds none: the dispatcher module gets a `vars` that says so.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_plugin.patches import running_on_cpu

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = False


def instance_namespace(value) -> Mapping:
    """`vars(value)`, or an empty mapping where the value has no real namespace."""
    namespace = vars(value)
    return namespace if isinstance(namespace, Mapping) else {}


def applies() -> bool:
    return running_on_cpu(TARGET_VERSIONS)


def apply() -> bool:
    if not applies():
        return False
    from vllm.triton_utils import dispatcher

    # A module global shadows the builtin for the scan's `vars(value)` call alone.
    dispatcher.vars = instance_namespace
    return True
