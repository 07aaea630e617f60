"""GRPO maths in plain PyTorch: group-normalised advantages and the clipped surrogate."""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def loss_stat_names(kl: bool) -> list[str]:
    """The statistics `grpo_loss` returns (with `kl` when a KL term is on)."""
    return ["clip_frac", "loss"] + (["kl"] if kl else [])


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [groups, G] -> (advantages [groups, G], informative [groups]).

    A = (r - mean(group)) / (std(group) + eps). Groups whose rewards are all equal carry
    no policy-gradient signal; they are flagged uninformative (GRPO skips them for the
    policy update, the draft still learns from them).
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    informative = (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0
    return (rewards - mean) / (std + eps), informative


def first_informative(informative: torch.Tensor, n: int) -> torch.Tensor:
    """The flags of the first `n` informative groups only: dynamic sampling's refilled batch
    trimmed to the update's size, as DAPO does, so that the step size does not depend on how
    many batches it took."""
    return informative & (informative.cumsum(0) <= n)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation) -> torch.Tensor:
    """Reduce a [B, T] per-token loss over the response tokens in `mask`."""
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    per_seq_sum = (per_token * mask).sum(dim=1)
    if mode == "seq_mean_token_sum":
        return per_seq_sum.mean()
    if mode == "seq_mean_token_mean":
        return (per_seq_sum / mask.sum(dim=1).clamp(min=1)).mean()
    raise ValueError(f"unknown aggregation {mode!r}")


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: Aggregation = "token_mean",
) -> tuple[torch.Tensor, dict]:
    """Token-level clipped surrogate. logp/old_logp/ref_logp/mask: [B, T]; advantages: [B]."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    # the clip is active where the clipped term is the smaller one (it then has no gradient)
    stats = {"clip_frac": aggregate((clipped < unclipped).float(), mask, "token_mean").item()}
    if ref_logp is not None and kl_coef > 0:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + kl_coef * kl
        stats["kl"] = aggregate(kl, mask, "token_mean").item()
    loss = aggregate(per_token, mask, aggregation)
    stats["loss"] = loss.item()
    return loss, stats
