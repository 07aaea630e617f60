"""Our CPU rejection sampler (`vllm_plugin.patches.fixes.cpu_rejection_sample_v0_32`) against
vLLM's rule and vLLM's own implementation."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from vllm_plugin.patches.fixes import cpu_rejection_sample_v0_32 as fast

BONUS = 5


def _vllm_rejection_sample():
    """vLLM's own implementation (what the patch replaced, if it did)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()
    return fast._original or rejection_sampler.rejection_sample


def _sample(sample, drafts, logits, draft_probs=None, generators=None):
    """Run `sample` on a batch where request i drafted `drafts[i]` (-1: padded); `logits`
    and `draft_probs` hold one row per draft token, in request order."""
    counts = [len(d) for d in drafts]
    return sample(
        torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        counts,
        max(counts),
        torch.tensor(counts).cumsum(0).to(torch.int32),
        draft_probs,
        logits,
        torch.full((len(drafts), 1), BONUS, dtype=torch.long),
        SimpleNamespace(
            all_greedy=False,
            all_random=True,
            generators=generators or {},
            temperature=torch.ones(len(drafts)),
        ),
    )


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_seeded_request_does_not_depend_on_its_batch():
    """Same seed, same tokens: whatever the global RNG and the other requests do."""
    torch.manual_seed(0)
    mine = torch.randn(2, 50)  # drafts 7, 8 are rarely accepted: mostly a recovered token
    others = torch.randn(3, 50)
    alone, in_batch = [], []
    for seed in range(40):
        torch.manual_seed(1000 + seed)
        out = _sample(fast.rejection_sample, [[7, 8]], mine.clone(), generators={0: _seeded(seed)})
        alone.append(out[0].tolist())
        torch.manual_seed(2000 + seed)
        out = _sample(
            fast.rejection_sample,
            [[1, 2], [], [3], [7, 8]],
            torch.cat([others, mine]),
            generators={2: _seeded(seed + 1), 3: _seeded(seed)},
        )
        in_batch.append(out[3].tolist())
    assert alone == in_batch
    assert len({tuple(row) for row in alone}) > 10  # the seed does drive the draw


def test_padded_draft_recovers_from_the_whole_target():
    """A padded draft (-1) has no token to take out of p: every token, token 0 included,
    comes with its target probability."""
    p = torch.tensor([0.3, 0.1, 0.4, 0.2])
    n = 20_000
    torch.manual_seed(0)
    out = _sample(fast.rejection_sample, [[-1]] * n, p.log().expand(n, 4).clone())
    assert (out[:, 1] == -1).all()  # rejected: no bonus token
    freq = torch.bincount(out[:, 0].long(), minlength=4).double() / n
    assert torch.allclose(freq, p.double(), atol=0.015), freq


def test_padded_draft_ignores_its_draft_probabilities():
    """Nothing was sampled from a padded draft's q row, so nothing of it leaves p."""
    p = torch.tensor([0.3, 0.1, 0.4, 0.2])
    n = 20_000
    torch.manual_seed(0)
    q = torch.tensor([0.0, 0.0, 0.9, 0.1]).expand(n, 4).clone()
    out = _sample(fast.rejection_sample, [[-1]] * n, p.log().expand(n, 4).clone(), q)
    freq = torch.bincount(out[:, 0].long(), minlength=4).double() / n
    assert torch.allclose(freq, p.double(), atol=0.015), freq


def _draws(drafts, logits, q, batches: int = 300):
    """Our sampler's outputs for `batches` copies of one batch, from one fixed seed."""
    torch.manual_seed(1)
    return torch.cat([_sample(fast.rejection_sample, drafts, logits, q) for _ in range(batches)])


def test_draft_probabilities_in_a_reduced_vocabulary_read_as_dense_ones():
    """q over a head's own vocabulary (its columns' target ids attached) gives, draw for
    draw, the tokens the same q spread over the target vocabulary gives."""
    torch.manual_seed(0)
    vocab, vocab_ids = 40, torch.tensor([0, 3, 4, 9, 17, 22, 31, 39])
    drafts = [[3, 9, 22], [], [17], [-1], [39, 0]]
    rows = sum(len(d) for d in drafts)
    logits = torch.randn(rows, vocab) * 2
    reduced = torch.randn(rows, len(vocab_ids)).softmax(-1)
    dense = fast.to_target_vocab(reduced, vocab_ids, vocab)
    fast.hand_on(reduced, fast.DraftLayout(vocab_ids))
    outs = [_draws(drafts, logits, q) for q in (dense, reduced)]
    assert torch.equal(outs[0], outs[1])
    assert len({tuple(r) for r in outs[0].tolist()}) > 20  # rejections and recoveries happen


