"""vLLM 0.32.0 and 0.33.0, CPU only: sampled speculative decoding spends most of a step on noise.

For requests that sample (temperature > 0), `rejection_sample` first draws a recovered
token for *every* draft position, by Gumbel-max over the whole vocabulary, then decides
which drafts are accepted. On CPU the [batch, vocab] exponential draw alone costs ~57 ms
per step for SmolLM2 at 64 sequences (a plain decode step is ~65 ms), and it is paid
even when no token was drafted; at k = 5 it costs more than the model.

This replacement keeps vLLM's rule exactly (accept draft token x with probability
min(1, p(x)/q(x)), q one-hot for greedy drafts; at the first rejection emit a token from
max(p - q, 0) renormalised, p itself after a padded draft (id -1); after k acceptances
emit the bonus token) but decides acceptance first and samples a recovered token only
where a draft was rejected: at most one row per request, by inverse CDF in float64, with
the request's own generator when it has one. Batches that mix greedy and sampled
requests, and synthetic acceptance, go to vLLM's own implementation.

Draft probabilities may come in a reduced draft vocabulary (`cpu_sampled_drafts_v0_32`):
then the runner hands on, with that very tensor, a `DraftLayout` (`hand_on`) naming the
target ids of its columns, and q is read through them, zero elsewhere. A padded draft has
no q behind it: its recovered token comes from p whatever its q row holds. Rows the layout
flags one-hot (the group's drafts in a batch of sampled ones, `group_drafts_v0_32`) are a
deterministic draft: accepted with probability p(x), else a token from p without x.

`use_fp64_gumbel` asks for float64 sampling noise; this path draws and accumulates in
float64 whatever its value, so the flag is met without being read.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from vllm_plugin.patches import running_on_cpu, runs_v1_model_runner

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = True  # acts only in engines on Model Runner V1
_original = None


@dataclass(frozen=True)
class DraftLayout:
    """How to read a draft-probabilities tensor other than vLLM's [drafts, target vocab]."""

    vocab_ids: torch.Tensor | None = None  # its columns' target ids (a reduced vocabulary)
    # a bool per row: the draft token was chosen outright, not sampled from a q (its q is
    # one-hot at it, whatever the row holds)
    one_hot: torch.Tensor | None = None


# The layout of the one q in flight: the runner makes q and verification reads it in the
# same step of the same process, so one slot, tied to the tensor itself, is enough.
_handed: tuple[weakref.ref, DraftLayout] | None = None


def hand_on(draft_probs: torch.Tensor, layout: DraftLayout) -> None:
    """Pass `layout` on with `draft_probs` to the rejection sampler."""
    global _handed
    _handed = (weakref.ref(draft_probs), layout)


