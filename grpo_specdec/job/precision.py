"""The learners' compute precision: bfloat16 autocast where the hardware runs it fast.

Measured once (docs/benchmarks/learner_precision.md) on this project's 2-core AMD EPYC
(AVX512-BF16, no AMX): one SmolLM2-135M learner step on 32 sequences of 192 tokens takes
45.6 s in fp32 and 18.5 s under bf16 autocast (2.46x), with gradients at cosine 0.9997.
Without bfloat16 instructions the CPU emulates it and autocast loses, so `auto` asks the
CPU (an AVX2-only EPYC: a 512x512 matmul takes 2.8 ms in fp32 and 215 ms in bf16).
"""

from __future__ import annotations

import torch

from vllm_plugin.settings import cpu_has_bf16


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The dtype to autocast to for policy.autocast=`setting` on `device`; None: none."""
    if setting == "off":
        return None
    if setting == "bfloat16" or device.type == "cuda" or cpu_has_bf16():
        return torch.bfloat16
    return None
