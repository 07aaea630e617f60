"""vLLM plugin of grpo-specdec.

`register()` is the `vllm.general_plugins` entry point; vLLM calls it in every process
it starts. Features (the concurrency-aware scheduler, the weight-swap extension) are
opt-in by configuration. The one thing it does unasked is fix a vLLM 0.32 CPU bug that
breaks sampled speculative decoding (see `patches/`); set GRPO_SPECDEC_NO_PATCHES=1 to
leave vLLM untouched.
"""

import os

LOADED = False
PATCHED: list[str] = []


def register() -> None:
    global LOADED
    LOADED = True
    if os.environ.get("GRPO_SPECDEC_NO_PATCHES") == "1":
        return
    from vllm_plugin.patches import cpu_expand_kernel_v0_32

    if cpu_expand_kernel_v0_32.apply() and "cpu_expand_kernel_v0_32" not in PATCHED:
        PATCHED.append("cpu_expand_kernel_v0_32")
