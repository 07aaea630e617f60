"""Sampled drafting (`draft_sampling: probabilistic`): the draft samples from its q and
verification accounts for q, so outputs keep the target's distribution, for heads over
the full vocabulary and over a reduced one (q kept in the head's own vocabulary on CPU,
`patches/features/cpu_sampled_drafts_v0_32.py`)."""

from __future__ import annotations

import pytest
import torch

from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import (
    LOSSLESS_ALPHA,
    LOSSLESS_POSITIONS,
    assert_same_distribution,
    flattened_head,
    lossless_sampling,
    target_fit,
    tiny_engine_config,
)
from tests.test_lossless_power import assert_rejects_only_the_bias
from vllm_plugin.patches.features.cpu_sampled_drafts_v0_32 import sample_draft
from vllm_plugin.patches.fixes import cpu_rejection_sample_v0_32 as rejection

# From the first token (a prefill's) on: the q rows of later positions align with it.
POSITIONS = range(0, LOSSLESS_POSITIONS.stop)


@pytest.fixture(scope="module")
def sampled_engine(tiny_target, tiny_reduced_draft, tmp_path_factory):
    """The reduced-vocabulary head with its logits scaled by 0.3: q flatter than p (but
    overlapping it), so verification that misread q would bend the output more than
    with q close to p."""
    flat = flattened_head(tiny_reduced_draft, tmp_path_factory.mktemp("flat-head"), 0.3)
    engine = Engine(
        tiny_engine_config(
            tiny_target,
            speculative={"draft": str(flat), "k": 3, "draft_sampling": "probabilistic"},
        )
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sampled_full_vocab_engine(tiny_target, tiny_draft):
    engine = Engine(
        tiny_engine_config(
            tiny_target,
            speculative={"draft": tiny_draft, "k": 3, "draft_sampling": "probabilistic"},
        )
    )
    yield engine
    engine.shutdown()


def test_draft_samples_follow_q_and_map_to_target_ids():
    torch.manual_seed(0)
    vocab_ids = torch.tensor([2, 5, 11, 40])
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]]).expand(40_000, 4)
    ids, q = sample_draft(logits, torch.full((40_000,), 0.5), vocab_ids)
    expected = (logits[0] / 0.5).softmax(-1)
    assert torch.allclose(q[0], expected)
    freq = torch.stack([(ids == t).double().mean() for t in vocab_ids])
    assert torch.allclose(freq, expected.double(), atol=0.01), freq


def test_greedy_outputs_unchanged(
    sampled_engine, sampled_full_vocab_engine, plain_engine, questions
):
    greedy = SamplingSettings(temperature=0.0, max_tokens=48)
    plain = plain_engine.generate(questions[:8], greedy)
    for engine in (sampled_engine, sampled_full_vocab_engine):
        spec = engine.generate(questions[:8], greedy)
        assert [g[0].token_ids for g in spec.outputs] == [g[0].token_ids for g in plain.outputs]
        assert spec.spec["mean_acceptance_length"] > 1.5


def test_reduced_vocabulary_q_reaches_verification_in_its_own_vocabulary(
    sampled_engine, tiny_reduced_draft, questions, monkeypatch
):
    from vllm.v1.sample import rejection_sampler

    seen = []

    def spy(*args, **kwargs):
        draft_probs = args[4]
        seen.append((draft_probs.shape[-1], rejection.layout_of(draft_probs).vocab_ids))
        return rejection.rejection_sample(*args, **kwargs)

    monkeypatch.setattr(rejection_sampler, "rejection_sample", spy)
    sampled_engine.generate(questions[:4], SamplingSettings(temperature=1.0, max_tokens=16))
    from safetensors.torch import load_file

    d2t = load_file(f"{tiny_reduced_draft}/model.safetensors")["d2t"]
    head_ids = d2t + torch.arange(len(d2t))
    assert seen and all(width == 256 and torch.equal(ids, head_ids) for width, ids in seen)


