"""What this project adds to vLLM 0.32 where it has no extension point, one module per
feature (docs/VLLM_PATCHES.md)."""
