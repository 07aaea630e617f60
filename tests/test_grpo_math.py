"""GRPO maths and rewards against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_specdec.grpo.core import (
    aggregate,
    first_informative,
    group_advantages,
    grpo_loss,
    k3_kl,
)
from grpo_specdec.tasks.rewards import extract_answer, reward


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv, informative = group_advantages(rewards, eps=0.0 + 1e-12)
    # group 0: mean 0.5, std 0.5 -> +-1
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # group 2: mean 0.75, std sqrt(mean((x-.75)^2)) = sqrt((3*.5625 + 5.0625)/4) = 1.299
    std = math.sqrt((3 * 0.5625 + 5.0625) / 4)
    assert adv[2].tolist() == pytest.approx([-0.75 / std] * 3 + [2.25 / std])
    assert informative.tolist() == [True, False, True]
    assert adv[1].abs().max() == 0


def test_dynamic_sampling_keeps_the_first_informative_groups_up_to_the_batch_size():
    informative = torch.tensor([False, True, True, False, True, True, False])
    assert first_informative(informative, 3).tolist() == [
        False, True, True, False, True, False, False
    ]  # fmt: skip
    assert first_informative(informative, 8).tolist() == informative.tolist()
    assert not first_informative(informative, 0).any()


def test_clipped_surrogate_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.8, 0.3]]))  # ratios 1.6 and 0.6
    mask = torch.tensor([[1, 1]])
    loss, stats = grpo_loss(new, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    # positive advantage: min(1.6, 1.2) = 1.2 ; min(0.6, 0.8) = 0.6 -> loss = -(1.2 + 0.6)/2
    assert loss.item() == pytest.approx(-0.9)
    assert stats["clip_frac"] == pytest.approx(0.5)
    loss, _ = grpo_loss(new, old, torch.tensor([-1.0]), mask, clip_eps=0.2)
    # negative advantage: min(-1.6, -1.2) = -1.6 ; min(-0.6, -0.8) = -0.8 -> loss = (1.6 + 0.8)/2
    assert loss.item() == pytest.approx(1.2)


def test_gradient_is_zero_where_clipped():
    old = torch.log(torch.tensor([[0.5]]))
    new = torch.log(torch.tensor([[0.8]])).requires_grad_()
    loss, _ = grpo_loss(new, old, torch.tensor([1.0]), torch.tensor([[1]]), clip_eps=0.2)
    loss.backward()
    assert new.grad.item() == 0.0


def test_k3_kl_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.25]))
    # exp(ref-logp) - (ref-logp) - 1: (0.5 - ln 0.5 - 1, 0)
    assert k3_kl(logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0])
    loss, stats = grpo_loss(
        logp[None],
        logp[None],
        torch.tensor([0.0]),
        torch.ones(1, 2),
        ref_logp=ref[None],
        kl_coef=0.5,
    )
    assert stats["kl"] == pytest.approx((0.5 + math.log(2) - 1) / 2)
    assert loss.item() == pytest.approx(0.5 * (0.5 + math.log(2) - 1) / 2)


def test_aggregation_modes_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "seq_mean_token_sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(per_token, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("12 + 7 = 19. 19 - 3 = 16. The answer is 16.", 16),
        ("so the total is \\boxed{1,234} apples", 1234),
        ("The answer is -5, not 7", -5),
        ("First 3 then 4, final: 2,500.", 2500),
        ("answer is $42", 42),
        ("\\boxed{3} ... wait, maybe 9", 3),
        ("The answer is: 0.5", 0.5),
        ("It is 7-3=4", 4),
        ("v2 of the model says 10", 10),
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_answer_on_messy_text(text, expected):
    got = extract_answer(text)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("kind", ["number", "math_verify"])
def test_reward_correctness_and_format_bonus(kind):
    assert reward("The answer is 16.", "16", kind) == pytest.approx(1.1)
    assert reward("16", "16", kind) == pytest.approx(1.0)
    assert reward("The answer is 15.", "16", kind) == pytest.approx(0.1)
    assert reward("nothing", "16", kind) == 0.0


def _rollout(texts: list[list[str]], lengths: list[list[int]] | None = None):
    from grpo_specdec.job.rollout_worker import Rollout

    lengths = lengths or [[1] * len(ts) for ts in texts]
    return Rollout(
        [[0]] * len(texts), [[[0] * n for n in ns] for ns in lengths], texts, {}, 1.0, {}
    )


def test_the_jobs_rewards_carry_the_format_bonus_it_is_configured_with():
    """An all-wrong group where some answers state the format: with the bonus its
    group-normalised advantages are as large as a right answer's would be (the bonus is then
    learnt instead of the task); without it (the default) the group teaches nothing."""
    from grpo_specdec.job.config import RewardSettings
    from grpo_specdec.job.run import _rewards
    from grpo_specdec.tasks.datasets import Example

    texts = [["The answer is 15.", "15", "The answer is 14.", "16"]]
    examples = [Example("q", "16")]
    bonus = RewardSettings(kind="number", format_bonus=0.1)
    with_bonus, correct = _rewards(examples, _rollout(texts), bonus, 64)
    assert with_bonus[0].tolist() == pytest.approx([0.1, 0.0, 0.1, 1.0])
    assert correct.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    wrong = [texts[0][:3]]
    advantages, informative = group_advantages(_rewards(examples, _rollout(wrong), bonus, 64)[0])
    assert informative.tolist() == [True] and advantages.abs().max() == pytest.approx(1.414, 1e-3)
    default = RewardSettings()
    assert default.format_bonus == 0.0 and default.kind == "math_verify"
    informative = group_advantages(_rewards(examples, _rollout(wrong), default, 64)[0])[1]
    assert informative.tolist() == [False]


def test_the_jobs_rewards_carry_the_overlong_penalty_and_grade_latex():
    """reward.overlong is DAPO's soft penalty on each sample's own length: 0 up to
    max_tokens - buffer, then down to -penalty at max_tokens; a LaTeX answer is graded by
    math-verify, not by the last digit it holds."""
    from grpo_specdec.job.config import RewardSettings
    from grpo_specdec.job.run import _rewards
    from grpo_specdec.tasks.datasets import Example

    texts = [[r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}", "2", "0.5"]]
    lengths = [[10, 48, 56, 64]]
    cfg = RewardSettings(overlong={"buffer": 16, "penalty": 0.5})
    rewards, correct = _rewards([Example("q", "0.5")], _rollout(texts, lengths), cfg, 64)
    assert correct.tolist() == [[1.0, 1.0, 0.0, 1.0]]
    assert rewards[0].tolist() == pytest.approx([1.0, 1.0, -0.25, 0.5])
    wrong_truth = [Example("q", "2")]
    assert _rewards(wrong_truth, _rollout(texts), cfg, 64)[1].tolist() == [[0, 0, 1, 0]]


def test_token_entropy_is_that_of_the_distribution_each_next_token_is_sampled_from():
    from grpo_specdec.job.learners import token_entropy

    vocab = 50
    logits = torch.zeros(2, 4, vocab)
    logits[1, :, 7] = 100.0  # certain of token 7
    h = token_entropy(logits)
    assert h.shape == (2, 4)  # aligned with the positions whose token it governs
    assert h[:, 0].tolist() == [0.0, 0.0]
    assert torch.allclose(h[0, 1:], torch.full((3,), math.log(vocab)))
    assert torch.all(h[1, 1:] < 1e-6)


def test_response_logprobs_are_those_of_the_sampling_temperature():
    """The surrogate's log-probabilities are of the distribution the engine sampled from:
    logits / T, as verl and TRL compute them."""
    from grpo_specdec.job.learners import response_logprobs

    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    cold = response_logprobs(logits, ids, temperature=0.5)
    expected = torch.log_softmax(2 * logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(cold[:, 1:], expected)
    assert (cold[:, 0] == 0).all()
    assert not torch.allclose(cold, response_logprobs(logits, ids))
