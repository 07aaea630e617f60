"""The acceptance estimate the controller prices k on: pooled, per request, restarts."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_plugin.acceptance import AcceptanceEstimator, expected_tokens


def test_pool_learns_per_position_rates():
    est = AcceptanceEstimator(3, prior=0.5, prior_weight=1.0)
    for _ in range(300):
        est.observe(3, 3)  # all accepted
        est.observe(3, 1)  # first accepted, second rejected
    p = est.conditional()
    assert p[0] == pytest.approx(1.0, abs=0.01)
    assert p[1] == pytest.approx(0.5, abs=0.01)
    assert p[2] == pytest.approx(1.0, abs=0.02)  # only the fully accepted drafts reached it


def test_counts_only_positions_that_were_drafted():
    est = AcceptanceEstimator(4, prior=0.5, prior_weight=1e-9)
    est.observe(2, 2)  # a 2-token draft, both accepted: positions 0 and 1 only
    assert est.tried.tolist() == [1, 1, 0, 0]
    assert est.accepted.tolist() == [1, 1, 0, 0]


def test_drafts_past_eos_teach_their_request_and_leave_the_pool_unchanged():
    est = AcceptanceEstimator(4)
    for _ in range(50):
        est.observe(4, 4, "a")
    pool = est.tried.copy(), est.accepted.copy(), est.version
    for _ in range(50):
        est.observe(4, 0, "b", before_eos=False)
    assert (est.tried == pool[0]).all() and (est.accepted == pool[1]).all()
    assert est.version == pool[2]
    # ... but the request past its EOS is priced on what its own drafts showed
    past, before = est.running_tokens(["b"])[4], est.running_tokens(["a"])[4]
    assert past < est.optimistic_tokens()[4] - 1 and past < before - 1


def test_a_restart_keeps_the_estimate_at_a_weak_weight():
    est = AcceptanceEstimator(4, restart_weight=32.0)
    for _ in range(2000):
        est.observe(4, 0)
    est.restart()
    assert est.conditional()[0] < 0.1  # still low ...
    assert est.tried[0] == pytest.approx(32.0)  # ... at the weight of 32 drafts
    for _ in range(64):  # one step of a wave of 64 requests whose drafts are accepted
        est.observe(4, 4)
    assert est.conditional()[0] > 0.6


def test_each_running_request_is_priced_on_its_own_evidence():
    """In a rollout's tail the few requests left are not the bulk's average: a request
    whose drafts fail is priced low at every depth, though the pool's deep positions
    (reached by easy requests) stay high."""
    est = AcceptanceEstimator(4)
    rng = np.random.default_rng(0)
    for i in range(64):  # the bulk: like requests at 0.85
        for _ in range(8):
            accepted = 0
            while accepted < 4 and rng.random() < 0.85:
                accepted += 1
            est.observe(4, accepted, f"bulk{i}")
    for _ in range(30):  # one tail request at 0.2
        est.observe(4, int(rng.random() < 0.2), "tail")
    pooled = est.expected_tokens()
    tail = est.running_tokens(["tail"], optimistic=False)
    assert pooled[4] > 3.0 and tail[4] < pooled[4] - 1.0
    bulk = est.running_tokens([f"bulk{i}" for i in range(64)], optimistic=False)
    assert bulk[4] == pytest.approx(pooled[4], rel=0.1)
    # a request with no evidence of its own is the pool's
    assert est.running_tokens(["new"]) == pytest.approx(est.optimistic_tokens())
    est.forget(["tail"])
    assert set(est.requests) == {"tail"}


def test_a_tail_request_s_drafts_weigh_less_in_the_pool_the_more_it_gives():
    est = AcceptanceEstimator(4, request_share=16.0)
    for _ in range(64):
        est.observe(4, 4, f"r{_}")  # 64 requests, one draft each
    for _ in range(1000):
        est.observe(4, 0, "long")  # one request, a thousand drafts
    # A thousand drafts of one request weigh as ~16 ln(1 + 1000/16) ~ 66 drafts.
    assert est.conditional()[0] > 0.3


def test_expected_tokens():
    assert expected_tokens(np.array([0.5, 0.5])) == pytest.approx([1.0, 1.5, 1.75])
    assert expected_tokens(np.array([1.0, 0.0, 1.0])) == pytest.approx([1.0, 2.0, 2.0, 2.0])
    rows = expected_tokens(np.array([[0.5, 0.5], [1.0, 0.0]]))
    assert rows.tolist() == [[1.0, 1.5, 1.75], [1.0, 2.0, 2.0]]


def test_one_draft_token_engines_take_drafts_past_eos():
    est = AcceptanceEstimator(1)
    est.observe(1, 0, "a", before_eos=False)
    est.observe(1, 1, "a", before_eos=False)
    assert est.running_tokens(["a"]).shape == (2,)
