"""The acceptance watch after a draft swap (`grpo_specdec/draft_watch.py`): a head that
collapses is replaced by the one it replaced, in a running engine; a sound one is kept."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from grpo_specdec.draft_watch import MIN_DRAFT_TOKENS, DraftWatch, Head
from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import scrambled, tiny_engine_config


def _head(version: int, drafted: int = 0, accepted: int = 0) -> Head:
    return Head({"w": version}, version, None, drafted, accepted)


def test_a_collapsed_head_is_judged_against_the_last_measured_one():
    watch = DraftWatch(_head(0, 1000, 500))  # the starting head: 0.5 accepted
    watch.swapped(_head(1))
    assert watch.observe(MIN_DRAFT_TOKENS - 1, 0) is None  # too few drafts to judge
    rollback = watch.observe(200, 2)
    assert (rollback.version, rollback.to) == (1, 0) and rollback.previous_rate == 0.5
    assert watch.rolled_back().version == 0 and watch.serving.version == 0
    assert watch.fallback is None


def test_a_sound_head_that_accepts_somewhat_less_is_kept():
    watch = DraftWatch(_head(0, 1000, 500))
    watch.swapped(_head(1))
    assert watch.observe(400, 160) is None  # 0.40 against 0.50: an ordinary update
    assert watch.fallback is None  # proven: judged no further
    assert watch.observe(400, 0) is None


def test_noise_near_the_line_does_not_roll_back():
    watch = DraftWatch(_head(0, 1000, 500))
    watch.swapped(_head(1))
    # 0.22 of 100 drafts: below half of 0.5, but its upper bound (3 standard errors) is not
    assert watch.observe(100, 22) is None


def test_an_unmeasured_head_leaves_the_older_fallback_in_place():
    watch = DraftWatch(_head(0, 1000, 500))
    watch.swapped(_head(1))
    watch.observe(10, 5)  # swapped out again before it drafted enough
    watch.swapped(_head(2))
    assert watch.fallback.version == 0
    assert watch.observe(300, 3).to == 0


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    engine = Engine(tiny_engine_config(tiny_target, tiny_draft))
    yield engine
    engine.shutdown()


def test_a_scrambled_head_pushed_into_a_running_engine_is_rolled_back(
    engine, tiny_draft, questions, caplog
):
    greedy = SamplingSettings(max_tokens=40)
    prompts = [engine.encode(q) for q in questions]
    start = engine.generate(prompts, greedy)
    assert start.spec["draft_tokens"] >= MIN_DRAFT_TOKENS and start.draft_rollback is None
    weights = load_file(str(Path(tiny_draft) / "model.safetensors"))
    meta = None  # the engine checks names, shapes and dtypes in any case
    engine.swap_weights("draft", scrambled(weights), 1, meta)
    collapsed = engine.generate(prompts, greedy)
    rollback = collapsed.draft_rollback
    assert rollback is not None and (rollback.version, rollback.to) == (1, 0), rollback
    assert rollback.rate < start.spec["acceptance_rate"] / 2
    assert engine.weight_versions()["draft"] == 0
    assert engine.draft_rollbacks == [rollback]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert rollback.describe() in said and "back on version 0" in rollback.describe()
    again = engine.generate(prompts, greedy)
    assert again.spec["acceptance_rate"] == start.spec["acceptance_rate"]  # the head it had
    assert [g[0].token_ids for g in again.outputs] == [g[0].token_ids for g in start.outputs]
    # A sound head swapped in stays.
    engine.swap_weights("draft", weights, 2, meta)
    kept = engine.generate(prompts, greedy)
    assert kept.draft_rollback is None and engine.weight_versions()["draft"] == 2


def test_text_past_eos_is_no_evidence_against_a_head(engine, tiny_draft, questions):
    """Rounds that ignore EOS (a benchmark's equal-token rounds) do not judge the head; the
    next rollout does."""
    prompts = [engine.encode(q) for q in questions]
    weights = load_file(str(Path(tiny_draft) / "model.safetensors"))
    engine.generate(prompts, SamplingSettings(max_tokens=40))  # the serving head measured
    before = engine.weight_versions()["draft"]
    engine.swap_weights("draft", scrambled(weights), before + 1, None)
    past_eos = engine.generate(prompts, SamplingSettings(max_tokens=40, ignore_eos=True))
    assert past_eos.spec["draft_tokens"] >= MIN_DRAFT_TOKENS
    assert past_eos.draft_rollback is None
    assert engine.weight_versions()["draft"] == before + 1
    rollout = engine.generate(prompts, SamplingSettings(max_tokens=40))
    assert rollout.draft_rollback is not None
    assert engine.weight_versions()["draft"] == before


def test_the_learner_goes_back_with_the_engine_and_numbers_on(tiny_target, tiny_draft):
    """After the watch sends an engine back from a collapsed head, the learner learns on
    from the head the engine went back to, not from the collapse; versions only grow, and
    a head older than the learner keeps is said to be gone."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_specdec.draft.learner import DraftLearner
    from grpo_specdec.draft.online import OnlineDraft

    policy = AutoModelForCausalLM.from_pretrained(tiny_target)
    draft = OnlineDraft(tiny_target, tiny_draft, train={"lr": 3e-3})
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 200, (8, 40), generator=g).tolist()
    heads = {}
    for _ in range(DraftLearner.KEPT):
        draft.learn_from(policy, rows, [8] * len(rows))
        heads[draft.version] = draft.learner.head.export_state_dict()
    first, last = min(heads), max(heads)
    assert draft.learner.return_to(first)
    for name, tensor in draft.learner.head.export_state_dict().items():
        assert torch.equal(tensor, heads[first][name]), name
    draft.learn_from(policy, rows, [8] * len(rows))
    assert draft.version == last + 1
    assert not draft.learner.return_to(last)  # the collapsed lineage is dropped
    assert not draft.learner.return_to(0)  # older than the heads kept


def test_a_slow_decline_is_said_once_per_fall():
    """No step falls by half (no rollback), but over rollouts acceptance drifts from 0.6 to
    0.4: said once when the last three fall below 75% of the best three, not while it stays
    low, again after a recovery and a second fall; ordinary noise never."""
    from grpo_specdec.draft_watch import SlowDecline

    watch = SlowDecline()
    noisy = [0.6, 0.55, 0.62, 0.52, 0.6, 0.5, 0.58]
    assert [watch.observe(r) for r in noisy] == [None] * len(noisy)
    said = [watch.observe(r) for r in (0.5, 0.45, 0.42, 0.4, 0.4, 0.38)]
    assert [s is not None for s in said] == [False, False, False, True, False, False]
    assert "fallen to 0.423 over the last 3 rollouts" in said[3] and "best (0.590)" in said[3]
    back = [watch.observe(r) for r in (0.6, 0.6, 0.6, 0.4, 0.4, 0.4)]
    assert [s is not None for s in back] == [False] * 5 + [True]
