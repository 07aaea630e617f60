"""vLLM 0.32.0 and 0.33.0, Model Runner V2 with a per-step k (dynamic speculative
decoding): a decode step runs piecewise when the next captured size above it belongs to another k.

`CudaGraphManager._init_candidates` maps each token count to the graphs of the smallest
captured size at or above it, and `dispatch` takes the first of those the step fits, else
falls back to PIECEWISE. With one query length per decode step that is the right graph.
With a per-step k the FULL decode graphs of several query lengths (1 + k) interleave: a
k = 0 step of 9 requests (9 tokens) finds only the 9-token graph of k = 2 (3 requests of 3
tokens) and runs piecewise, although a 10-token k = 0 graph was captured. On the config of a
concurrency-aware engine at k_max = 5 and 256 sequences, as vLLM plans it, k = 0 had a FULL
graph at 166 of the 256 batch sizes, k = 2 at 75 of 170 (`tests/test_cuda_graphs.py`).

The fix: once vLLM has built the map, each token count also gets, per query length, the
smallest FULL decode graph at or above it, after the FULL graphs vLLM matched there and
before the piecewise ones, so a step takes what it took before where that was FULL, else
the nearest FULL graph of its own k. Engines without a per-step k are left as they are.
"""

from __future__ import annotations

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = False


def add_nearest_full_graphs(manager) -> None:
    """Extend `manager._candidates` (a built `CudaGraphManager`) as the docstring says."""
    from vllm.config.compilation import CUDAGraphMode

    spec = manager.vllm_config.speculative_config
    if spec is None or not spec.uses_dynamic_speculative_decoding():
        return
    full = sorted(
        (
            d
            for d in manager._capture_descs.get(CUDAGraphMode.FULL, [])
            if d.uniform_token_count is not None
        ),
        key=lambda d: d.num_tokens,
    )
    for (num_tokens, loras), candidates in manager._candidates.items():
        nearest = {}
        for desc in full:
            if desc.num_tokens >= num_tokens and desc.num_active_loras == loras:
                nearest.setdefault((desc.uniform_token_count, desc.num_ubatches), desc)
        extra = [d for d in nearest.values() if d not in candidates]
        if extra:
            at = next(
                (i for i, d in enumerate(candidates) if d.cg_mode != CUDAGraphMode.FULL),
                len(candidates),
            )
            candidates[at:at] = sorted(extra, key=lambda d: d.num_tokens)


def _wrap(original):
    def _init_candidates(self):
        original(self)
        add_nearest_full_graphs(self)

    _init_candidates._grpo_original = original
    return _init_candidates


def applies() -> bool:
    """vLLM 0.32.0 or 0.33.0 where Triton runs, so Model Runner V2 can (CUDA, ROCm)."""
    from vllm_plugin import compat
    from vllm_plugin.patches import vllm_is

    return vllm_is(TARGET_VERSIONS) and compat.has_triton()


def apply() -> bool:
    if not applies():
        return False
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    if not hasattr(CudaGraphManager._init_candidates, "_grpo_original"):
        CudaGraphManager._init_candidates = _wrap(CudaGraphManager._init_candidates)
    return True
