"""The lossless check (`assert_same_distribution`, tests/conftest.py) has the power it
claims: a bias of total variation 0.05 planted into the tokens each speculative path
samples is rejected, and the same engines without it pass.

The check. The target's exact next-token distribution p_t = p(. | context) is known for
every T = 1 token y_t (the plain engine's logprobs over the whole vocabulary); y_t is
counted in one of four bins of p_t: its most likely token; another with p_t >= 0.05;
0.005 <= p_t < 0.05; below 0.005. If the engine is lossless, y_t ~ p_t given everything
before it, so the count vector O has mean E = sum_t m_t and covariance
C = sum_t (diag m_t - m_t m_t^T) exactly (m_t: p_t's mass per bin), and by the martingale
CLT S = (O - E)^T C^-1 (O - E) (one bin dropped) is chi-square with 3 degrees of freedom.
The check fails when P(chi2_3 > S) < 1e-4 (S > 21.1).

The calculation, on the tiny target's contexts of the callers (3 prompts x 200 samples x
positions 1-5 = 3000 tokens; at odd positions the target is nearly certain, median
p_top 0.998, at even ones spread, median p_top 0.22-0.27). Expected counts 2191, 689, 99,
21 per bin.
- False alarms: S simulated 200,000 times from those contexts' exact bin masses exceeds
  21.1 at a rate of 1.8e-4 (positions 0-5, 3600 tokens: 1.6e-4); 1.1e-3 at the 1e-3
  threshold. The smallest bin's 21 expected tokens make the tail a little heavier than
  chi-square's.
- Power against TV 0.05 at every step (possible on this target only by moving mass away
  from its likely token): moving 0.05 of the most likely token's mass to the others in
  proportion gives a noncentrality of 430; a tempering p^beta (beta < 1) with TV 0.05
  per step, 590. Power > 0.9999 even when only 45% of the tokens are biased (as when
  only the free k = 0 steps are: noncentrality 87). Towards the likely token a step
  carries TV 0.05 only where p_top <= 0.95, so such a bias averages TV 0.022 per token
  here: noncentrality 19, power about 0.5 (0.7 at a 1e-3 threshold): a limit of 3000
  tokens, not of the bins (the top-token count alone, that bias's likelihood-ratio
  direction, gives 18). Bins tried first: the target's rank (1, 2-3, 4-10, 11+): 117 away,
  18 towards; ten equal-mass bins of a randomised PIT: 35 and 5.

Here the planted bias is that away-from-the-top change, made to the target's logits of
exactly the steps a path owns, in the engine's own process, its TV recorded per row
(min(tv, p_top): 0.05 on all but a few rows). Free k = 0: the steps that verify no draft
(the plain sampler, `free_k0_v0_32`); group drafts and sampled drafts: the steps that
verify drafts (the rejection sampler); the sampled-drafts case, and a bug of that path
(q rows misaligned by one), are in test_sampled_drafts.py, next to its engines.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from grpo_specdec.engine import SamplingSettings
from tests.conftest import LOSSLESS_ALPHA, target_fit
from tests.test_free_k0 import _generate as generate_under_the_step_cycle
from tests.test_free_k0 import engine  # noqa: F401  (the free-k0 engine fixture)
from tests.test_group_drafts import group_engine, profile  # noqa: F401

TV = 0.05
T1 = SamplingSettings(n=200, temperature=1.0, max_tokens=6, ignore_eos=True)


def away_from_the_top(logits: torch.Tensor, tv: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of p with min(tv, p_top) of its most likely token's mass given to the other
    tokens in proportion to theirs, and that TV per row (exact: the top token loses what
    the others gain)."""
    p = logits.double().softmax(-1)
    top = p.argmax(-1, keepdim=True)
    p_top = p.gather(-1, top)
    moved = p_top.clamp(max=tv)
    q = p * (1 + moved / (p.sum(-1, keepdim=True) - p_top))
    q.scatter_(-1, top, p_top - moved)
    return q.log().to(logits.dtype), moved.squeeze(-1)


@contextmanager
def planted_bias(spec_engine, verifying: bool):
    """Within the block, the steps of `spec_engine` that verify drafts (`verifying`) or that
    verify none sample from away_from_the_top(target). Yields the TVs of the rows planted."""
    planted = []

    def plant(worker):
        runner = worker.model_runner
        sample = runner._sample

        def biased(logits, spec_decode_metadata):
            drafts = spec_decode_metadata is not None and spec_decode_metadata.max_spec_len > 0
            if drafts == verifying:
                logits, moved = away_from_the_top(logits, TV)
                planted.append(moved)
            return sample(logits, spec_decode_metadata)

        runner._sample = biased

    spec_engine.llm.collective_rpc(plant)
    try:
        yield planted
    finally:
        spec_engine.llm.collective_rpc(lambda worker: delattr(worker.model_runner, "_sample"))


def assert_rejects_only_the_bias(generate, spec_engine, plain_engine, verifying, positions):
    """`generate()` from `spec_engine` passes the check, and fails it with the bias planted."""
    fair = target_fit(generate(), plain_engine, positions)
    with planted_bias(spec_engine, verifying) as planted:
        biased = target_fit(generate(), plain_engine, positions)
    moved = torch.cat(planted)
    assert len(moved) > 1000 and (moved == TV).double().mean() > 0.99, moved
    assert fair.p_value > LOSSLESS_ALPHA > biased.p_value, (fair, biased)


def test_free_k0_steps_with_a_planted_bias_are_rejected(engine, plain_engine, questions):  # noqa: F811
    skipped = []

    def generate():
        result, (skipped_passes, _) = generate_under_the_step_cycle(engine, True, questions[:3], T1)
        skipped.append(skipped_passes)
        return result

    assert_rejects_only_the_bias(generate, engine, plain_engine, False, range(1, 6))
    assert min(skipped) > 0


def test_group_draft_verification_with_a_planted_bias_is_rejected(
    group_engine,  # noqa: F811
    plain_engine,
    questions,
):
    def generate():
        return group_engine.generate(questions[:3], T1)

    assert_rejects_only_the_bias(generate, group_engine, plain_engine, True, range(1, 6))


@pytest.mark.parametrize("tv", [0.0, 0.05, 0.5, 1.0])
def test_the_planted_bias_moves_exactly_tv(tv):
    logits = torch.randn(64, 645) * 3
    biased, moved = away_from_the_top(logits, tv)
    p, q = logits.double().softmax(-1), biased.double().softmax(-1)
    exact = 0.5 * (p - q).abs().sum(-1)
    assert torch.allclose(exact, moved, atol=1e-5)
    assert torch.allclose(moved, p.max(-1).values.clamp(max=tv))
