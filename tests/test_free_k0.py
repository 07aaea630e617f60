"""Steps that draft nothing skip the draft pass and the rejection sampler
(`vllm_plugin/patches/features/free_k0_v0_32.py`), inside a real vLLM engine on tiny models, and
the catch-up logic on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grpo_specdec.engine import SamplingSettings
from tests.conftest import assert_same_distribution, lossless_sampling
from tests.step_cycle import generate_under_the_step_cycle, step_cycle_engine
from vllm_plugin.patches.features import free_k0_v0_32 as free_k0


@pytest.fixture
def engine(free_k0_engine):
    return free_k0_engine


@pytest.fixture(scope="module")
def sampled_engine(tiny_target, tiny_draft, tmp_path_factory):
    folder = tmp_path_factory.mktemp("k0_sampled")
    engine = step_cycle_engine(tiny_target, tiny_draft, folder, "probabilistic")
    yield engine
    free_k0.ENABLED = True
    engine.shutdown()


def _tokens(result) -> list[list[int]]:
    return [s.token_ids for group in result.outputs for s in group]


def test_skipped_draft_passes_are_caught_up_to_the_same_drafts(engine, plain_engine, questions):
    sampling = SamplingSettings(max_tokens=48, ignore_eos=True)
    always, always_kept = generate_under_the_step_cycle(engine, False, questions[:12], sampling)
    lazy, lazy_kept = generate_under_the_step_cycle(engine, True, questions[:12], sampling)
    assert always_kept == (0, 0)
    skipped, caught_up = lazy_kept
    assert skipped > 0 and caught_up > 0
    # Same drafts, so the same acceptance, position by position; same outputs.
    for key in ("drafts", "draft_tokens", "accepted_tokens", "per_position_acceptance"):
        assert lazy.spec[key] == always.spec[key], key
    assert _tokens(lazy) == _tokens(always)
    assert _tokens(lazy) == _tokens(plain_engine.generate(questions[:12], sampling))


def test_without_the_catch_up_drafts_get_worse(engine, questions, monkeypatch):
    """The equality above is not for free: a draft whose KV cache has holes where steps
    were skipped accepts fewer tokens (the outputs stay the same: drafts are verified)."""
    sampling = SamplingSettings(max_tokens=48, ignore_eos=True)
    always, _ = generate_under_the_step_cycle(engine, False, questions[:12], sampling)
    monkeypatch.setattr(free_k0.KeptDraftInputs, "prepend", lambda *args, **kwargs: None)
    holes, (skipped, caught_up) = generate_under_the_step_cycle(
        engine, True, questions[:12], sampling
    )
    assert skipped > 0 and caught_up == 0
    rate = lambda spec: spec["accepted_tokens"] / spec["draft_tokens"]  # noqa: E731
    assert rate(holes.spec) < rate(always.spec)
    assert _tokens(holes) == _tokens(always)


def test_temperature_one_distribution_is_the_target_s(engine, plain_engine, questions):
    """Tokens sampled at T=1 through skipped and caught-up steps follow the target's
    exact next-token distributions (assert_same_distribution; its power is shown in
    tests/test_lossless_power.py)."""
    lazy, (skipped, caught_up) = generate_under_the_step_cycle(
        engine, True, questions[:3], lossless_sampling()
    )
    assert skipped > 0 and caught_up > 0
    assert_same_distribution(lazy, plain_engine)


def _record_draft_probabilities(worker) -> None:
    """From now on, each draft pass of this worker records its k and whether it left
    draft probabilities (q) for the runner to take."""
    drafter = worker.model_runner.drafter
    propose, drafter.recorded = type(drafter).propose.__get__(drafter), []

    def recording(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        left = drafter.take_last_draft_probs() is not None
        drafter.recorded.append((kwargs["num_speculative_tokens"], left))
        return drafts

    drafter.propose = recording


def _stop_recording(worker) -> list[tuple[int, bool]]:
    drafter = worker.model_runner.drafter
    del drafter.propose
    return drafter.recorded


def test_a_skipped_pass_leaves_no_draft_probabilities(sampled_engine, questions):
    """vLLM's draft pass forgets the last step's q first thing, so a k = 0 step hands the
    runner none; the skipped pass must too, or the runner files the previous step's q
    under this step's request ids, for drafts it never made."""
    sampling = SamplingSettings(temperature=1.0, max_tokens=24, ignore_eos=True)
    sampled_engine.llm.collective_rpc(_record_draft_probabilities)
    try:
        _, (skipped, _) = generate_under_the_step_cycle(
            sampled_engine, True, questions[:4], sampling
        )
    finally:
        recorded = sampled_engine.llm.collective_rpc(_stop_recording)[0]
    assert any(left for k, left in recorded if k > 0)  # sampled drafts leave their q
    left_at_k0 = [left for k, left in recorded if k == 0]
    assert len(left_at_k0) >= skipped > 0 and not any(left_at_k0)


