"""vLLM 0.32.0 and 0.33.0, CPU only: speculative decoding with temperature > 0 samples garbage.

The rejection sampler expands per-request sampling parameters (temperature, top-k,
top-p) to one value per draft token with `expand_kernel`. vLLM's CPU replacement,
`vllm.utils.cpu_triton_utils._expand_kernel_impl`, converts the output tensor to int64
and writes into that copy; for any other dtype (float32 temperatures, int32 top-k) the
result never reaches the real output, which stays uninitialised (`new_empty`). Target
probabilities are then computed with garbage temperatures (NaN or uniform rows), so
outputs no longer follow the target distribution and acceptance collapses.

The fix swaps in a dtype-preserving implementation before the CPU platform registers
its kernel overrides (general plugins load first in every vLLM process).
"""

from __future__ import annotations

import torch

from vllm_plugin.patches import running_on_cpu, runs_v1_model_runner

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = True  # acts only in engines on Model Runner V1


def expand_kernel_impl(
    output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None
):  # noqa: N803
    """Same contract as `vllm.v1.sample.rejection_sampler.expand_kernel`, any dtype."""
    values = torch.where(
        input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val
    )
    counts = torch.diff(
        cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64)
    )
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def applies() -> bool:
    return running_on_cpu(TARGET_VERSIONS) and runs_v1_model_runner()


def apply() -> bool:
    """Install the fix if this process runs the affected vLLM on CPU; returns whether it did."""
    if not applies():
        return False
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    return True
