"""How every speed comparison is measured: on a quiet machine, each configuration warmed on
the workload before it is timed, the configurations' order shuffled in every repeat, and
each ratio reported as a median with a 95% interval, called a gain or a loss only when the
interval excludes 1.0.

Why this much: on a 2-core CPU vLLM's threads wait for each other at every barrier, so any
other process stretches a step several times over (the same B = 1 step read 44.5 and 22.1 ms
six minutes apart); and the first run of an engine pays for allocations and caches the
others do not. The job's end-of-run comparison and every benchmark use this one module.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BUSY_LIMIT = 0.10  # others may use at most this share of the machine's CPU time
DEFAULT_REPEATS = 3
ALLOW_BUSY_FLAG = "--allow-busy"


class MachineBusy(RuntimeError):
    pass


# ---- the quiet-machine guard -------------------------------------------------------------
@dataclass(frozen=True)
class CpuSnapshot:
    total: int  # jiffies of every CPU, busy or idle
    busy: int  # jiffies the CPUs spent running anything
    own: int  # jiffies of this process tree (its reaped children included)


def _proc_stat_cpu(proc: Path) -> tuple[int, int]:
    """(total, busy) jiffies over all CPUs, from the first line of /proc/stat."""
    fields = [int(x) for x in (proc / "stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
    idle = fields[3] + fields[4]
    total = sum(fields[:8])
    return total, total - idle


def _process_table(proc: Path) -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, jiffies it and its reaped children used)."""
    table = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        # The command name (field 2) may hold spaces and parentheses: split after its end.
        rest = stat[stat.rindex(")") + 2 :].split()
        ppid = int(rest[1])
        utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
        table[int(entry.name)] = (ppid, utime + stime + cutime + cstime)
    return table


def tree_jiffies(root: int, proc: Path = Path("/proc")) -> int:
    """CPU jiffies of process `root` and all its descendants (Ray's and vLLM's workers too)."""
    table = _process_table(proc)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            total += table[pid][1]
        todo += children.get(pid, [])
    return total


def snapshot(proc: Path = Path("/proc"), root: int | None = None) -> CpuSnapshot | None:
    """The machine's CPU counters now; None where there is no /proc to read."""
    if not (proc / "stat").is_file():
        return None
    total, busy = _proc_stat_cpu(proc)
    return CpuSnapshot(total, busy, tree_jiffies(os.getpid() if root is None else root, proc))


def others_share(before: CpuSnapshot | None, after: CpuSnapshot | None) -> float | None:
    """The share of the machine's CPU time (all cores) that processes outside this process
    tree used between two snapshots; None when it could not be measured."""
    if before is None or after is None or after.total <= before.total:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return min(1.0, max(0.0, others / (after.total - before.total)))


def sample_others(seconds: float = 3.0) -> float | None:
    """Others' share of the machine over the next `seconds` (this process sleeps)."""
    before = snapshot()
    time.sleep(seconds)
    return others_share(before, snapshot())


def require_quiet(allow_busy: bool = False, seconds: float = 3.0, limit: float = BUSY_LIMIT):
    """Sample the machine before anything is loaded; refuse (MachineBusy) when other
    processes use more than `limit` of it, unless `allow_busy`. Returns the share."""
    share = sample_others(seconds)
    if share is not None and share > limit and not allow_busy:
        raise MachineBusy(
            f"other processes use {share:.0%} of this machine's CPU (limit {limit:.0%}): "
            "their work would stretch every measured step. Run it alone, or pass "
            f"{ALLOW_BUSY_FLAG} to measure anyway (the results then say so)"
        )
    return share


def busy_note(share: float | None, allowed: bool) -> str:
    """The line a study prints about the machine it was measured on."""
    if share is None:
        return "Other processes' CPU share: not measured (no /proc)."
    return f"Other processes' CPU share before the run: {share:.1%}" + (
        f" (above the {BUSY_LIMIT:.0%} limit; run with {ALLOW_BUSY_FLAG})."
        if share > BUSY_LIMIT
        else "."
    )


# ---- warm, shuffled, repeated --------------------------------------------------------------
def shuffled_orders(names: list[str], repeats: int, seed: int) -> list[list[str]]:
    """One order of the configurations per repeat, each a seeded shuffle."""
    rng = random.Random(seed)
    orders = []
    for _ in range(repeats):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


@dataclass
class Timed:
    """Each configuration's results in repeat order, with the CPU share others used
    during each run, and the order the configurations ran in each repeat."""

    runs: dict[str, list] = field(default_factory=dict)
    busy: dict[str, list] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)

    def max_busy(self) -> float | None:
        shares = [s for per in self.busy.values() for s in per if s is not None]
        return max(shares) if shares else None


def run_protocol(
    configs: dict[str, Callable[[], object]],
    warm: Callable[[str], object] | None = None,
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Timed:
    """Warm every configuration (`warm(name)`, by default one untimed run of its own), then
    run each once per repeat, in a new seeded order each repeat. `configs[name]()` runs one
    timed measurement and returns its result; the others' CPU share during it is recorded
    beside it."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    # Results keep the configurations' order (reports list them so), not the first shuffle's.
    timed = Timed(
        runs={name: [] for name in configs},
        busy={name: [] for name in configs},
        orders=shuffled_orders(list(configs), repeats, seed),
    )
    for name, run in configs.items():
        warm(name) if warm is not None else run()
    for rep, order in enumerate(timed.orders):
        for name in order:
            before = snapshot()
            result = configs[name]()
            timed.runs[name].append(result)
            timed.busy[name].append(others_share(before, snapshot()))
        if progress is not None:
            progress(f"repeat {rep + 1}/{repeats} done (order: {', '.join(order)})")
    return timed


# ---- ratios with intervals ----------------------------------------------------------------
@dataclass(frozen=True)
class Ratio:
    median: float
    low: float  # the 95% interval
    high: float
    repeats: int

    @property
    def verdict(self) -> str:
        if self.low > 1.0:
            return "gain"
        if self.high < 1.0:
            return "loss"
        return "no clear difference"

    def __str__(self) -> str:
        return f"{self.median:.2f}x [{self.low:.2f}, {self.high:.2f}]"

    def to_dict(self) -> dict:
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "repeats": self.repeats,
            "verdict": self.verdict,
        }


def speedup(base_s: list[float], other_s: list[float], boot: int = 4000, seed: int = 0) -> Ratio:
    """Speedup of `other` over `base` (base time / other time, > 1: other is faster) from
    paired repeats (repeat i of both ran in the same round): the median of the per-repeat
    ratios, and a bootstrap 95% interval of that median over the repeats. Pairing cancels
    the drift of the machine between rounds.

    With n repeats the interval cannot be narrower than the spread of the n ratios'
    middle: 3 repeats give at best the range of the three, so a verdict needs them to
    agree in sign."""
    if len(base_s) != len(other_s) or not base_s:
        raise ValueError(f"paired repeats needed, got {len(base_s)} and {len(other_s)}")
    if min(base_s) <= 0 or min(other_s) <= 0:
        raise ValueError("times must be positive")
    ratios = [b / o for b, o in zip(base_s, other_s, strict=True)]
    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(boot))
    low = medians[int(0.025 * (boot - 1))]
    high = medians[int(0.975 * (boot - 1))]
    return Ratio(statistics.median(ratios), low, high, n)
