"""A linear layer's oneDNN handle (vLLM 0.32 CPU) is released wherever the garbage
collector frees it: under every tracing mode torch has, nothing is raised and the release
op runs for real, outside the mode (a mode that intercepted it would fake it: a leak)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._prims.context import TorchRefsMode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_plugin.patches.fixes import cpu_onednn_release_v0_32 as patch


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _traced(drop):
    """make_fx's proxy and fake modes, with the collector running inside the trace."""

    def body(x):
        drop()
        return x * 2

    make_fx(body, tracing_mode="fake")(torch.ones(2))


MODES = {
    "fake tensors": lambda drop: _in(FakeTensorMode(), drop),
    "a dispatch mode": lambda drop: _in(_PassThrough(), drop),
    # torch.compile's decompositions: routes Tensor.item to torch._refs.item, which
    # recursed to the stack limit on a Xeon without bf16
    "torch refs": lambda drop: _in(TorchRefsMode(), drop),
    "a function mode that implements nothing": lambda drop: _in(TorchFunctionMode(), drop),
    "the python dispatcher": lambda drop: _in(enable_python_dispatcher(), drop),
    "make_fx tracing": _traced,
}


def _in(mode, drop):
    with mode:
        drop()


@pytest.mark.parametrize("mode", MODES)
def test_handle_is_released_for_real_under(mode, monkeypatch):
    from vllm import _custom_ops as ops

    assert patch.apply()
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: raised.append(info.exc_value))
    # float32: every x86 CPU has oneDNN matmuls for it (bfloat16 needs AVX512-BF16)
    handler = ops.create_onednn_mm(torch.randn(8, 16), 4)
    handle = int(handler.handler_tensor)
    release = handler.dtor
    released = []

    def recording_release(h):
        # what would intercept the op: any dispatch mode, any function mode
        released.append(
            (h, torch._C._len_torch_dispatch_stack(), torch._C._is_torch_function_mode_enabled())
        )
        release(h)

    handler.dtor = recording_release
    holder = [handler]
    del handler

    def drop():
        holder.clear()
        gc.collect()

    MODES[mode](drop)
    assert raised == []
    assert released == [(handle, 0, False)]


def test_a_tensor_that_is_no_handle_is_refused():
    with pytest.raises(TypeError, match="not a oneDNN handle"):
        patch.read_handle(torch.zeros(2, dtype=torch.int64))
