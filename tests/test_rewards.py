"""The graders (`grpo_specdec/tasks/rewards.py`) on answers math RL data is full of:
LaTeX fractions, boxes, units, signs, sets, several boxes. Each row's verdict is what a
careful grader says; `math-verify` (the job's default) must reach it, and the numeric rule
must agree wherever the response states a plain number, and abstain (wrong) elsewhere,
never reading a number out of a LaTeX expression."""

from __future__ import annotations

import pytest

from grpo_specdec.tasks.rewards import (
    boxed,
    check_ground_truth,
    extract_answer,
    math_verify_is_correct,
    number_is_correct,
    reward,
    to_number,
)

# (response, ground truth, right?)
TABLE = [
    (r"The answer is \boxed{\frac{1}{2}}", "1/2", True),
    (r"The answer is \boxed{\frac{1}{2}}", "2", False),
    (r"\boxed{1/2}", r"\frac{1}{2}", True),
    (r"\boxed{1/2}", "2", False),
    (r"so $\boxed{\dfrac{3}{4}}$", "3/4", True),
    (r"so $\boxed{\dfrac{3}{4}}$", "4", False),
    (r"\boxed{0.75}", r"\frac{3}{4}", True),
    (r"\boxed{\tfrac{5}{2}}", "2.5", True),
    (r"\boxed{-\frac{1}{3}}", "-1/3", True),
    (r"\boxed{\frac{-1}{3}}", r"-\frac{1}{3}", True),
    (r"\boxed{\frac{1}{3}}", "-1/3", False),
    ("The answer is 12.", "12", True),
    ("The answer is 12.", "13", False),
    ("The answer is -3.", "-3", True),
    ("The answer is 3.", "-3", False),
    ("The answer is 1,200.", "1200", True),
    (r"\boxed{1,234}", "1234", True),
    (r"\boxed{5 \text{ cm}}", "5", True),
    (r"\boxed{5\text{ cm}^2}", "5", True),
    (r"\boxed{\$18}", "18", True),
    (r"\boxed{18 \text{ dollars}}", "18", True),
    (r"\boxed{45^\circ}", "45", True),
    (r"\boxed{50\%}", r"50\%", True),
    (r"\boxed{3} then \boxed{2}", "2", False),  # two different answers: neither
    (r"\boxed{2} and finally \boxed{2}", "2", True),
    (r"\boxed{\frac{1}{2}}, i.e. \boxed{0.5}", "1/2", True),
    (r"\boxed{\{1,2\}}", r"\{1,2\}", True),
    (r"\boxed{\{2,1\}}", r"\{1,2\}", True),
    (r"\boxed{(1,2)}", "(1,2)", True),
    (r"\boxed{[0, 1)}", "[0,1)", True),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}", True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}", False),
    (r"\boxed{\frac{\sqrt{3}}{2}}", "2", False),
    (r"\boxed{2\pi}", r"2\pi", True),
    (r"\boxed{x^2+1}", "1+x^2", True),
    (r"\boxed{x = 5}", "5", True),
    (r"\boxed{10}", "10.0", True),
    (r"\boxed{0.333}", "1/3", False),
    (r"\boxed{\pi}", "3.14", False),
    (r"\boxed{3.14}", "3.14", True),
    ("I think 12, no wait, the answer is 13", "13", True),
    ("blah 7 blah 8", "8", True),
    ("no answer here", "7", False),
    (r"$\frac{1}{2}$ of the 10 apples is \boxed{5}", "5", True),
    (r"\boxed{2^{10}}", "1024", True),
    (r"\boxed{10^3}", "1000", True),
    (r"\boxed{\text{(B)}}", "B", True),
    (r"Answer: \boxed{-0.5}", r"-\frac{1}{2}", True),
]


def test_the_table_is_large_enough_to_mean_something():
    assert len(TABLE) >= 40
    assert sum(right for *_, right in TABLE) >= 10 and sum(not r for *_, r in TABLE) >= 10


@pytest.mark.parametrize("response,truth,right", TABLE)
def test_math_verify_grades_as_a_careful_grader_would(response, truth, right):
    assert math_verify_is_correct(response, truth) is right


@pytest.mark.parametrize("response,truth,right", TABLE)
def test_the_numeric_rule_agrees_where_the_answer_is_a_plain_number(response, truth, right):
    stated = extract_answer(response)
    if to_number(truth) is None:
        with pytest.raises(ValueError, match="not a plain number"):
            number_is_correct(response, truth)
    elif stated is not None:
        assert number_is_correct(response, truth) is right
    else:  # no plain number stated: the rule abstains, whatever math-verify finds
        assert number_is_correct(response, truth) is False


def test_a_latex_fraction_is_never_read_as_its_last_digit():
    for response in (r"\boxed{\frac{1}{2}}", r"\boxed{1/2}", r"\boxed{\dfrac{3}{4}}"):
        assert extract_answer(response) is None
    assert reward(r"The answer is \boxed{\frac{1}{2}}", "2", "number", 0.0) == 0.0
    assert reward(r"The answer is \boxed{\frac{1}{2}}", "2", "math_verify", 0.0) == 0.0
    assert reward(r"The answer is \boxed{\frac{1}{2}}", "0.5", "math_verify", 0.0) == 1.0


def test_boxes_are_read_with_balanced_braces():
    assert boxed(r"a \boxed{\frac{\sqrt{3}}{2}} b \boxed {7} \boxed{unclosed") == [
        r"\frac{\sqrt{3}}{2}",
        "7",
    ]


def test_plain_numbers_only():
    assert [to_number(x) for x in ("1,200", "-3", ".5", "$42", " 7 ")] == [1200, -3, 0.5, 42, 7]
    assert [to_number(x) for x in ("inf", "nan", "1e3", "1/2", "", "12 apples")] == [None] * 6


def test_ground_truths_a_grader_cannot_use_are_named():
    assert check_ground_truth("1/2", "math_verify") is None
    assert "not a plain number" in check_ground_truth("1/2", "number")
    assert "empty" in check_ground_truth("  ", "math_verify")
    with pytest.raises(ValueError, match="cannot read the ground truth"):
        math_verify_is_correct("7", "\\")
