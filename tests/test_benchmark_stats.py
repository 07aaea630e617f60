"""Benchmark helpers: the e2e benchmark's reward comparison (prompts, not samples, are the
independent units), the writer of the study files in docs/benchmarks/ and the rollout
benchmark's choice of configurations."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks import common
from benchmarks.common import STALE_NOTES, write_study
from benchmarks.e2e_grpo import paired_t, prompt_means, report
from benchmarks.rollout_report import mean_conditional
from benchmarks.rollout_throughput import named_configs

# Per-prompt rewards of two configurations on the same six prompts: a difference within noise.
X = [0.5, 0.2, 0.4, 0.3, 0.6, 0.1]
Y = [0.3, 0.4, 0.1, 0.2, 0.3, 0.2]


def welch_t(x: list[float], y: list[float]) -> float:
    """Welch's t, every value an independent unit (the report used it on per-sample rewards)."""
    vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    return (statistics.mean(x) - statistics.mean(y)) / math.sqrt(vx + vy)


def test_prompt_means_split_each_iteration_prompt_major():
    rewards = [[1, 1, 0, 0, 0.5, 0.5], [0, 0.25, 1, 1, 0, 0]]  # 2 iterations x 3 prompts x 2
    assert prompt_means(rewards, group=2) == [1, 0, 0.5, 0.125, 1, 0]


def test_paired_t_matches_the_textbook_value():
    # Differences 1, 2, 3: mean 2, standard deviation 1, so t = 2 / (1 / sqrt 3).
    assert paired_t([2, 4, 6], [1, 2, 3]) == pytest.approx(2 * math.sqrt(3))
    assert paired_t([1, 2, 3], [1, 2, 3]) == 0.0


def test_duplicated_samples_inflate_the_per_sample_t_but_not_the_prompt_level_t():
    # G identical samples per prompt carry no more information than one, whatever G (8 and
    # 16 are the group sizes of the benchmark's shapes).
    t_once = paired_t(X, Y)
    assert abs(t_once) < 2
    for group in (8, 16):
        rx = [[v for v in X for _ in range(group)]]
        ry = [[v for v in Y for _ in range(group)]]
        assert paired_t(prompt_means(rx, group), prompt_means(ry, group)) == pytest.approx(t_once)
        assert welch_t(rx[0], ry[0]) > 3  # the same data looks significant


def test_pairing_removes_the_spread_between_prompts():
    # Prompts differ a lot in difficulty; one configuration is a little better on every one.
    # Compared prompt by prompt that is a clear difference, which an unpaired test hides.
    easy_to_hard = [0.9, 0.7, 0.5, 0.3, 0.1, 0.05]
    better = [v + 0.05 + 0.01 * i for i, v in enumerate(easy_to_hard)]
    assert paired_t(better, easy_to_hard) > 5
    assert abs(welch_t(better, easy_to_hard)) < 1


def test_report_shows_the_paired_prompt_level_t_against_the_reference():
    def run(per_prompt: list[float]) -> dict:  # 2 iterations x 3 prompts x 8 equal samples
        return {
            "generation_s": 1.0,
            "policy_update_s": 1.0,
            "draft_train_s": 0.0,
            "sync_s": 0.0,
            "iteration_s": 2.0,
            "reward": statistics.mean(per_prompt),
            "mal": [1.0, 1.0],
            "rewards": [[v for v in per_prompt[i : i + 3] for _ in range(8)] for i in (0, 3)],
        }

    text = report("default", {"a": run(Y), "b": run(X)}, iterations=2, group=8)
    row = next(line for line in text.splitlines() if line.startswith("| (b) "))
    assert row.endswith(f"| {paired_t(X, Y):+.2f} |")
    assert "over the 6 prompts (5 degrees of freedom)" in text


NOTES = "## How to read it\n\nk = 1 reads 1.20x."


@pytest.fixture
def studies(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "STUDIES", tmp_path)
    return tmp_path


def test_a_run_rewrites_its_study_whole(studies):
    write_study("s", "Study", "| k=1 | 1.20x |\n\n### Old workload", "s.py", today="2026-11-30")
    path = write_study("s", "Study", "| k=1 | 1.10x |", "s.py", today="2026-12-01")
    text = path.read_text()
    assert text.startswith("# Study\n\nMeasured on 2026-12-01. `python benchmarks/s.py`")
    assert "1.10x" in text and "1.20x" not in text and "Old workload" not in text
    assert text.count("# Study") == 1 and text.count("<!-- results -->") == 1


def test_notes_are_kept_and_flagged_once_when_the_results_change(studies):
    path = write_study("s", "Study", "| k=1 | 1.20x |", "s.py", today="2026-11-30")
    path.write_text(path.read_text() + f"\n<!-- reading -->\n{NOTES}\n<!-- /reading -->\n")
    write_study("s", "Study", "| k=1 | 1.20x |", "s.py", today="2026-12-05")  # rebuilt, same data
    text = path.read_text()
    assert "Measured on 2026-11-30" in text and NOTES in text and STALE_NOTES not in text
    for day in ("2026-12-01", "2026-12-02"):  # two new runs
        write_study("s", "Study", f"| k=1 | {day} |", "s.py", today=day)
    text = path.read_text()
    assert "Measured on 2026-12-02" in text
    assert text.count(STALE_NOTES) == 1 and text.index(STALE_NOTES) < text.index(NOTES)
    assert text.rstrip().endswith("<!-- /reading -->")


