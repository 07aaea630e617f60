"""The batch-size table a concurrency-aware engine gives vLLM: one range per k, 0 to k_max.

`ConcurrencyAwareScheduler` replaces the dense batch-size -> k lookup vLLM builds from
`num_speculative_tokens_per_batch_size`, so the table's ranges never choose a step's k.
What vLLM still reads from the table is which k a step may run, and it prepares CUDA graphs
from that (vLLM 0.32): Model Runner V2, vLLM's default on CUDA, captures FULL decode graphs
for each k in the dense lookup (`vllm/v1/worker/gpu/cudagraph_utils.py`,
`CudaGraphManager._init_candidates`), so a table that lists every k gives every k its own;
one that lists only k_max leaves a step at any other k, k = 0 included, to PIECEWISE graphs.
On Model Runner V1 any table turns the whole engine PIECEWISE
(`VllmConfig._maybe_override_dynamic_sd_cudagraph_mode`). `tests/test_cuda_graphs.py`
asks vLLM's own code for both.
"""

from __future__ import annotations


def every_k_table(k_max: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """`num_speculative_tokens_per_batch_size` listing each k in 0..k_max: k_max at B = 1
    down to 1 at B = k_max, and 0 from B = k_max + 1 on (dummy ranges, in the shape a
    profiled table has). vLLM keeps the ranges up to `max_num_seqs`, so an engine running
    at most k_max sequences lists fewer k (the scheduler warns which, where CUDA graphs
    run: `scheduler.check_engine`)."""
    if k_max < 1:
        raise ValueError(f"k_max must be at least 1, got {k_max}")
    return [(b, b, k_max + 1 - b) for b in range(1, k_max + 1)] + [
        (k_max + 1, max(max_num_seqs, k_max + 1), 0)
    ]
