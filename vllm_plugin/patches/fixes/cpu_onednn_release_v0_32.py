"""vLLM 0.32.0 and 0.33.0, CPU only: engine starts could abort with a fatal stack overflow.

Each linear layer on CPU owns a oneDNN matmul handle; `CPUDNNLGEMMHandler.__del__`
releases it with `handler_tensor.item()`. When an EAGLE draft shares the target's
lm_head, the draft's own lm_head (and its handle) is dropped inside a reference cycle,
so it is freed by the cyclic garbage collector at an arbitrary later moment: usually
while torch.compile traces the model under a FakeTensorMode. There `.item()` on a real
tensor is intercepted by the mode and fails deep inside its dispatch, the handle leaks,
and when the collection happens near the recursion limit the interpreter aborts
("Cannot recover from stack overflow").

The replacement calls nothing that a mode can intercept: it reads the handle (a plain
int64 CPU tensor vLLM made at load time) straight from the tensor's memory, and calls the
release op with torch-function modes (TorchRefsMode, which routes `.item()` to
`torch._refs.item` and recursed there, and any user mode) and dispatch modes
(FakeTensorMode, which would run the op's fake kernel and leak the handle) set aside.
tests/test_onednn_release.py drops handles under each mode this torch has.
"""

from __future__ import annotations

import ctypes

import torch
from torch.utils._python_dispatch import _disable_current_modes

from vllm_plugin.patches import running_on_cpu

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = False


def read_handle(tensor: torch.Tensor) -> int:
    """The int64 a one-element CPU tensor holds, read without dispatching any op."""
    with torch._C.DisableTorchFunction():
        if tensor.dtype != torch.int64 or tensor.device.type != "cpu" or tensor.numel() != 1:
            raise TypeError(f"not a oneDNN handle tensor: {tensor.dtype} {tensor.shape}")
        return ctypes.c_int64.from_address(tensor.data_ptr()).value


def release_handle(handler) -> None:
    """`CPUDNNLGEMMHandler.__del__`, safe under tracing modes."""
    tensor = handler.handler_tensor
    if tensor is None:
        return
    handle = read_handle(tensor)
    with torch._C.DisableTorchFunction():
        if torch._C._len_torch_dispatch_stack() == 0:
            # The common case, and the only one at interpreter exit, when the mode
            # machinery can no longer import what it needs.
            handler.dtor(handle)
        else:
            with _disable_current_modes():
                handler.dtor(handle)


def applies() -> bool:
    return running_on_cpu(TARGET_VERSIONS)


def apply() -> bool:
    if not applies():
        return False
    from vllm import _custom_ops

    _custom_ops.CPUDNNLGEMMHandler.__del__ = release_handle
    return True