def test_rows_flagged_one_hot_verify_their_draft_as_chosen_outright():
    """Group drafts among sampled ones: rows flagged one-hot (zero in a reduced q, their
    token possibly outside its vocabulary) give, draw for draw, what dense q one-hot at
    the draft token gives, in our sampler and through vLLM's (mixed batches)."""
    torch.manual_seed(0)
    vocab, vocab_ids = 40, torch.tensor([0, 3, 4, 9, 17, 22, 31, 39])
    drafts = [[3, 9, 22], [], [17], [-1], [39, 5]]
    flagged = torch.tensor([True, True, True, False, False, True, True])  # requests 0 and 4
    rows = sum(len(d) for d in drafts)
    logits = torch.randn(rows, vocab) * 2
    reduced = torch.randn(rows, len(vocab_ids)).softmax(-1)
    reduced[flagged] = 0.0
    dense = fast.to_target_vocab(reduced, vocab_ids, vocab)
    tokens = torch.tensor([t for d in drafts for t in d])
    dense[flagged.nonzero().squeeze(1), tokens[flagged]] = 1.0
    assert torch.equal(
        fast.with_one_hot_rows(fast.to_target_vocab(reduced, vocab_ids, vocab), flagged, tokens),
        dense,
    )
    fast.hand_on(reduced, fast.DraftLayout(vocab_ids, flagged))
    outs = [_draws(drafts, logits, q) for q in (dense, reduced)]
    assert torch.equal(outs[0], outs[1])
    # Request 4's draft [39, 5], token 5 outside the head's vocabulary: both kept exactly
    # when both are accepted (a rejected one is never re-drawn), p(39) p(5) of the time.
    both = ((outs[1][4::5, 0] == 39) & (outs[1][4::5, 1] == 5)).double().mean()
    expected = logits[5].softmax(-1)[39] * logits[6].softmax(-1)[5]
    assert abs(both - expected) < 4 * (expected * (1 - expected) / 300) ** 0.5 + 1e-3, (
        both,
        expected,
    )


def test_inverse_cdf_keeps_light_tokens_of_a_large_vocabulary():
    """Tokens of weight 2.9e-8 after a mass of 0.5 are finer than a float32 running sum
    resolves there (steps of 6e-8); each must still own its slice of [0, total)."""
    vocab, light = 49_152, 2.9e-8
    weights = torch.full((1, vocab), light)
    weights[0, 0] = 0.5
    weights[0, -1] = 0.5 - light * (vocab - 2)
    total = weights.double().sum()
    for token in (1, 2, 1000, vocab // 2, vocab - 2):
        # the middle of `token`'s slice of [0, total)
        u = (0.5 + (token - 0.5) * light) / total
        assert fast.inverse_cdf(weights, u.view(1)).item() == token


def _output_distributions(sample, draft_probs, replicas, padded):
    """Per (request, seeded?) group, the distribution of its output rows. The batch repeats
    four requests that draft [1, 2], nothing, [3, `padded`] and [`padded`]; odd replicas
    are seeded."""
    torch.manual_seed(0)
    logits = torch.tensor(
        [
            [0.5, 0.3, 0.1, 0.05, 0.05, 0.0],
            [0.1, 0.1, 0.6, 0.1, 0.1, 0.0],
            [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
            [0.3, 0.05, 0.35, 0.15, 0.15, 0.0],  # padded positions: token 5 has p = 0
            [0.35, 0.15, 0.1, 0.2, 0.2, 0.0],
        ]
    ).log()
    pattern = [[1, 2], [], [3, padded], [padded]]
    generators = {4 * r + i: _seeded(4 * r + i) for r in range(1, replicas, 2) for i in range(4)}
    out = _sample(
        sample,
        pattern * replicas,
        logits.repeat(replicas, 1),
        None if draft_probs is None else draft_probs.repeat(replicas, 1),
        generators,
    )
    groups: dict[tuple, Counter] = {}
    for index, row in enumerate(out.tolist()):
        groups.setdefault((index % 4, index in generators), Counter())[tuple(row)] += 1
    return {k: {row: c / sum(v.values()) for row, c in v.items()} for k, v in groups.items()}


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_fast_rejection_sampling_matches_vllm_distribution(with_draft_probs):
    """Seeded and unseeded requests, padded drafts, and draft probabilities that are not
    one-hot: per request, our output distribution is vLLM's (total variation)."""
    q = (
        torch.tensor(
            [
                [0.3, 0.6, 0.05, 0.02, 0.02, 0.01],
                [0.05, 0.05, 0.8, 0.05, 0.05, 0.0],
                [0.1, 0.1, 0.1, 0.5, 0.1, 0.1],
                [0.1, 0.2, 0.2, 0.2, 0.1, 0.2],
                [0.1, 0.3, 0.2, 0.2, 0.1, 0.1],
            ]
        )
        if with_draft_probs
        else None
    )
    ours = _output_distributions(fast.rejection_sample, q, 40_000, padded=-1)
    # vLLM's CPU kernel reads p[-1] out of bounds for a padded draft (the Triton kernel
    # rejects it), so its run drafts instead a token of target probability 0 with q one-hot
    # on it: the same rule (always rejected, nothing taken out of p).
    if q is not None:
        q = q.clone()
        q[3:] = torch.nn.functional.one_hot(torch.tensor(5), 6).float()
    theirs = _output_distributions(_vllm_rejection_sample(), q, 40_000, padded=5)
    assert ours.keys() == theirs.keys()
    for group in ours:
        a, b = ours[group], theirs[group]
        tv = 0.5 * sum(abs(a.get(k, 0) - b.get(k, 0)) for k in a.keys() | b.keys())
        assert tv < 0.03, (group, tv, sorted(a.items()), sorted(b.items()))
    # request 1 drafted nothing: its output is just the bonus token
    assert set(ours[(1, False)]) == set(ours[(1, True)]) == {(BONUS, -1, -1)}
