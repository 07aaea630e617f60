"""Fixes of vLLM 0.32 bugs, one module per bug (docs/VLLM_PATCHES.md)."""
