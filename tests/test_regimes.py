"""The controller's regime suite (grpo_specdec/regimes.py, modelled): on every recorded
trace (tests/data/regimes/, recorded by `benchmarks/regime_suite.py --record` on the
project's own engine) and the synthetic non-stationary cases, on every profile we know, ours keeps up
with the best fixed k and with k = 0 and stays near an oracle; an engine started without
a profile catches up within a rollout. benchmarks/regime_suite.py prints the table."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.regime_suite import GOALS, K_MAX, TRACES, all_traces
from grpo_specdec.regimes import (
    FIRST_ROLLOUT_SLOWER,
    NOISE,
    Request,
    cases,
    known_costs,
    no_profile_ratio,
    request_runs,
    run_case,
    verdict,
)
from tests.conftest import ROOT

TRACE_LIST = all_traces()
PROFILES = known_costs(ROOT / "docs" / "assets")
CASES = cases(TRACE_LIST, PROFILES)
# Goals this controller misses today, as docs/benchmarks/regime_suite.md reports them:
# strict, so that a change that meets one has to say so here.
MISSED = {
    "untrained_t1 | Xeon (AMX)": "0.978 of k = 0, 0.947 of the oracle",
    "untrained_t1 | Xeon (AMX), costs 1.1-1.25x": "0.970 of k = 0",
    "synthetic: bulk p=0.85, tail p=0.2, x10 | Xeon (AMX)": "0.937 of the oracle",
    "synthetic: bulk p=0.85, tail p=0.2, x10 | Xeon (AMX), costs 1.1-1.25x": "0.941 of the oracle",
    "synthetic: bulk p=0.85, tail p=0.2, x10 | EPYC, no bf16 (float32, AVX2)": (
        "0.938 of the oracle, 0.975 of k = 0"
    ),
    "synthetic: bulk p=0.85, tail p=0.2, x10 | EPYC, no bf16 (float32, AVX2), costs 1.1-1.25x": (
        "0.967 of k = 0"
    ),
    "synthetic: bulk p=0.85, tail p=0.2, x10 | Xeon, no bf16 (modelled), costs 1.1-1.25x": (
        "0.971 of k = 0"
    ),
    "synthetic: bulk p=0.85, tail p=0.2, x10 | GPU, Llama-3.1-8B (modelled)": (
        "0.977 of the best fixed k"
    ),
    "untrained_t1 | Xeon (AMX), drafts 1.14x what greedy timed": "0.972 of k = 0",
    "synthetic: bulk p=0.85, tail p=0.2, x10 | Xeon (AMX), drafts 1.14x what greedy timed": (
        "0.954 of k = 0, 0.931 of the oracle"
    ),
    "end | EPYC (AVX512-BF16), drafts 1.14x what greedy timed": "0.972 of k = 0",
    "untrained_t1 | EPYC (AVX512-BF16), drafts 1.14x what greedy timed": "0.966 of k = 0",
    "synthetic: bulk p=0.85, tail p=0.2, x10 | EPYC (AVX512-BF16), drafts 1.14x what greedy timed": (
        "0.959 of k = 0, 0.957 of the oracle"
    ),
}
NO_PROFILE_MISSED: dict[str, str] = {}


def _case(trace, costs, missed: dict):
    name = f"{trace.name} | {costs.name}"
    marks = []
    if name in missed:
        marks = [pytest.mark.xfail(strict=True, reason=f"goal missed today: {missed[name]}")]
    return pytest.param(trace, costs, id=name, marks=marks)


def test_the_recorded_traces_are_there():
    names = sorted(p.name for p in TRACES.glob("*.json.gz"))
    assert names == sorted(
        ["start.json.gz", "middle.json.gz", "end.json.gz", "end_f32.json.gz",
         "untrained_t1.json.gz", "past_eos.json.gz"]
    )  # fmt: skip


@pytest.mark.parametrize("trace, costs", [_case(t, c, MISSED) for t, c in CASES])
def test_ours_keeps_up_in_every_regime(trace, costs):
    ratios = verdict(run_case(trace, costs, K_MAX))
    missed = {g: round(ratios[g], 3) for g, bound in GOALS.items() if ratios[g] < bound}
    assert not missed, f"{trace.name} on {costs.name}: {missed} (goals {GOALS})"


def _start(trace, costs, first_slower: float):
    name = f"{trace.name} | {costs.name}"
    if first_slower != 1.0:
        name += f", first rollout {first_slower:g}x slower"
    marks = []
    if name in NO_PROFILE_MISSED:
        reason = f"goal missed today: {NO_PROFILE_MISSED[name]}"
        marks = [pytest.mark.xfail(strict=True, reason=reason)]
    return pytest.param(trace, costs, first_slower, id=name, marks=marks)


STARTS = [
    _start(t, c, first_slower)
    for t in TRACE_LIST
    for c in PROFILES
    for first_slower in (1.0, FIRST_ROLLOUT_SLOWER)
]


@pytest.mark.parametrize("trace, costs, first_slower", STARTS)
def test_an_engine_without_a_profile_catches_up_within_a_rollout(trace, costs, first_slower):
    """Also where the first rollout, in which it learns its prices, runs every step slower
    than the later ones (as an engine's first rollout does on the EPYC)."""
    assert no_profile_ratio(trace, costs, K_MAX, first_slower) >= 0.95


def test_a_draft_covers_the_positions_it_made_and_a_whole_chain_goes_on():
    # Position 1: 2 of 4 accepted (covers 1..3); position 4: 4 of 4 (covers 4..8 and goes
    # on with the draft after it); position 9: 0 accepted.
    runs = request_runs(Request(10, 10, None, [(1, 4, 2), (4, 4, 4), (9, 4, 0)]))
    assert runs.tolist() == [2, 2, 1, 0, 4, 3, 2, 1, 0, 0]
    # position 0 (the prefill's token) takes the next draft's value


def test_step_times_stray_in_slow_spells_as_measured():
    """The noise handed to the controller is what the float32 host measured: within a
    rollout sd ~0.105, lag-1 autocorrelation ~0.69 and still ~0.25 ten steps on, and each
    rollout offset as a whole."""
    rng = np.random.default_rng(0)
    rollouts = []
    for _ in range(200):
        draws = NOISE.draws(rng)
        rollouts.append(np.array([next(draws) for _ in range(300)]))
    offsets = np.array([x.mean() for x in rollouts])
    within = [x - x.mean() for x in rollouts]

    def lag(n):
        return np.mean([np.corrcoef(x[:-n], x[n:])[0, 1] for x in within])

    assert 0.09 < np.mean([x.std() for x in within]) < 0.12
    assert 0.6 < lag(1) < 0.75
    assert 0.15 < lag(10) < 0.35
    assert lag(50) < 0.1
    assert 0.05 < offsets.std() < 0.1
