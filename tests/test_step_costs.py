"""Step costs learnt from the engine's own timed steps (vllm_plugin/step_costs.py)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_plugin.acceptance import AcceptanceEstimator
from vllm_plugin.controller import HingeLatency, LatencyModel, LinearCost
from vllm_plugin.goodput_controller import GoodputController
from vllm_plugin.step_costs import StepCosts

PROFILE = LatencyModel(HingeLatency(20.0, 0.5, 0.0), LinearCost(0.7, 0.0), LinearCost(1.0, 0.1))
K_MAX = 4


def timed(costs: StepCosts, truth, steps: int, batches, ks, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        b, k = int(rng.choice(batches)), int(rng.choice(ks))
        costs.observe(b, k, None, float(truth(b, k)) * float(np.exp(noise * rng.normal())))


def test_a_profile_that_underprices_drafting_is_corrected_per_k():
    # Sampling at T = 1 costs per verified token where the profile timed greedy steps:
    # a k = 4 step dearer by 25%, a k = 0 step by 10%.
    def truth(b, k):
        return float(PROFILE.step_ms(b, k)) * (1.1 + 0.15 * k / K_MAX)

    costs = StepCosts(PROFILE, K_MAX, 64)
    timed(costs, truth, 4000, [1, 2, 4, 8, 16, 32, 64], range(K_MAX + 1), noise=0.1)
    for b in (1, 8, 64):
        want = [truth(b, k) for k in range(K_MAX + 1)]
        assert costs.step_ms(b) == pytest.approx(want, rel=0.06)


def test_a_noisy_step_moves_a_settled_price_by_a_bounded_factor():
    costs = StepCosts(PROFILE, K_MAX, 64)
    timed(costs, lambda b, k: float(PROFILE.step_ms(b, k)), 50, [8], [1])
    before = costs.step_ms(8)[1]
    costs.observe(8, 1, None, 50 * before)  # timed while something else had the machine
    assert costs.step_ms(8)[1] < before * np.exp(0.5 / 2)  # one nudge, not a new price


def test_prices_never_fall_with_k():
    costs = StepCosts(PROFILE, K_MAX, 64)
    costs.observe(4, 3, None, 5.0)  # a step at k = 3 timed absurdly cheap
    assert (np.diff(costs.step_ms(4)) >= 0).all()


def test_a_k_timed_at_some_batch_sizes_is_priced_at_the_others():
    def truth(b, k):
        return float(PROFILE.step_ms(b, k)) * (1.3 if k else 1.0)

    costs = StepCosts(PROFILE, K_MAX, 64)
    timed(costs, truth, 400, [2, 32], [0, 1])
    assert costs.step_ms(8)[1] / float(PROFILE.step_ms(8, 1)) > 1.2


def test_without_a_profile_the_engine_drafts_only_once_its_own_steps_show_it_pays():
    """Started with no profile: k = 0 (the compute-bound prior prices no draft as paying),
    then the probes time k = 1, 2, ... and it settles on the k a profiled engine runs."""
    truth = LatencyModel(HingeLatency(25.0, 0.5, 0.0), LinearCost(1.0, 0.0), LinearCost(1.0, 0.0))
    unprofiled = GoodputController(None, AcceptanceEstimator(K_MAX), 64)
    profiled = GoodputController(truth, AcceptanceEstimator(K_MAX), 64)
    rng = np.random.default_rng(0)
    first = []
    for _ in range(600):
        for controller in (unprofiled, profiled):
            k = controller.choose(2, None, ["a", "b"])
            if controller is unprofiled:
                first.append(k)
            for request in ("a", "b"):
                accepted = 0
                while accepted < k and rng.random() < 0.8:
                    accepted += 1
                if k:
                    controller.drafts_verified(request, k, accepted)
            controller.step_timed(2, k, None, float(truth.step_ms(2, k)))
    assert first[0] == 0  # no profile: no draft before a timed one
    running = (2, None, ["a", "b"])
    assert unprofiled.best(*running)[0] == profiled.best(*running)[0] > 1


def test_without_a_profile_a_range_of_b_keeps_the_price_its_own_steps_showed():
    """An unprofiled engine timed k = 0 at B = 64 and then ran small batches for long (a
    rollout's tail): the price of B = 64 stays what its steps showed, not the mean of
    every range's (a unit of a memory-bound step at B = 1 costs 50 times one at 64)."""
    costs = StepCosts(None, K_MAX, 64)
    for _ in range(2):
        costs.observe(64, 0, None, 6.0)
    for _ in range(300):
        costs.observe(1, 0, None, 5.0)
        costs.observe(4, 0, None, 5.2)
    assert 5.0 < costs.step_ms(64)[0] < 7.0
    # a range never timed is priced between the ranges timed around it
    assert 5.2 <= costs.step_ms(16)[0] <= 6.0


def test_a_price_learnt_in_a_slow_first_wave_moves_with_the_machine_though_not_timed_again():
    """An engine's first rollout runs every step 1.8x slower (measured on the EPYC: cold
    caches and allocator). The k = 0 steps of B = 12, timed only then, must not keep that
    price once the next wave's steps (other cells) show the machine 1.8x faster."""

    def truth(b, k):
        return float(PROFILE.step_ms(b, k))

    for profile in (PROFILE, None):
        costs = StepCosts(profile, K_MAX, 64)
        timed(costs, lambda b, k: 1.8 * truth(b, k), 300, [12, 32, 64], [0], seed=1)
        timed(costs, lambda b, k: 1.8 * truth(b, k), 100, [12], [4], seed=2)
        costs.new_wave()
        timed(costs, truth, 200, [32, 64], [0], seed=3)
        timed(costs, truth, 100, [12], [4], seed=4)
        assert costs.step_ms(12)[0] == pytest.approx(truth(12, 0), rel=0.1)
        assert costs.step_ms(12)[4] == pytest.approx(truth(12, 4), rel=0.1)


def test_a_steady_machine_leaves_the_prices_of_cells_not_timed_again_where_they_were():
    costs = StepCosts(None, K_MAX, 64)
    timed(costs, lambda b, k: float(PROFILE.step_ms(b, k)), 400, [12, 64], [0, 2], noise=0.1)
    before = costs.step_ms(12)[0]
    costs.new_wave()
    timed(costs, lambda b, k: float(PROFILE.step_ms(b, k)), 100, [64], [0], noise=0.1, seed=5)
    assert costs.step_ms(12)[0] == pytest.approx(before, rel=0.05)
