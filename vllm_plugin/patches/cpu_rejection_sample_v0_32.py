"""vLLM 0.32.0, CPU only: sampled speculative decoding spends most of a step on noise.

For requests that sample (temperature > 0), `rejection_sample` first draws a recovered
token for *every* draft position, by Gumbel-max over the whole vocabulary, then decides
which drafts are accepted. On CPU the [batch, vocab] exponential draw alone costs ~57 ms
per step for SmolLM2 at 64 sequences (a plain decode step is ~65 ms), and it is paid
even when no token was drafted; at k = 5 it costs more than the model.

This replacement keeps vLLM's rule exactly (accept draft token x with probability
min(1, p(x)/q(x)), q one-hot for greedy drafts; at the first rejection emit a token from
max(p - q, 0) renormalised; after k acceptances emit the bonus token) but decides
acceptance first and samples a recovered token only where a draft was rejected: at most
one row per request, by inverse CDF. Batches that mix greedy and sampled requests, and
synthetic acceptance, go to vLLM's own implementation.
"""

from __future__ import annotations

import torch

TARGET_VERSION = "0.32.0"
_original = None


def rejection_sample(
    draft_token_ids,
    num_draft_tokens,
    max_spec_len,
    cu_num_draft_tokens,
    draft_probs,
    target_logits,
    bonus_token_ids,
    sampling_metadata,
    synthetic_mode=False,
    synthetic_conditional_rates=None,
    use_fp64_gumbel=False,
):
    if synthetic_mode or not sampling_metadata.all_random:
        return _original(
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            synthetic_mode,
            synthetic_conditional_rates,
            use_fp64_gumbel,
        )
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, generate_uniform_probs

    batch = len(num_draft_tokens)
    device = target_logits.device
    out = torch.full(
        (batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device
    )
    counts = torch.as_tensor(num_draft_tokens, dtype=torch.long, device=device)
    n = int(counts.sum())
    if n == 0:
        out[:, 0] = bonus_token_ids.view(-1).to(torch.int32)
        return out

    draft = draft_token_ids.long()
    req = torch.repeat_interleave(torch.arange(batch, device=device), counts)
    pos = torch.arange(n, device=device) - (torch.cumsum(counts, 0) - counts)[req]
    probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    valid = draft >= 0  # -1 marks padded drafts, always rejected
    safe = draft.clamp(min=0)[:, None]
    p = probs.gather(1, safe).squeeze(1)
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(1, safe).squeeze(1)
    uniform = generate_uniform_probs(n, num_draft_tokens, sampling_metadata.generators, device)
    accepted = valid & (q > 0) & (p / q >= uniform)

    # Leading accepted drafts per request: the position of its first rejection, else all.
    n_accepted = counts.clone()
    rejected = ~accepted
    n_accepted.scatter_reduce_(0, req[rejected], pos[rejected], reduce="amin")
    keep = pos < n_accepted[req]
    out[req[keep], pos[keep]] = draft[keep].to(torch.int32)

    # At the first rejection, a token from the residual distribution (one row per request).
    first = rejected & (pos == n_accepted[req])
    rows = first.nonzero().squeeze(1)
    residual = probs[rows]
    if draft_probs is None:
        residual.scatter_(1, safe[rows], 0.0)
    else:
        residual = (residual - draft_probs[rows]).clamp_(min=0.0)
    total = residual.sum(dim=1, keepdim=True)
    nothing = total.squeeze(1) <= 0  # all mass on a padded draft's slot: use p itself
    residual[nothing] = probs[rows][nothing]
    cdf = residual.cumsum(dim=1)
    u = torch.rand(len(rows), 1, device=device, dtype=cdf.dtype) * cdf[:, -1:]
    recovered = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)
    out[req[rows], pos[rows]] = recovered.to(torch.int32)

    done = n_accepted == counts  # every draft accepted: the bonus token follows
    out[done, counts[done]] = bonus_token_ids.view(-1)[done].to(torch.int32)
    return out


def applies() -> bool:
    import vllm
    from vllm.platforms import current_platform

    return vllm.__version__ == TARGET_VERSION and current_platform.is_cpu()


def apply() -> bool:
    global _original
    if not applies():
        return False
    from vllm.v1.sample import rejection_sampler

    if _original is None:
        _original = rejection_sampler.rejection_sample
    rejection_sampler.rejection_sample = rejection_sample
    return True
