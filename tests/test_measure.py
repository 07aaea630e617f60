"""The measurement protocol (grpo_specdec/bench/measure.py): the quiet-machine guard, warm-up,
shuffled order, paired ratios with intervals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from grpo_specdec.bench import measure
from grpo_specdec.bench.measure import (
    CpuSnapshot,
    MachineBusy,
    others_share,
    require_quiet,
    run_protocol,
    shuffled_orders,
    speedup,
    tree_jiffies,
)


def _fake_proc(tmp_path, processes: dict[int, tuple[int, str, int]]):
    """A /proc with these processes: pid -> (parent, command name, jiffies as utime)."""
    (tmp_path / "stat").write_text("cpu  100 0 50 800 10 0 0 0 0 0\ncpu0 1 2 3 4\n")
    for pid, (ppid, comm, jiffies) in processes.items():
        (tmp_path / str(pid)).mkdir()
        # fields after the name: state ppid pgrp session tty tpgid flags minflt cminflt
        # majflt cmajflt utime stime cutime cstime ...
        rest = ["S", str(ppid)] + ["0"] * 9 + [str(jiffies), "1", "2", "3"] + ["0"] * 30
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(rest))
    (tmp_path / "self").mkdir()  # not a process: skipped
    return tmp_path


def test_tree_jiffies_sums_a_process_and_its_descendants_only(tmp_path):
    proc = _fake_proc(
        tmp_path,
        {
            10: (1, "python", 100),
            11: (10, "ray::Rollout (x) y", 40),  # a name with spaces and parentheses
            12: (11, "vllm core", 7),
            20: (1, "other", 1000),
            21: (20, "other child", 500),
        },
    )
    # each process: utime + stime 1 + its reaped children's 2 + 3
    assert tree_jiffies(10, proc) == (100 + 6) + (40 + 6) + (7 + 6)
    assert tree_jiffies(11, proc) == (40 + 6) + (7 + 6)
    assert tree_jiffies(99, proc) == 0


def test_others_share_is_busy_time_outside_the_tree_over_all_cpu_time():
    before = CpuSnapshot(total=1000, busy=100, own=50)
    after = CpuSnapshot(total=2000, busy=700, own=350)  # 600 busy, 300 of them ours
    assert others_share(before, after) == pytest.approx(0.3)
    # Our tree's time counted twice (a child reaped between snapshots) never goes negative.
    assert others_share(before, CpuSnapshot(2000, 150, 400)) == 0.0
    assert others_share(None, after) is None and others_share(before, before) is None


def test_shuffled_orders_are_seeded_permutations_that_differ_between_repeats():
    names = ["no spec", "ours", "k=1", "k=2", "k=3"]
    orders = shuffled_orders(names, 6, seed=3)
    assert orders == shuffled_orders(names, 6, seed=3)
    assert orders != shuffled_orders(names, 6, seed=4)
    assert all(sorted(o) == sorted(names) for o in orders)
    assert len({tuple(o) for o in orders}) > 1
    assert len({o[0] for o in orders}) > 1  # not always the same configuration first


def test_run_protocol_warms_every_configuration_before_timing_then_follows_the_orders():
    calls = []

    def run(name: str) -> int:
        calls.append(("run", name))
        time.sleep(0.05)  # long enough for the CPU counters to move
        return len(calls)

    configs = {n: (lambda n=n: run(n)) for n in "abc"}
    timed = run_protocol(configs, lambda n: calls.append(("warm", n)), repeats=4, seed=1)
    assert calls[:3] == [("warm", n) for n in "abc"]
    assert [n for _, n in calls[3:]] == [n for order in timed.orders for n in order]
    assert all(what == "run" for what, _ in calls[3:])
    assert {n: len(v) for n, v in timed.runs.items()} == {"a": 4, "b": 4, "c": 4}
    assert timed.orders[0] != list("abc")  # seed 1 shuffles the first round
    # results in the configurations' order, as the tables list them
    assert list(timed.runs) == list(timed.busy) == list("abc")
    # each result kept in repeat order, with the others' share measured beside it
    for n, results in timed.runs.items():
        assert results == sorted(results)
        assert len(timed.busy[n]) == 4 and all(0 <= s <= 1 for s in timed.busy[n])
    with pytest.raises(ValueError, match="repeats"):
        run_protocol(configs, None, repeats=0)


def test_speedup_is_the_median_paired_ratio_with_an_interval_that_decides_the_verdict():
    base = [10.0, 11.0, 9.0, 10.5, 10.0]
    faster = [b / 1.25 for b in base]  # 1.25x in every round, however the machine drifted
    ratio = speedup(base, faster)
    assert ratio.median == pytest.approx(1.25)
    assert ratio.low == pytest.approx(1.25) and ratio.high == pytest.approx(1.25)
    assert ratio.verdict == "gain" and ratio.repeats == 5
    slower = speedup(base, [b * 1.1 for b in base])
    assert slower.verdict == "loss" and slower.median == pytest.approx(1 / 1.1)
    # Rounds that disagree: the interval spans 1.0, no verdict either way.
    mixed = speedup([10.0, 10.0, 10.0, 10.0], [9.0, 11.0, 9.5, 10.6])
    assert mixed.low < 1.0 < mixed.high and mixed.verdict == "no clear difference"
    assert str(mixed).startswith(f"{mixed.median:.2f}x [")
    # Unpaired drift would fool a ratio of medians; the paired ratio sees 1.0 each round.
    drift = speedup([5.0, 10.0, 20.0], [5.0, 10.0, 20.0])
    assert (drift.median, drift.low, drift.high) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="paired"):
        speedup([1.0, 2.0], [1.0])


@pytest.fixture
def spinner():
    """A process outside this process tree keeping one core busy (its parent shell exits at
    once, so it is re-parented away from us), as another user's job would."""
    code = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"
    out = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{code}" >/dev/null 2>&1 & echo $!'],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(out.stdout.strip())
    time.sleep(0.5)
    yield pid
    os.kill(pid, signal.SIGKILL)


def test_the_guard_refuses_while_another_process_spins_a_core(spinner):
    assert spinner not in _descendants(os.getpid())
    with pytest.raises(MachineBusy, match="--allow-busy") as err:
        require_quiet(seconds=1.5)
    assert "of this machine's CPU (limit 10%)" in str(err.value)
    # With the override it measures anyway and reports the share it saw.
    share = require_quiet(allow_busy=True, seconds=1.5)
    assert share > measure.BUSY_LIMIT
    assert "above the 10% limit" in measure.busy_note(share, True)


def test_the_guard_does_not_count_this_process_tree_s_own_work():
    # A child of ours spinning a core is part of the measurement, not another user.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.3)
        before = measure.snapshot()
        child_before = measure.tree_jiffies(child.pid)  # read inside the interval:
        time.sleep(1.5)
        child_after = measure.tree_jiffies(child.pid)  # its delta is within the tree's
        after = measure.snapshot()
    finally:
        child.kill()
        child.wait()
    total = after.total - before.total
    spun = child_after - child_before
    assert spun / total > 0.6 / os.cpu_count()  # ~one core
    # Whatever else the machine runs (`make test` runs a second worker beside this one),
    # the child's time is ours, never others'.
    assert after.own - before.own >= spun
    busy = (after.busy - before.busy) / total
    assert others_share(before, after) <= busy - spun / total + 1e-9


def _descendants(root: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True)
    children: dict[int, list[int]] = {}
    for line in out.stdout.splitlines():
        pid, ppid = (int(x) for x in line.split())
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found
