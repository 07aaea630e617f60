"""The tail shape's pieces that need no engine: DAPO's soft overlong punishment, the
shape's seeded prompts, and the tail figures read from per-request finish times."""

from __future__ import annotations

import pytest

from grpo_specdec.bench.tail_shape import in_flight, tail_phase_s, tail_share, tokens_after_eos
from grpo_specdec.tasks.arithmetic import MAX_LEVEL, make_problem
from grpo_specdec.tasks.length_budgets import tail_shape
from grpo_specdec.tasks.rewards import overlong_penalty


def test_overlong_penalty_is_free_then_falls_linearly_to_the_full_penalty_at_the_cap():
    cap, buffer = 1000, 200
    assert overlong_penalty(0, cap, buffer) == 0.0
    assert overlong_penalty(800, cap, buffer) == 0.0
    assert overlong_penalty(801, cap, buffer) == pytest.approx(-1 / 200)
    assert overlong_penalty(900, cap, buffer) == pytest.approx(-0.5)
    assert overlong_penalty(1000, cap, buffer) == pytest.approx(-1.0)
    assert overlong_penalty(1500, cap, buffer) == pytest.approx(-1.0)
    assert overlong_penalty(900, cap, buffer, penalty=0.5) == pytest.approx(-0.25)
    lengths = range(0, 1200, 7)
    values = [overlong_penalty(n, cap, buffer) for n in lengths]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_overlong_penalty_with_the_whole_budget_as_buffer_starts_at_the_first_token():
    assert overlong_penalty(0, 100, 100) == 0.0
    assert overlong_penalty(50, 100, 100) == pytest.approx(-0.5)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((10, 0, 1), "max_tokens"),
        ((10, 100, 0), "buffer"),
        ((10, 100, 101), "buffer"),
        ((-1, 100, 10), "num_tokens"),
        ((10, 100, 10, -0.5), "penalty"),
    ],
)
def test_overlong_penalty_names_the_bad_argument(args, field):
    with pytest.raises(ValueError, match=field):
        overlong_penalty(*args)


def test_the_shape_is_seeded_mixes_every_level_and_keeps_budgets_within_the_cap():
    shape = tail_shape(num_prompts=8, group=8, cap=1024, seed=3)
    again = tail_shape(num_prompts=8, group=8, cap=1024, seed=3)
    assert shape == again
    assert shape != tail_shape(num_prompts=8, group=8, cap=1024, seed=4)
    assert len(shape.prompts) == len(shape.max_tokens) == len(shape.seeds) == 64
    assert shape.prompts[:8] == [shape.questions[0]] * 8
    levels = [make_problem(3, i, 1 + i % MAX_LEVEL) for i in range(8)]
    assert shape.questions == [p.question for p in levels]
    assert all(16 <= m <= 1024 for m in shape.max_tokens)
    assert len(set(shape.seeds)) == 64
    # The budgets follow the log-normal: about half above the median, a few far above it.
    above = sum(m > 256 for m in tail_shape(64, 8, 4096, seed=0).max_tokens) / 512
    assert 0.4 < above < 0.6


def test_the_shape_refuses_a_budget_outside_the_cap():
    with pytest.raises(ValueError, match="budget_median"):
        tail_shape(cap=128, budget_median=256)
    with pytest.raises(ValueError, match="budget_sigma"):
        tail_shape(budget_sigma=-1)


def test_tail_share_is_the_makespan_after_nine_tenths_finished():
    ends = [1.0] * 9 + [4.0]  # the 9th of 10 finished at 1 s, the last at 4 s
    assert tail_share(ends) == pytest.approx(0.75)
    assert tail_share([2.0] * 10) == 0.0
    ends = list(range(1, 21))  # 18 of 20 done at 18 s, makespan 20 s
    assert tail_share([float(t) for t in ends]) == pytest.approx(0.1)


def test_tail_phase_is_the_time_after_nine_tenths_finished_in_any_order():
    assert tail_phase_s([4.0] + [1.0] * 9) == pytest.approx(3.0)
    assert tail_phase_s([3.0, 1.0, 2.0, 2.5], fraction=0.5) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="finish time"):
        tail_phase_s([])


def test_in_flight_counts_requests_between_their_start_and_finish():
    times, counts = in_flight([0.0, 0.0, 0.0, 1.0], [2.0, 3.0, 10.0, 6.0])
    assert times.tolist() == [0.0, 1.0, 2.0, 3.0, 6.0, 10.0]
    assert counts.tolist() == [3, 4, 3, 2, 1, 0]


def test_tokens_after_eos_count_past_each_answers_first_eos_only():
    eos = 2
    answers = [[5, 6, 2, 7, 2, 8], [5, 2], [5, 6, 7], [2, 9]]
    # 3 after the first EOS of the first (its second EOS counts as text), 0, none, 1
    assert tokens_after_eos(answers, eos) == 4
    assert tokens_after_eos([[5, 6]], eos) == 0