def _tail_run(makespan_s: float, tail_s: float, after_eos: float = 0, **more) -> dict:
    """One configuration's row of the tail study, as rollout_throughput.py measures it."""
    return {
        "tokens_after_eos": after_eos,
        **more,
        "tokens_per_s": 10.0,
        "wall_s": makespan_s,
        "mal": 1.0,
        "makespan_s": makespan_s,
        "tail_s": tail_s,
        # three rounds; the machine drifts between rounds, alike for every configuration
        "makespan_s_runs": [makespan_s * drift for drift in (1.0, 1.3, 0.9)],
        "others_cpu_share": [0.01, 0.02, None],
    }


def _tail_study(per: dict) -> dict:
    """A result of rollout_throughput.py with only the tail shape run, its rows `per`."""
    from benchmarks import rollout_report as rt

    return {
        "args": {"repeats": 1, "head": None, "study": "check", "tokens": 64},
        "hardware": "cpu",
        "k_max": 5,
        "c_peak": 21,
        "static_tables": {"base": [[1, 4, 2]]},
        "results": {"tail": {"tail": rt.with_speedups("tail", per)}},
        "traces": {},
        "shapes": {},
        "tail_shape": {"prompts": 8, "group": 8, "cap": 1024},
        "tail_timelines": {"no spec": [(0.0, 1.0), (0.0, 3.0)], "ours": [(0.0, 0.5), (0.1, 2.0)]},
    }


def test_the_tail_table_reads_makespans_against_no_speculation_and_the_best_fixed_k(
    tmp_path, monkeypatch
):
    from benchmarks import rollout_report as rt

    per = {
        "no spec": _tail_run(100, 40),
        "k=1": _tail_run(95, 30),
        "sampled k=2": _tail_run(90, 25),
        "static table": _tail_run(96, 31),
        "ours": _tail_run(80, 20, after_eos=12, mal_before_eos=2.5),
    }
    result = _tail_study(per)
    text = rt.report(result)
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in text.splitlines()
        if line.startswith("| ")
    }
    # paired by round, the drift cancels: 1.25x in each, a gain; 0.95 in each, a loss
    assert [c.strip() for c in rows["ours"][:4]] == [
        "80.0",
        "1.25x [1.25, 1.25], gain",
        "20.0",
        "2.00x",
    ]
    assert rows["k=1"][1].strip() == "1.05x [1.05, 1.05], gain"
    assert [c.strip() for c in rows["ours"][5:8]] == ["1.00", "2.50", "12"]
    assert [c.strip() for c in rows["no spec"][5:8]] == ["1.00", "-", "0"]
    assert "During the timed runs others took at most 2.0% of the machine" in text
    assert (
        "ours vs sampled k=2: 1.12x, static table: 1.20x in makespan (best fixed k: sampled k=2)"
        in text
    )
    monkeypatch.setattr(rt, "ASSETS", tmp_path)
    rt.plot(result)
    assert (tmp_path / "check_tail_b.png").stat().st_size > 0


def test_the_tail_summary_names_only_the_rivals_that_were_run():
    """A study of ours alone (docs/benchmarks/rollout_tail_no_profile.md) printed "ours vs  in
    makespan (best fixed k: None)"."""
    from benchmarks import rollout_report as rt

    def summary(per: dict) -> list[str]:
        lines = rt.report(_tail_study(per)).splitlines()
        return [line for line in lines if line.startswith("ours vs")]

    alone = {"no spec": _tail_run(100, 40), "ours": _tail_run(80, 20)}
    assert summary(alone) == []
    assert summary({**alone, "static table": _tail_run(96, 31)}) == [
        "ours vs static table: 1.20x in makespan."
    ]


def test_only_names_configurations_that_hold_a_comma():
    known = ["no spec", "k=0 (draft loaded)", "k=0, vLLM as shipped", "k=1", "ours"]
    assert named_configs("k=0, vLLM as shipped,k=1", known) == (["k=0, vLLM as shipped", "k=1"], [])
    assert named_configs("ours,k=9", known) == (["ours"], ["k=9"])


def test_acceptance_averages_over_runs_whose_drafts_reached_different_depths():
    # P(all of positions <= i accepted): one run drafted 3 deep, the other 2.
    mean = mean_conditional([[0.5, 0.25, 0.125], [0.8, 0.4]])
    assert mean == pytest.approx([0.65, 0.5, 0.5])


def test_the_learning_run_s_reward_slope_has_an_interval_that_can_exclude_zero():
    from benchmarks.learning_run import _slope

    slope, low, high = _slope([0.1 + 0.01 * i for i in range(20)])
    assert slope == pytest.approx(0.01) and low == pytest.approx(0.01)
    assert high == pytest.approx(0.01)
    rising = [0.05 + 0.01 * i + (0.03 if i % 2 else -0.03) for i in range(20)]
    slope, low, high = _slope(rising)
    assert 0 < low < slope < high
    flat = [0.1 + (0.05 if i % 3 == 0 else -0.02) for i in range(20)]
    _, low, high = _slope(flat)
    assert low < 0 < high


def test_notes_whose_closing_marker_was_lost_by_hand_are_kept(studies):
    path = write_study("s", "Study", "| k=1 | 1.20x |", "s.py", today="2026-11-30")
    path.write_text(path.read_text() + f"\n<!-- reading -->\n{NOTES}\n")  # no closing marker
    write_study("s", "Study", "| k=1 | 1.10x |", "s.py", today="2026-12-01")
    text = path.read_text()
    assert NOTES in text and text.rstrip().endswith("<!-- /reading -->")