@pytest.mark.parametrize("vocabulary", ["reduced", "full"])
def test_sampled_drafting_keeps_the_target_distribution(
    vocabulary, sampled_engine, sampled_full_vocab_engine, plain_engine, questions
):
    """Samples at T = 1 follow the target's exact next-token distributions
    (the check rejects a TV 0.05 bias in this path's verification: the tests below; the
    rule itself is checked exactly against vLLM's in test_rejection_sampler.py). Verifying
    a sampled draft as if it were one-hot would lose acceptance, not correctness: that is
    the next test."""
    engine = sampled_engine if vocabulary == "reduced" else sampled_full_vocab_engine
    prompts = questions[:3]
    sampled = engine.generate(prompts, lossless_sampling())
    assert sampled.spec["accepted_tokens"] > 500
    assert_same_distribution(sampled, plain_engine, POSITIONS)


def test_sampled_draft_verification_with_a_planted_bias_is_rejected(
    sampled_engine,
    plain_engine,
    questions,
):
    def generate():
        return sampled_engine.generate(questions[:3], lossless_sampling())

    assert_rejects_only_the_bias(generate, sampled_engine, plain_engine, True, POSITIONS)


def test_sampled_drafts_verified_against_misaligned_q_rows_are_rejected(
    sampled_full_vocab_engine,
    plain_engine,
    questions,
):
    """Each draft token verified with the q of the draft position before it (the last
    row wraps round to the first). A draft close to the target is accepted about as
    often whichever q it is divided by, so the bias is small: the bin counts move by
    0.015 in total variation (a lower bound of the bias per token, up to noise), and at
    the callers' 3600 tokens the statistic came out 28 (rejected, but with a
    noncentrality of about 25: power about 0.7). Five times the samples (n = 1000): 134
    and 146 in two runs, a noncentrality of about 130: power > 0.9999."""

    def misalign(worker):
        runner = worker.model_runner
        draft_probs = runner._get_spec_decode_draft_probs

        def shifted(spec_decode_metadata):
            q = draft_probs(spec_decode_metadata)  # [draft tokens, full vocabulary]
            return None if q is None else q.roll(1, 0)

        runner._get_spec_decode_draft_probs = shifted

    sampled_full_vocab_engine.llm.collective_rpc(misalign)
    try:
        result = sampled_full_vocab_engine.generate(
            questions[:3], lossless_sampling(1000).model_copy(update={"max_tokens": 6})
        )
    finally:
        sampled_full_vocab_engine.llm.collective_rpc(
            lambda worker: delattr(worker.model_runner, "_get_spec_decode_draft_probs")
        )
    fit = target_fit(result, plain_engine, range(6))
    assert fit.p_value < LOSSLESS_ALPHA, fit


def test_sampled_drafting_beats_greedy_drafts(sampled_full_vocab_engine, eagle_engine, questions):
    """The same head, at T = 1: sampling its drafts is accepted more than its argmax."""
    sampling = SamplingSettings(n=50, temperature=1.0, max_tokens=24)
    sampled = sampled_full_vocab_engine.generate(questions[:4], sampling).spec
    greedy = eagle_engine.generate(questions[:4], sampling).spec
    assert sampled["mean_acceptance_length"] > greedy["mean_acceptance_length"] + 0.1, (
        sampled["mean_acceptance_length"],
        greedy["mean_acceptance_length"],
    )


def test_job_config_trains_the_draft_for_the_rollout_temperature():
    from grpo_specdec.job.config import TrainConfig

    cfg = TrainConfig(model={"policy": "tiny"}, rollout={"temperature": 0.8})
    assert cfg.draft.train.temperature == 0.8
    cfg = TrainConfig(
        model={"policy": "tiny"},
        rollout={"temperature": 0.8},
        draft={"train": {"temperature": 1.3}},
    )
    assert cfg.draft.train.temperature == 1.3
