"""The scheduler's check that vLLM runs the k it chose (vllm_plugin/k_check.py)."""

from __future__ import annotations

from vllm_plugin.k_check import MISMATCHED_STEPS, KHonouredCheck


def test_a_lasting_disagreement_is_said_once_with_both_numbers():
    check = KHonouredCheck()
    said = [check.step_verified(4, 2) for _ in range(3 * MISMATCHED_STEPS)]
    assert [m is not None for m in said].count(True) == 1
    message = said[MISMATCHED_STEPS - 1]
    assert "k = 4" in message and "at most 2 draft" in message
    assert check.seen == (4, 2)


def test_single_steps_that_verify_fewer_and_unknown_steps_say_nothing():
    check = KHonouredCheck()
    steps = [(3, 1), (3, 3)] * 5 + [(None, 0), (2, None)] * 5 + [(0, 0), (5, 5)]
    steps += [(3, 1)] * (MISMATCHED_STEPS - 1) + [(3, 3)]
    assert all(check.step_verified(k, got) is None for k, got in steps)
    assert check.seen is None


def test_more_drafts_than_chosen_is_a_disagreement_too():
    check = KHonouredCheck()
    said = [check.step_verified(0, 2) for _ in range(MISMATCHED_STEPS)]
    assert said[-1] is not None and "k = 0" in said[-1]
