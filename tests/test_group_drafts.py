"""Drafts from a GRPO group's text: the index and the per-step choice on their own, then
inside real vLLM engines on tiny models (group drafts alone, and next to EAGLE)."""

from __future__ import annotations

import random
import tracemalloc
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import (
    assert_same_distribution,
    bare_scheduler,
    flattened_head,
    group_controller,
    lossless_sampling,
    tiny_engine_config,
)
from vllm_plugin.acceptance import FrozenAcceptance
from vllm_plugin.controller import HingeLatency, LatencyModel, LinearCost
from vllm_plugin.group.drafter import GROUP, MODEL, GroupDrafter
from vllm_plugin.group.suffix_index import GroupHistory, GroupIndex
from vllm_plugin.settings import CONFIG_KEY

# ---- the index ---------------------------------------------------------------------------


def test_draft_follows_the_most_common_continuation_of_the_longest_match():
    index = GroupIndex(max_match=3)
    index.add_sequence([1, 2, 3, 4, 5])
    index.add_sequence([9, 2, 3, 4, 6])
    index.add_sequence([7, 2, 3, 4, 5])
    draft = index.draft([0, 2, 3, 4], max_len=3)
    # "2 3 4" was followed by 5 twice and 6 once: 5 wins, then nothing follows.
    assert draft.tokens == [5]
    assert draft.match_len == 3
    assert draft.confidence == [pytest.approx(2 / 4)]
    # A longer match decides over a shorter, more frequent one.
    index.add_sequence([8, 8, 3, 4, 7, 7])
    index.add_sequence([8, 8, 3, 4, 7, 7])
    assert index.draft([8, 3, 4], max_len=2).tokens == [7, 7]
    assert index.draft([3, 4], max_len=1).tokens in ([5], [7])
    assert index.draft([42], max_len=3).tokens == []


def test_confidence_stops_the_draft_where_continuations_disagree():
    index = GroupIndex(max_match=2)
    for tail in ([5, 6], [5, 7], [5, 8], [5, 9]):
        index.add_sequence([1, 2, *tail])
    draft = index.draft([1, 2], max_len=4)
    assert draft.tokens[0] == 5 and draft.confidence[0] == pytest.approx(4 / 5)
    assert draft.confidence[1] == pytest.approx(1 / 5)
    assert index.draft([1, 2], max_len=4, min_confidence=0.5).tokens == [5]


def test_old_policy_versions_age_out():
    index = GroupIndex(max_match=2)
    index.add_sequence([1, 2, 3], version=0)
    index.add_sequence([1, 2, 4], version=1)
    index.drop_versions_before(1)
    assert index.draft([1, 2], 1).tokens == [4]
    assert index.positions == 3


def test_history_stays_within_its_budget_and_keeps_groups_in_use():
    history = GroupHistory(max_positions=100, max_match=2)
    for prompt in range(10):
        history.group((prompt,)).add_sequence(list(range(30)))
    history.evict(in_use={(0,)})
    assert history.positions <= 100
    assert (0,) in history.groups and history.evicted_groups >= 7


