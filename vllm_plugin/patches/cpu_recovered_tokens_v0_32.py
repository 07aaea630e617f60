"""vLLM 0.32.0, CPU only: sampled speculative decoding pays a full-vocabulary Gumbel noise
draw per request every step, even when nothing was drafted.

`vllm.v1.sample.rejection_sampler.sample_recovered_tokens` (the token emitted where a
draft is rejected) draws exponential noise of shape [batch, vocab] and takes
argmax(p / noise). On CPU that draw dominates: SmolLM2 at 64 sequences spends ~57 ms per
step on it (a plain decode step is ~65 ms), and spends it when k = 0 too, which makes a
speculative engine ~45% slower than a plain one at temperature 1 with no drafts at all.

The replacement samples the same distribution (p with the draft token's mass removed,
or max(p - q, 0) with draft probabilities) by inverse CDF with torch.multinomial, only
over draft positions, and returns at once when there are none. Per-request seeded
generators are not consulted; vLLM 0.32 on CPU already fails on seeded requests with
speculation, before reaching this point.
"""

from __future__ import annotations

import torch

TARGET_VERSION = "0.32.0"


def sample_recovered_tokens(
    max_spec_len,
    num_draft_tokens,
    cu_num_draft_tokens,
    draft_token_ids,
    draft_probs,
    target_probs,
    sampling_metadata,
    device,
    use_fp64_gumbel=False,
):
    """Same contract as vLLM's: one recovered token per draft position, [num_tokens]."""
    if draft_token_ids.numel() == 0:
        return torch.empty_like(draft_token_ids)
    if draft_probs is None:  # a one-hot draft: drop the drafted token's mass
        residual = target_probs.clone()
        residual.scatter_(1, draft_token_ids.long()[:, None], 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    # Where the target put all its mass on the drafted token, the draft is always
    # accepted and the recovered token is never used; keep the row valid anyway.
    empty = residual.sum(dim=-1) <= 0
    if empty.any():
        residual[empty] = target_probs[empty]
    return torch.multinomial(residual, 1).squeeze(1).to(draft_token_ids.dtype)


def applies() -> bool:
    import vllm
    from vllm.platforms import current_platform

    return vllm.__version__ == TARGET_VERSION and current_platform.is_cpu()


def apply() -> bool:
    if not applies():
        return False
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.sample_recovered_tokens = sample_recovered_tokens
    return True
