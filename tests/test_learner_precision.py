"""The policy learner under bfloat16 autocast computes the GRPO loss and gradient that
fp32 computes, within stated tolerances (measured on the tiny model, AVX512-BF16 EPYC:
loss 0.04% of the terms' scale apart, gradient cosine 0.9992, per-token log-probs 0.008
nats apart on average).

The loss is compared on the scale of its terms, mean |ratio * advantage| over response
tokens, not on its own value: advantages of both signs cancel in the mean (here to about
a fifth of the terms' scale, a property of the seed), while rounding errors scale with the
terms. Measured against the loss itself, a CPU without bf16 instructions (autocast
emulated, rounding otherwise) read 1.18% against a 1% bound; on the terms' scale that is
0.20%, a fifth of the bound. The bound (1%) sits at half the per-token log-prob bound
(0.02 nats, which moves each ratio by about 2%), since a loss error is the advantage-weighted
mean of those ratio errors, whose signs vary."""

from __future__ import annotations

import torch

from grpo_specdec.draft.capture import pad_batch
from grpo_specdec.grpo.core import grpo_loss
from grpo_specdec.job import precision
from grpo_specdec.job.config import PolicySettings
from grpo_specdec.job.learners import PolicyLearner, _response_mask, response_logprobs

LOSS_OF_TERMS = 0.01  # of mean |ratio * advantage| over response tokens
GRAD_COSINE = 0.995
LOGP_MEAN_ABS = 0.02  # nats per response token


def test_bf16_autocast_matches_fp32(tiny_target):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 60, (16,), generator=g).tolist()
    ids, mask = pad_batch([torch.randint(0, 200, (n,), generator=g).tolist() for n in lengths])
    resp = _response_mask(mask, [8] * len(lengths))
    adv = torch.randn(len(lengths), generator=g)
    shift = 0.1 * torch.randn(ids.shape, generator=g)  # old log-probs != new: ratios != 1
    results = {}
    for autocast in ("off", "bfloat16"):
        learner = PolicyLearner(tiny_target, PolicySettings(autocast=autocast))
        _, logits, _ = learner._forward(learner.model, ids, mask)
        logp = response_logprobs(logits, ids)
        old = results["off"][2] + shift if results else logp.detach() + shift
        loss, _ = grpo_loss(logp, old, adv, resp)
        terms = (torch.exp(logp.detach() - old) * adv[:, None]).abs()[resp].mean().item()
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in learner.model.parameters()])
        results[autocast] = (loss.item(), grad, logp.detach(), logits.dtype, terms)
    fp32, bf16 = results["off"], results["bfloat16"]
    assert (fp32[3], bf16[3]) == (torch.float32, torch.bfloat16)  # autocast really ran
    assert abs(bf16[0] - fp32[0]) <= LOSS_OF_TERMS * fp32[4]
    assert torch.nn.functional.cosine_similarity(fp32[1], bf16[1], dim=0) >= GRAD_COSINE
    assert (fp32[2] - bf16[2])[resp].abs().mean() <= LOGP_MEAN_ABS


def test_auto_autocasts_where_the_hardware_has_bf16(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for has_bf16 in (True, False):
        monkeypatch.setattr(precision, "cpu_has_bf16", lambda has=has_bf16: has)
        assert precision.autocast_dtype("auto", cpu) == (torch.bfloat16 if has_bf16 else None)
        assert precision.autocast_dtype("auto", cuda) == torch.bfloat16
        assert precision.autocast_dtype("off", cuda) is None
        assert precision.autocast_dtype("bfloat16", cpu) == torch.bfloat16


def test_engine_dtype_auto_is_float32_on_a_cpu_without_bf16(tiny_target, monkeypatch):
    """vLLM 0.32 runs even a float32 checkpoint in bfloat16 on an x86 CPU, emulated where
    the CPU has no bfloat16 instructions (~20x slower per step): there "auto" is float32."""
    from vllm_plugin import settings

    monkeypatch.setattr(settings, "cpu_has_bf16", lambda: False)
    assert settings.engine_dtype(tiny_target, "auto") == "float32"
    monkeypatch.setattr(settings, "cpu_has_bf16", lambda: True)
    assert settings.engine_dtype(tiny_target, "auto") == "bfloat16"  # vLLM's own choice
    assert settings.engine_dtype(tiny_target, "float16") == "float16"  # asked: kept