@pytest.mark.parametrize("vocab", [50, 20000])  # repetitive text, and all n-grams new
def test_the_index_reports_the_memory_it_takes(vocab):
    rng = random.Random(0)
    sequences = [[rng.randrange(vocab) for _ in range(500)] for _ in range(20)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = GroupIndex(max_match=4)
    for seq in sequences:
        index.add_sequence(seq)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 0.7 * used < index.approx_bytes < 1.3 * used, (used, index.approx_bytes)


# ---- the per-step choice -----------------------------------------------------------------


def _drafter(latency: LatencyModel, model_acceptance=None) -> GroupDrafter:
    return GroupDrafter(latency, k_max=4, max_match=2, model_acceptance=model_acceptance)


def _rows(drafter: GroupDrafter, n: int, output):
    prompt = (1, 2, 3)
    group = drafter.history.group(prompt)
    group.add_sequence(prompt)
    for _ in range(6):  # finished rollouts that all went 3 -> 10 11 12 13
        group.add_sequence([2, 3, 10, 11, 12, 13])
    return [(f"r{i}", prompt, list(output)) for i in range(n)]


FLAT = LatencyModel(HingeLatency(10.0, 0.0, 0.0), LinearCost(0.5, 0.0))
STEEP = LatencyModel(HingeLatency(1.0, 1.0, 0.0), LinearCost(0.5, 0.0))


def test_group_tokens_are_drafted_while_verifying_them_is_free():
    drafter = _drafter(FLAT)
    drafts, sources, _ = drafter.propose(_rows(drafter, 4, []), [[]] * 4)
    assert sources == [GROUP] * 4
    assert drafts == [[10, 11, 12, 13]] * 4


def test_where_every_verified_token_costs_a_full_token_none_pays():
    drafter = _drafter(STEEP)
    assert drafter.propose(_rows(drafter, 4, []), [[]] * 4).drafts == [[]] * 4


def test_at_a_long_context_the_same_group_tokens_stop_paying():
    # Each verified token attends to its context: 1 ms per context token beyond 8.
    attending = replace(FLAT, attention=1.0, context=8.0)
    drafter = _drafter(attending)
    assert drafter.propose(_rows(drafter, 4, [2, 3]), [[]] * 4).drafts == [[10, 11, 12, 13]] * 4
    drafter = _drafter(attending)
    long = [5] * 40 + [2, 3]  # the same match, 45 tokens of context each
    assert drafter.propose(_rows(drafter, 4, long), [[]] * 4).drafts == [[]] * 4


def test_a_request_takes_the_source_with_more_expected_tokens():
    sure = FrozenAcceptance([0.99] * 4)
    drafter = _drafter(FLAT, sure)
    drafts, sources, discarded = drafter.propose(_rows(drafter, 2, []), [[7, 7, 7, 7]] * 2)
    assert sources == [MODEL, MODEL] and drafts == [[7, 7, 7, 7]] * 2 and discarded == [0, 0]
    unsure = FrozenAcceptance([0.05] * 4)
    drafter = _drafter(FLAT, unsure)
    _, sources, discarded = drafter.propose(_rows(drafter, 2, []), [[7, 7, 7, 7]] * 2)
    assert sources == [GROUP, GROUP] and discarded == [4, 4]


def test_outcomes_are_counted_per_source_and_calibrate_the_group_s_confidence():
    drafter = _drafter(FLAT)
    rows = _rows(drafter, 1, [])
    before = drafter.calibration.chances(drafter.history.group((1, 2, 3)).draft([2, 3], 4))
    for _ in range(30):  # the request keeps generating 10 99 ..., so only one is accepted
        assert drafter.propose(rows, [[]]).drafts[0][:1] == [10]
        drafter.propose([("r0", (1, 2, 3), [10, 99])], [[]])
        drafter.forget(set())
    after = drafter.calibration.chances(drafter.history.group((1, 2, 3)).draft([2, 3], 4))
    stats = drafter.snapshot()["sources"][GROUP]
    assert stats["steps"] == 30 and stats["accepted_tokens"] == 30
    assert stats["draft_tokens"] > 30
    assert after[0] > before[0] and after[1] < before[1]


def test_a_policy_swap_ages_out_rollouts_of_older_policies():
    drafter = GroupDrafter(FLAT, k_max=4, max_match=2, history_versions=1)
    prompt = (1, 2, 3)
    drafter.add_history(prompt, [[10, 11]] * 3)
    drafter.new_policy()  # the previous policy's rollouts stay for one swap
    drafter.add_history(prompt, [[20, 21]] * 4)
    index = drafter.history.group(prompt)
    assert index.draft([2, 3], 2).tokens == [20, 21]
    assert {s[2] for s in index.sequences[1:]} == {10, 20}
    drafter.new_policy()
    index = drafter.history.group(prompt)
    assert index.sequences[0] == list(prompt)  # the prompt stays
    assert {s[2] for s in index.sequences[1:]} == {20}


def test_a_policy_swap_keeps_following_the_requests_still_running():
    """A request running across swaps stays one sequence in the index (a second copy would
    double its n-grams' counts) and its draft in verification is still scored, even after
    the policy that began it ages out."""
    drafter = GroupDrafter(FLAT, k_max=4, max_match=2, history_versions=1)
    prompt = (1, 2, 3)
    drafter.add_history(prompt, [[10, 11, 12, 13]] * 2)
    assert drafter.propose([("r0", prompt, [10, 11])], [[]]).drafts == [[12, 13]]
    index = drafter.history.group(prompt)
    sequences, positions = len(index.sequences), index.positions
    drafter.new_policy()
    # Both drafted tokens were accepted, and a third token sampled.
    drafter.propose([("r0", prompt, [10, 11, 12, 13, 14])], [[]])
    index = drafter.history.group(prompt)
    assert (len(index.sequences), index.positions) == (sequences, positions + 3)
    stats = drafter.snapshot()["sources"][GROUP]
    assert (stats["steps"], stats["draft_tokens"], stats["accepted_tokens"]) == (1, 2, 2)
    drafter.new_policy()  # the history of the first policy ages out; r0 stays
    drafter.propose([("r0", prompt, [10, 11, 12, 13, 14, 15])], [[]])
    index = drafter.history.group(prompt)
    assert index.sequences == [list(prompt), [2, 3, 10, 11, 12, 13, 14, 15]]


# ---- inside vLLM ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_engine(tiny_target, tiny_draft, group_profile):
    speculative = {
        "draft": tiny_draft,
        "k": 4,
        "concurrency_aware": True,
        "controller": group_controller(group_profile),
    }
    engine = Engine(tiny_engine_config(tiny_target, speculative=speculative))
    yield engine
    engine.shutdown()


def _tokens(result) -> list[list[int]]:
    return [s.token_ids for group in result.outputs for s in group]


def _delta(engine, prompts, sampling):
    """engine.generate, and the group drafter's counts of that call, per source."""
    before = engine.group_draft_stats()["sources"]
    result = engine.generate(prompts, sampling)
    after = engine.group_draft_stats()["sources"]
    return result, {s: {k: after[s][k] - before[s][k] for k in after[s]} for s in after}


def test_group_drafts_alone_keep_greedy_outputs_and_get_accepted(
    group_engine, plain_engine, questions
):
    sampling = SamplingSettings(max_tokens=40, ignore_eos=True)
    prompts = questions[:8]
    plain = plain_engine.generate(prompts, sampling)
    first, _ = _delta(group_engine, prompts, sampling)
    # The same prompts again: the first answers are now history to draft from.
    again, used = _delta(group_engine, prompts, sampling)
    assert _tokens(first) == _tokens(plain) == _tokens(again)
    assert used[GROUP]["accepted_tokens"] > 0.5 * used[GROUP]["draft_tokens"] > 0
    assert again.spec["accepted_tokens"] >= used[GROUP]["accepted_tokens"] > 0


def test_a_policy_update_through_vllms_api_ages_the_group_history(group_engine, tiny_target):
    """The group drafter follows the policy version the `grpo_shm` backend stamps on the
    model, whoever drives the update (here vLLM's API through Engine.swap_weights)."""
    from safetensors.torch import load_file

    version = group_engine.weight_versions()["policy"] + 1
    weights = load_file(f"{tiny_target}/model.safetensors")
    group_engine.swap_weights("policy", weights, version=version)
    group_engine.generate(["1+1="], SamplingSettings(max_tokens=2))  # one step reads it
    assert group_engine.group_draft_stats()["policy_version"] == version


def test_follow_policy_ages_the_history_once_per_new_version():
    drafter = GroupDrafter(FLAT, k_max=4, max_match=2, history_versions=1)
    drafter.follow_policy(0)
    assert drafter.version == 0
    drafter.follow_policy(3)
    drafter.follow_policy(3)
    assert drafter.version == 1 and drafter.policy_version == 3


def test_hybrid_keeps_greedy_outputs_and_uses_both_sources(hybrid_engine, plain_engine, questions):
    sampling = SamplingSettings(max_tokens=40, ignore_eos=True)
    prompts = questions[8:16]
    plain = plain_engine.generate(prompts, sampling)
    hybrid, used = _delta(hybrid_engine, prompts, sampling)
    hybrid_again, used_again = _delta(hybrid_engine, prompts, sampling)
    assert _tokens(hybrid) == _tokens(plain) == _tokens(hybrid_again)
    assert used[MODEL]["draft_tokens"] > 0
    assert used_again[GROUP]["accepted_tokens"] > 0
    # The scheduler learns the model draft's acceptance from its drafts only.
    verified = hybrid_engine.scheduler().verified_by_source
    assert verified[GROUP] > 0 and verified[MODEL] > 0


def test_group_drafts_keep_the_target_s_distribution_at_temperature_one(
    group_engine, hybrid_engine, plain_engine, questions
):
    sampling = lossless_sampling()
    prompts = questions[:3]
    for engine in (group_engine, hybrid_engine):
        sampled, used = _delta(engine, prompts, sampling)
        assert used[GROUP]["draft_tokens"] > 0
        assert_same_distribution(sampled, plain_engine)


@pytest.fixture(scope="module")
def sampled_hybrid_engine(tiny_target, tiny_reduced_draft, group_profile, tmp_path_factory):
    """Group drafts next to sampled model drafts of a head over a reduced vocabulary (the
    group's rows flagged one-hot to the rejection sampler), flattened so that the group's
    drafts win some requests. The acceptance evidence is short (a few dozen drafts), and
    the controller probes a k it has not run for a while, so that the model's drafts,
    which the group's beat, are tried again within one short run: the test is of the two
    sources verified side by side."""
    controller = {**group_controller(group_profile), "acceptance_memory": 16}
    speculative = {
        "draft": flattened_head(tiny_reduced_draft, tmp_path_factory.mktemp("flat"), 0.3),
        "k": 4,
        "draft_sampling": "probabilistic",
        "concurrency_aware": True,
        "controller": controller,
    }
    engine = Engine(tiny_engine_config(tiny_target, speculative=speculative))
    yield engine
    engine.shutdown()


def test_group_drafts_beside_sampled_drafts_keep_the_target_s_distribution(
    sampled_hybrid_engine, plain_engine, questions
):
    sampling = lossless_sampling()
    sampled_hybrid_engine.generate(questions[:3], sampling)  # the group's history
    sampled, used = _delta(sampled_hybrid_engine, questions[:3], sampling)
    # Both sources verified in one run, and the group's one-hot drafts accepted.
    assert used[GROUP]["accepted_tokens"] > 0 and used[MODEL]["accepted_tokens"] > 0, used
    assert_same_distribution(sampled, plain_engine)


@pytest.mark.parametrize("vocab", [16, 6])
def test_the_cached_q_keeps_the_model_s_rows_and_makes_the_group_s_one_hot(vocab):
    """A full-vocabulary q (16 = the target's) holds each group draft one-hot; a reduced
    one (6) cannot, so those rows are zero and their requests named for the sampler."""
    from vllm_plugin.group.drafter import Proposal
    from vllm_plugin.patches.features.group_drafts_v0_32 import (
        ONE_HOT_REQS_ATTR,
        _one_hot_group_rows,
    )

    q = torch.rand(3, 2, vocab)  # cached for requests a, b, c in that order, k = 2
    runner = SimpleNamespace(
        _draft_probs=q,
        _draft_prob_req_ids=["a", "b", "c"],
        model_config=SimpleNamespace(get_vocab_size=lambda: 16),
    )
    # This step's batch order differs; b's model draft is replaced by a longer group draft.
    proposal = Proposal([[1, 2], [4, 5, 3], []], [MODEL, GROUP, MODEL], [0, 2, 0])
    _one_hot_group_rows(runner, ["c", "b", "a"], proposal)
    rebuilt = runner._draft_probs
    assert runner._draft_prob_req_ids == ["c", "b", "a"] and rebuilt.shape == (3, 3, vocab)
    assert torch.equal(rebuilt[0, :2], q[2]) and torch.equal(rebuilt[2, :2], q[0])
    if vocab == 16:
        assert rebuilt[1].argmax(-1).tolist() == [4, 5, 3] and rebuilt[1].sum().item() == 3
        assert getattr(runner, ONE_HOT_REQS_ATTR) == frozenset()
    else:
        assert not rebuilt[1].any() and getattr(runner, ONE_HOT_REQS_ATTR) == {"b"}
    # A step without group drafts leaves q as the model made it and names no request.
    runner._draft_probs = q
    _one_hot_group_rows(runner, ["a", "b", "c"], Proposal([[1], [2], [3]], [MODEL] * 3, [0] * 3))
    assert runner._draft_probs is q and getattr(runner, ONE_HOT_REQS_ATTR) == frozenset()


def test_the_scheduler_prices_k_on_the_model_drafts_as_used():
    """Model drafts a group draft replaced count as made and not accepted; group drafts'
    own outcomes never reach the model's estimate."""
    from vllm.v1.outputs import DraftTokenIds

    scheduler = bare_scheduler()
    drafts = DraftTokenIds(["a", "b"], [[1, 2], [3, 4, 5, 6]])
    drafts.grpo_sources, drafts.grpo_model_discarded = [GROUP, MODEL], [4, 0]
    scheduler.update_draft_token_ids(drafts)
    assert scheduler.acceptance.tried.tolist() == [1, 0, 0, 0]
    assert scheduler.acceptance.accepted.tolist() == [0, 0, 0, 0]
    scheduler.make_spec_decoding_stats(None, 2, 2, None, "a")  # the group's: not counted
    scheduler.make_spec_decoding_stats(None, 4, 1, None, "b")
    # (each verified draft fades the older ones by 1 - 1/memory)
    fade = 1 - 1 / scheduler.acceptance.memory
    assert scheduler.acceptance.tried.tolist() == pytest.approx([fade + 1, 1, 0, 0])
    assert scheduler.acceptance.accepted.tolist() == [1, 0, 0, 0]
    assert scheduler.verified_by_source == {GROUP: 1, MODEL: 1}


def test_group_drafts_refuse_engines_they_cannot_serve(group_profile):
    from vllm_plugin.patches.features.group_drafts_v0_32 import _build

    settings = {CONFIG_KEY: group_controller(group_profile)}
    spec = SimpleNamespace(draft_sample_method="greedy")
    runner = SimpleNamespace(
        speculative_config=spec,
        use_async_scheduling=True,
        vllm_config=SimpleNamespace(additional_config=settings),
    )
    with pytest.raises(ValueError, match="async_scheduling=False"):
        _build(runner)


def test_group_drafts_need_a_source(tiny_target):
    with pytest.raises(ValueError, match="speculative.draft is null"):
        tiny_engine_config(tiny_target, speculative={"draft": None, "k": 3})


def test_history_from_elsewhere_drafts_and_a_reset_forgets_it(
    group_engine, plain_engine, questions
):
    sampling = SamplingSettings(max_tokens=40, ignore_eos=True)
    prompts = questions[16:18]
    plain = plain_engine.generate(prompts, sampling)
    group_engine.group_draft_reset()
    assert group_engine.group_draft_stats()["history_positions"] == 0
    group_engine.group_draft_add_history(plain)
    assert group_engine.group_draft_stats()["history_positions"] > 80
    result, used = _delta(group_engine, prompts, sampling)
    assert _tokens(result) == _tokens(plain)
    # Greedy answers equal to the history: nearly every drafted token is accepted.
    assert used[GROUP]["accepted_tokens"] > 0.8 * used[GROUP]["draft_tokens"] > 0
