"""The rollout simulator's invariants (grpo_specdec/simulate.py): plain numpy, no engine."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from grpo_specdec.simulate import (
    MeasuredSteps,
    UnprofiledCosts,
    Workload,
    compare,
    drawn_replay,
    lengths_from_trace,
    load_profile,
    named_lengths,
    recommend_table,
    replay,
)
from vllm_plugin.acceptance import FrozenAcceptance
from vllm_plugin.controller import (
    FixedPolicy,
    GoodputPolicy,
    HingeLatency,
    LatencyModel,
    LinearCost,
)

ROOT = Path(__file__).resolve().parents[1]
LATENCY = LatencyModel(HingeLatency(10.0, 0.5, 0.0), LinearCost(0.5, 0.1), LinearCost(0.8, 0.0))


def test_no_spec_makespan_is_prefill_plus_each_steps_target_latency():
    # lengths 1, 3, 3, 5 over 10-token prompts: prefill makes every first token and the
    # one-token request leaves; then B = 3, 3 (the 3s finish), 1, 1.
    w = Workload([1, 3, 3, 5], [10, 10, 10, 10])
    r = replay(LATENCY, [0.5], w, FixedPolicy(0))
    t = LATENCY.target
    assert r.makespan_s == pytest.approx((t(40) + 2 * t(3) + 2 * t(1)) / 1000)
    assert [b for _, b, _ in r.steps] == [4, 3, 3, 1, 1]
    assert r.tokens == 12 and r.mal == 1.0


def test_fixed_k_with_nothing_accepted_is_slower_by_the_verify_cost():
    w = Workload([20] * 6 + [40] * 2, 16)
    plain = replay(LATENCY, [0.0, 0.0], w, FixedPolicy(0))
    spec = replay(LATENCY, [0.0, 0.0], w, FixedPolicy(2))
    assert [b for _, b, _ in spec.steps] == [b for _, b, _ in plain.steps]
    extra = sum(float(LATENCY.step_ms(b, 2) - LATENCY.step_ms(b, 0)) for _, b, _ in spec.steps[1:])
    assert extra > 0
    assert spec.makespan_s - plain.makespan_s == pytest.approx(extra / 1000)


def test_accepted_drafts_shorten_the_rollout_and_set_the_mal():
    w = Workload([31] * 4, 8)
    r = replay(LATENCY, [1.0, 1.0], w, FixedPolicy(2))
    assert r.mal == pytest.approx(3.0)
    assert len(r.steps) == 1 + 10  # 30 tokens after prefill, 3 a step


def test_drawn_tokens_end_a_batch_with_its_unluckiest_request():
    w = Workload([61] * 64, 8)
    flat = LatencyModel(HingeLatency(10.0, 0.5, 600.0), LinearCost(0.5, 0.0))  # steps cost alike
    expected = replay(flat, [0.6, 0.6], w, FixedPolicy(2))
    drawn = drawn_replay(8, flat, [0.6, 0.6], w, FixedPolicy(2))
    # The same tokens per request-step on average (1 + 0.6 + 0.36), but 64 requests drawing
    # them take more steps to all reach 61 than one request making the mean every step.
    assert drawn.mal == pytest.approx(expected.mal, rel=0.03)
    assert drawn.makespan_s > 1.1 * expected.makespan_s
    assert expected.tail_s == 0 < drawn.tail_s  # stragglers run on after the rest have left
    # Seeded: the same draws again; certain acceptance leaves nothing to draw.
    assert drawn_replay(8, flat, [0.6, 0.6], w, FixedPolicy(2)).makespan_s == drawn.makespan_s
    assert drawn_replay(3, flat, [1.0, 0.0], w, FixedPolicy(2)).makespan_s == pytest.approx(
        replay(flat, [1.0, 0.0], w, FixedPolicy(2)).makespan_s
    )


def test_a_profiled_attention_term_prices_each_step_at_its_context():
    attended = LatencyModel(LATENCY.target, LATENCY.draft, LATENCY.speculation, 0.01, 5.0)
    w = Workload([1, 3, 3, 5], [10, 10, 10, 10])
    r = replay(attended, [0.5], w, FixedPolicy(0))
    # After prefill the three running requests have contexts 11 (then 12, ...): mean 11.
    steps = [(3, 11.0), (3, 12.0), (1, 13.0), (1, 14.0)]
    expected = attended.target(40) + sum(attended.step_ms(b, 0, c) for b, c in steps)
    assert r.makespan_s == pytest.approx(expected / 1000)
    # An unprofiled attention cost is for profiles without the term: not counted twice.
    extra = UnprofiledCosts(attention_ms_per_kv_token=0.5)
    assert replay(attended, [0.5], w, FixedPolicy(0), extra).makespan_s == r.makespan_s
    assert (
        replay(LATENCY, [0.5], w, FixedPolicy(0), extra).makespan_s
        > replay(LATENCY, [0.5], w, FixedPolicy(0)).makespan_s
    )


def test_tail_phase_starts_when_nine_in_ten_requests_have_finished():
    w = Workload([*range(10, 19), 100], 4)
    r = replay(LATENCY, [0.5], w, FixedPolicy(0))
    # the ninth request finishes at its 18th token; the last then runs 82 more steps alone
    assert r.tail_s == pytest.approx(82 * float(LATENCY.target(1)) / 1000)


def test_recommended_table_is_non_increasing_in_batch_size_and_covers_it():
    latency = LatencyModel(HingeLatency(5.0, 0.05, 64.0), LinearCost(0.4, 0.004))
    ranges = recommend_table(latency, [0.8] * 6, 6, 512)
    ks = [k for first, last, k in ranges for _ in range(first, last + 1)]
    assert len(ks) == 512 and ranges[0][0] == 1
    assert all(a >= b for a, b in zip(ks, ks[1:]))
    assert ks[0] > 0 and ks[-1] == 0


def test_lengths_from_a_trace_replay_to_the_same_concurrency():
    lengths = np.array([1, 4, 4, 7, 9])
    ran = replay(LATENCY, [0.5], Workload(lengths, 5), FixedPolicy(0))
    rebuilt = lengths_from_trace([(t, b, k) for t, b, k in ran.steps], [0.5])
    assert sorted(rebuilt) == sorted(lengths.tolist())
    again = replay(LATENCY, [0.5], Workload(rebuilt, 5), FixedPolicy(0))
    assert [b for _, b, _ in again.steps] == [b for _, b, _ in ran.steps]


def test_ours_is_no_slower_than_no_spec_or_fixed_k_on_a_long_tail():
    w = Workload(named_lengths("lognormal:64:120:0.8:1024"), 60)
    replays = compare(LATENCY, [0.7, 0.6, 0.6, 0.5], w, 4, 64)
    ours = replays["ours"].makespan_s
    assert ours <= replays["no spec"].makespan_s + 1e-9
    assert ours <= min(r.makespan_s for n, r in replays.items() if n.startswith("k=")) * 1.02


@pytest.mark.parametrize(
    "bad, field",
    [
        (lambda: Workload([], 4), "output_lengths"),
        (lambda: Workload([3, 0], 4), "output_lengths"),
        (lambda: Workload([3], 0), "prompt_lengths"),
        (lambda: named_lengths("zipf:3"), "zipf:3"),
        (lambda: replay(LATENCY, [0.5], Workload([5], 4), FixedPolicy(3)), "k=3"),
        (lambda: drawn_replay(0, LATENCY, [0.5], Workload([5], 4), FixedPolicy(1)), "draws"),
    ],
)
def test_bad_input_names_what_is_wrong(bad, field):
    with pytest.raises(ValueError, match=field):
        bad()


def test_gpu_profile_script_runs_tiny_on_cpu_and_writes_a_profile(tmp_path):
    out = tmp_path / "tiny.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu.py"),
            "profile",
            "--tiny",
            "--sizes",
            "1,4",
            "--contexts",
            "16,32",
            "--repeats",
            "2",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    data = json.loads(out.read_text())
    latency, _ = load_profile(out)
    assert [(r["tokens"], r["context"]) for r in data["measurements"]] == [
        (1, 16),
        (4, 16),
        (1, 32),
        (4, 32),
    ]
    assert all(r["target_ms"] > 0 and r["draft_ms"] > 0 for r in data["measurements"])
    assert latency.target(1) > 0 and latency.context == 16 and latency.attention >= 0


def test_simulate_cli_prints_every_policy(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"latency": LATENCY.to_dict()}))
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_specdec",
            "simulate",
            "--profile",
            str(profile),
            "--acceptance",
            "0.7,0.6,0.5",
            "--lengths",
            "fixed:8:64",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Modelled, not measured: 8 requests")
    for name in ("no spec", "k=1", "k=3", "paper rule", "ours"):
        assert f"| {name} |" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["policies"]["no spec"]["makespan_s"] > 0 and saved["recommended_table"]


def test_a_batch_limit_below_the_requests_is_refused():
    workload = Workload(np.array([4.0, 4.0, 4.0]), 16, 1.0)
    with pytest.raises(ValueError, match="max_batch=2 is below the 3 requests"):
        compare(LATENCY, [0.5, 0.5], workload, 2, 2)


# A profile's timed steps as `grpo-specdec profile` stores them: every (B, k) at a short
# context, k = 0 and k_max again at a long one for some B.
TIMED = LatencyModel(
    HingeLatency(10.0, 0.5, 16.0),
    LinearCost(0.5, 0.1),
    LinearCost(0.8, 0.0),
    attention=0.0004,
    context=40.0,
    attention_per_seq=0.002,
)
BATCHES, K_MAX, SHORT, LONG = (1, 2, 4, 8, 16), 3, 40.0, 1000.0


def _timed_profile(steps=TIMED, fitted=TIMED) -> dict:
    def row(b, k, context, long):
        ms = float(steps.step_ms(b, k, context))
        return {"batch": b, "k": k, "context": context, "ms": ms, "long_context": long}

    rows = [row(b, k, SHORT, False) for b in BATCHES for k in range(K_MAX + 1)]
    rows += [row(b, k, LONG, True) for b in (1, 8) for k in (0, K_MAX)]
    return {"key": {}, "latency": fitted.to_dict(), "measurements": rows}


def test_measured_steps_read_the_timed_steps_and_interpolate_between_them():
    steps = MeasuredSteps.from_profile(_timed_profile())
    for b in BATCHES:
        for k in range(K_MAX + 1):
            assert steps.step_ms(b, k) == pytest.approx(float(TIMED.step_ms(b, k)))
    # linear in B between timed batch sizes, and past the largest along the last segment
    assert steps.step_ms(12, 2) == pytest.approx(
        (float(TIMED.step_ms(8, 2)) + float(TIMED.step_ms(16, 2))) / 2
    )
    assert steps.step_ms(32, 1) == pytest.approx(float(TIMED.step_ms(32, 1)))
    # attention: both parts are linear in k and per sequence, so interpolation is exact
    for b, k in ((1, 0), (8, K_MAX), (4, 1), (8, 2)):
        assert steps.step_ms(b, k, 700.0) == pytest.approx(float(TIMED.step_ms(b, k, 700.0)))
    assert steps.step_ms(4, 1, SHORT / 2) == steps.step_ms(4, 1)  # no credit below the profile's
    with pytest.raises(ValueError, match="k=4"):
        steps.step_ms(1, K_MAX + 1)


def test_a_replay_priced_by_the_timed_steps_is_not_judged_by_the_controllers_model():
    """The controller's fitted model says drafting is cheap; the timed steps say each draft
    token costs 5 ms more. Priced by its own model ours looks as fast as it believes it is;
    priced by the timed steps, its drafting steps cost what they measured."""
    dearer = replace(TIMED, draft=LinearCost(5.5, 0.1))
    profile = _timed_profile(steps=dearer, fitted=TIMED)
    steps = MeasuredSteps.from_profile(profile)
    w = Workload([40] * 4, [20] * 4, temperature=0.0)
    ours = GoodputPolicy(TIMED, FrozenAcceptance([0.8] * K_MAX), 16)
    by_model = replay(TIMED, [0.8] * K_MAX, w, ours)
    by_steps = replay(TIMED, [0.8] * K_MAX, w, ours, steps_priced_by=steps)
    assert by_steps.makespan_s > 1.2 * by_model.makespan_s
    plain = replay(TIMED, [0.8] * K_MAX, w, FixedPolicy(0), steps_priced_by=steps)
    assert plain.makespan_s == pytest.approx(
        replay(TIMED, [0.8] * K_MAX, w, FixedPolicy(0)).makespan_s
    )


def test_measured_steps_name_a_missing_timed_step():
    profile = _timed_profile()
    profile["measurements"] = [r for r in profile["measurements"] if (r["batch"], r["k"]) != (4, 2)]
    with pytest.raises(ValueError, match=r"\(B, k\) = \(4, 2\)"):
        MeasuredSteps.from_profile(profile)
    with pytest.raises(ValueError, match="no timed steps"):
        MeasuredSteps.from_profile({"latency": TIMED.to_dict(), "measurements": []})