def layout_of(draft_probs: torch.Tensor | None) -> DraftLayout:
    """The layout handed on with this very tensor (vLLM's own where none was)."""
    if draft_probs is not None and _handed is not None and _handed[0]() is draft_probs:
        return _handed[1]
    return DraftLayout()


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
    **fly,
):
    """vLLM's `rejection_sample`; `fly` holds 0.33's FLy arguments (`fly_window_size`, ...),
    which vLLM refuses on CPU and this path hands to vLLM's own implementation."""
    layout = layout_of(draft_probs)
    vocab_ids, one_hot = layout.vocab_ids, layout.one_hot
    if synthetic_mode or not sampling_metadata.all_random or fly.get("fly_window_size") is not None:
        if vocab_ids is not None:
            draft_probs = to_target_vocab(draft_probs, vocab_ids, target_logits.shape[1])
        if one_hot is not None:
            draft_probs = with_one_hot_rows(draft_probs, one_hot, draft_token_ids)
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
            **fly,
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
    # p at the drafted tokens from one log-sum-exp pass; whole rows of p only where a draft
    # was rejected (at most one per request), not [num_tokens, vocab] of them.
    logits = target_logits.float()
    valid = draft >= 0  # -1 marks padded drafts, always rejected
    safe = draft.clamp(min=0)[:, None]
    p = (logits.gather(1, safe).squeeze(1) - torch.logsumexp(logits, dim=-1)).exp()
    if draft_probs is None:
        q = torch.ones_like(p)
    elif vocab_ids is None:
        q = draft_probs.gather(1, safe).squeeze(1)
    else:
        column = torch.full((target_logits.shape[1],), -1, dtype=torch.long, device=device)
        column[vocab_ids] = torch.arange(len(vocab_ids), device=device)
        at = column[safe.squeeze(1)]
        q = draft_probs.gather(1, at.clamp(min=0)[:, None]).squeeze(1).masked_fill(at < 0, 0.0)
    if one_hot is not None:
        q = torch.where(one_hot, 1.0, q)
    uniform = generate_uniform_probs(n, num_draft_tokens, sampling_metadata.generators, device)
    accepted = valid & (q > 0) & (p / q >= uniform)

    # Leading accepted drafts per request: the position of its first rejection, else all.
    n_accepted = counts.clone()
    rejected = ~accepted
    n_accepted.scatter_reduce_(0, req[rejected], pos[rejected], reduce="amin")
    keep = pos < n_accepted[req]
    out[req[keep], pos[keep]] = draft[keep].to(torch.int32)

    # At the first rejection, a token from the residual distribution (one row per request).
    rows = (rejected & (pos == n_accepted[req])).nonzero().squeeze(1)
    target = logits[rows].softmax(dim=-1)
    # What the rejected draft takes out of p; a padded draft takes nothing out.
    residual = target.clone()
    hit = valid[rows].nonzero().squeeze(1)
    chosen = hit if one_hot is None else hit[~one_hot[rows[hit]]]  # a sampled draft's rows
    if draft_probs is None:
        residual[hit, draft[rows[hit]]] = 0.0
    elif vocab_ids is None:
        residual[chosen] = (target[chosen] - draft_probs[rows[chosen]]).clamp_(min=0.0)
    else:
        drafted = residual[chosen][:, vocab_ids] - draft_probs[rows[chosen]]
        residual[chosen[:, None], vocab_ids[None, :]] = drafted.clamp_(min=0.0)
    if draft_probs is not None and one_hot is not None:
        outright = hit[one_hot[rows[hit]]]
        residual[outright, draft[rows[outright]]] = 0.0
    # Nothing left (p <= q everywhere, so p == q up to rounding): sample p itself.
    exhausted = residual.sum(dim=1) <= 0
    residual[exhausted] = target[exhausted]
    u = torch.rand(len(rows), dtype=torch.float64, device=device)
    generators = sampling_metadata.generators
    if generators:
        for i, r in enumerate(req[rows].tolist()):
            if r in generators:
                u[i : i + 1].uniform_(generator=generators[r])
    out[req[rows], pos[rows]] = inverse_cdf(residual, u).to(torch.int32)

    done = n_accepted == counts  # every draft accepted: the bonus token follows
    out[done, counts[done]] = bonus_token_ids.view(-1)[done].to(torch.int32)
    return out


def to_target_vocab(q: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q over a reduced vocabulary as rows over the target's (zero outside it)."""
    dense = q.new_zeros(len(q), vocab_size)
    dense[:, vocab_ids] = q
    return dense


def with_one_hot_rows(q: torch.Tensor, one_hot: torch.Tensor, draft_token_ids) -> torch.Tensor:
    """q (over the target's vocabulary) with the flagged rows one-hot at their draft token."""
    q = q.clone()
    drafted = draft_token_ids.long()
    rows = (one_hot & (drafted >= 0)).nonzero().squeeze(1)  # a padded draft keeps its row
    q[rows] = 0.0
    q[rows, drafted[rows]] = 1.0
    return q


def inverse_cdf(weights, u):
    """Per row of `weights`, the first index whose running sum exceeds u * the row's total."""
    # Near 1 a float32 running sum moves in steps of 6e-8, so a token lighter than that gets
    # none or twice its share: over a ~49k vocabulary up to ~1e-3 of the mass is misplaced.
    cdf = weights.double().cumsum(dim=1)
    point = (u * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, point, right=True).squeeze(1)
    return index.clamp_(max=weights.shape[1] - 1)


def applies() -> bool:
    return running_on_cpu(TARGET_VERSIONS) and runs_v1_model_runner()


def apply() -> bool:
    global _original
    if not applies():
        return False
    from vllm.v1.sample import rejection_sampler

    if _original is None:
        _original = rejection_sampler.rejection_sample
    rejection_sampler.rejection_sample = rejection_sample
    return True