# ---- the catch-up itself, without an engine -------------------------------------------------


def _cad(query_lens, first_positions, slots):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    seq_lens = torch.tensor([p + n for p, n in zip(first_positions, query_lens)])
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros(len(query_lens), 4, dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
    )


def _skipped(req_ids, positions):
    p = torch.tensor(positions)
    return free_k0.SkippedStep(list(req_ids), p + 1000, p, p[:, None].float().repeat(1, 2), p + 500)


def test_catch_up_puts_each_request_s_skipped_positions_before_its_tokens():
    kept = free_k0.KeptDraftInputs()
    kept.keep(_skipped(["a", "b", "gone"], [10, 20, 7]))
    kept.keep(_skipped(["a", "b"], [11, 21]))
    # Now "a" decodes position 12; "b" was preempted and recomputes from position 0;
    # "c" is new. "gone" finished while k = 0: it never pays.
    cad = _cad([1, 3, 2], [12, 0, 0], [512, 500, 501, 502, 600, 601])
    ids = torch.tensor([1012, 1000, 1001, 1002, 5, 6])
    positions = torch.tensor([12, 0, 1, 2, 0, 1])
    hidden = positions[:, None].float().repeat(1, 2)
    ids_, pos_, hid_, new, added = kept.prepend(["a", "b", "c"], ids, positions, hidden, cad, 64)
    assert added == [2, 0, 0]
    assert pos_.tolist() == [10, 11, 12, 0, 1, 2, 0, 1]
    assert ids_.tolist() == [1010, 1011, 1012, 1000, 1001, 1002, 5, 6]
    assert hid_[:, 0].tolist() == [10, 11, 12, 0, 1, 2, 0, 1]
    assert new.slot_mapping.tolist() == [510, 511, 512, 500, 501, 502, 600, 601]
    assert new.query_start_loc_cpu.tolist() == [0, 3, 6, 8]
    assert (new.num_actual_tokens, new.max_query_len) == (8, 3)
    assert new.seq_lens.tolist() == cad.seq_lens.tolist()  # the same last positions
    assert kept.caught_up_positions == 2


def test_catch_up_keeps_the_newest_positions_within_the_token_budget():
    kept = free_k0.KeptDraftInputs()
    for step in range(5):
        kept.keep(_skipped(["a", "b"], [step, 100 + step]))
    cad = _cad([1, 1], [5, 105], [5, 105])
    out = kept.prepend(
        ["a", "b"], torch.tensor([0, 0]), torch.tensor([5, 105]), torch.zeros(2, 2), cad, capacity=6
    )
    assert out[1].tolist() == [3, 4, 5, 103, 104, 105]


def test_kept_inputs_are_bounded():
    step_bytes = _skipped(["a", "b"], [0, 100]).nbytes
    kept = free_k0.KeptDraftInputs(max_bytes=2 * step_bytes + 1)
    for step in range(4):
        kept.keep(_skipped(["a", "b"], [step, 100 + step]))
    assert kept.nbytes == 2 * step_bytes and len(kept.steps) == 2
    cad = _cad([1, 1], [4, 104], [4, 104])
    out = kept.prepend(
        ["a", "b"],
        torch.tensor([0, 0]),
        torch.tensor([4, 104]),
        torch.zeros(2, 2),
        cad,
        capacity=64,
    )
    assert out[1].tolist() == [2, 3, 4, 102, 103, 104]


def test_under_async_scheduling_the_lazy_pass_stands_aside(engine):
    """vLLM turns async scheduling on for EAGLE on CUDA (off on CPU): there the patch keeps
    nothing and drafts as vLLM ships, with a warning; synchronous, the same drafter is
    eligible."""

    def eligible_when(async_scheduling: bool):
        def check(worker):
            proposer = worker.model_runner.drafter
            scheduler = proposer.vllm_config.scheduler_config
            before, scheduler.async_scheduling = scheduler.async_scheduling, async_scheduling
            try:
                return free_k0._eligible(proposer)
            finally:
                scheduler.async_scheduling = before

        return engine.llm.collective_rpc(check)

    assert eligible_when(False) == [True]
    assert eligible_when(True) == [False]


def test_under_async_scheduling_a_step_without_drafts_samples_as_vllm_ships():
    from types import SimpleNamespace

    seen = []
    sample = free_k0._wrap_sample(lambda runner, logits, meta: seen.append(meta))
    nothing_drafted = SimpleNamespace(max_spec_len=0)
    sample(SimpleNamespace(use_async_scheduling=False), None, nothing_drafted)
    sample(SimpleNamespace(use_async_scheduling=True), None, nothing_drafted)
    assert seen == [None, nothing_drafted]
