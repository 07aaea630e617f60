"""Shared by the benchmarks: their set-up (SmolLM2, its EAGLE head and its latency profile,
each rebuilt by the project's own commands when absent), their command lines, and the one
path by which every study is written: prose from benchmarks/templates/, tables in a stable
row order, the file whole (`write_study`)."""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import string
import subprocess
import sys
from collections.abc import Iterable
from datetime import date
from pathlib import Path

from grpo_specdec.assets.smollm2 import DEFAULT_DRAFT_VOCAB, default_dir, head_dir
from grpo_specdec.bench.measure import (
    ALLOW_BUSY_FLAG,
    DEFAULT_REPEATS,
    MachineBusy,
    busy_note,
    require_quiet,
)
from grpo_specdec.checkpoint_pointer import latest_checkpoint
from vllm_plugin.settings import PROFILE_FORMAT

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ASSETS = DOCS / "assets"
STUDIES = DOCS / "benchmarks"  # one file per study, each rewritten whole by its benchmark
TEMPLATES = Path(__file__).resolve().parent / "templates"  # the studies' prose
STALE_NOTES = (
    "> **Written for an earlier run.** The results above changed since these notes were "
    "written: check every figure they quote against them, then delete this line."
)


def fresh_controller(scheduler, latency, max_batch: int):
    """A maker of our controller with nothing learnt, priced on `latency` (None: no profile,
    the prices learnt from the engine's own steps), with the engine's settings: each run of
    the configuration starts from it."""
    from vllm_plugin.goodput_controller import GoodputController

    share = scheduler.controller_settings.explore_share
    return lambda: GoodputController(
        latency, scheduler.new_acceptance(), max_batch, explore_share=share
    )


def warmed(make):
    """A maker of our controller that starts each run from the state the configuration's
    first run (the protocol's warm-up) left: what the job's engine holds at the start of a
    rollout after its first, as a cold `make()` holds only at the job's first rollout."""
    import copy

    first = None

    def maker():
        nonlocal first
        if first is None:
            first = make()
            return first
        return copy.deepcopy(first)

    return maker


def parser(doc: str) -> argparse.ArgumentParser:
    """An entry point's argument parser, its module docstring as the help."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def command() -> str:
    """The command line this process was started with, as a study quotes it."""
    return shlex.join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])


def protocol_args(ap, repeats: bool = True) -> None:
    """The measurement protocol's flags (grpo_specdec/bench/measure.py), the same in every
    benchmark: --repeats (timed rounds, each in a new shuffled order), --order-seed, and
    --allow-busy (measure although other processes use the machine; the study says so)."""
    if repeats:
        rounds = "timed rounds after a warm-up per configuration, each in a new shuffled order"
        ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help=rounds)
        ap.add_argument("--order-seed", type=int, default=0, help="seeds the rounds' orders")
    busy = "measure even when other processes use more than 10%% of the machine"
    ap.add_argument(ALLOW_BUSY_FLAG, action="store_true", help=busy)


def quiet_machine(args) -> dict:
    """The quiet-machine guard, called before anything is loaded: exits with the reason
    when other processes use more than 10% of the machine (unless --allow-busy); prints
    and returns the share it measured, for the study to record beside its results."""
    try:
        share = require_quiet(args.allow_busy)
    except MachineBusy as err:
        sys.exit(f"refused to measure: {err}")
    note = busy_note(share, args.allow_busy)
    print(note, flush=True)
    return {"others_cpu_share_before": share, "allow_busy": args.allow_busy, "note": note}


def cli(*args: str) -> str:
    """Run `grpo-specdec ARGS`; return the last line it printed (the path it wrote)."""
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_specdec", *args], capture_output=True, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"grpo-specdec {' '.join(args)} failed ({proc.returncode}):\n{tail}")
    return proc.stdout.strip().splitlines()[-1]


def smollm2() -> str:
    return cli("models", "prepare", "smollm2")


def smollm2_head(target: str, draft_vocab: int | None = DEFAULT_DRAFT_VOCAB) -> str:
    """The head bootstrapped on the arithmetic task (about 15 minutes on 2 CPU cores), as
    the GRPO job's 'smollm2-arith' builds it: the reduced-vocabulary one by default, the
    full-vocabulary one with `draft_vocab=None`."""
    out = head_dir(draft_vocab)
    if not (out / "model.safetensors").is_file():
        vocab = [] if draft_vocab is None else ["--draft-vocab", str(draft_vocab)]
        cli(
            *("draft", "train", "--target", target, "--task", "arithmetic", "--out", str(out)),
            *("--steps", "300", "--num-prompts", "512", "--max-tokens", "128", *vocab),
        )
    return str(out)


def smollm2_profile(
    target: str, draft: str, k_max: int, draft_sampling: str = "greedy", fresh: bool = False
) -> Path:
    """The latency profile of SmolLM2 with this head (its draft step cost is the head's),
    drafting greedily or sampling (timed at T = 1). A profile measured up to a larger k
    serves too: the fitted model does not depend on it. `fresh`: measure it again now."""
    sampled = "" if draft_sampling == "greedy" else f"-{draft_sampling}"
    name = f"{Path(draft).name}{sampled}-f{PROFILE_FORMAT}"
    profiles = default_dir().parent / "heads"  # hardware-specific: never in the package
    measured = sorted(profiles.glob(f"profile-{name}-k*.json"))
    covering = [p for p in measured if int(p.stem.rsplit("-k", 1)[1]) >= k_max]
    if covering and not fresh:
        return covering[0]
    out = profiles / f"profile-{name}-k{k_max}.json"
    ASSETS.mkdir(parents=True, exist_ok=True)
    plot = ASSETS / f"profile_{name}.png"
    cli(
        *("profile", "--model", target, "--draft", draft, "--k-max", str(k_max)),
        *("--draft-sampling", draft_sampling, "--out", str(out), "--plot", str(plot)),
    )
    return out


@functools.cache
def _templates(name: str) -> dict[str, str]:
    parts = re.split(r"^<!-- (\w+) -->\n", (TEMPLATES / f"{name}.md").read_text(), flags=re.M)
    return dict(zip(parts[1::2], (p.strip() for p in parts[2::2]), strict=True))


def prose(name: str, block: str, **fields) -> str:
    """Block `block` of benchmarks/templates/NAME.md with its $fields filled in. The
    templates wrap their lines; a study's paragraph is one line, so a line joins the one
    before it unless either is a heading or a table row, or it starts a list item."""
    text = string.Template(_templates(name)[block]).substitute(fields)
    lines: list[str] = []
    for line in text.split("\n"):
        line = line.strip()
        joins = lines and lines[-1] and not lines[-1].startswith(("|", "#"))
        if joins and line and not line.startswith(("- ", "|", "#")):
            lines[-1] += " " + line
        else:
            lines.append(line)
    return "\n".join(lines)


def table(header: list[str], rows: Iterable[list]) -> list[str]:
    """A markdown table's lines: `header`, then each row in the order given."""

    def line(cells) -> str:
        return "| " + " | ".join(map(str, cells)) + " |"

    return [line(header), "|---" * len(header) + "|", *map(line, rows)]


def ordered(names: Iterable[str], order: Iterable[str]) -> list[str]:
    """`names` in a stable order: those in `order` as they stand there, then the rest
    sorted."""
    rank = {n: i for i, n in enumerate(order)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def interval(v: dict, verdict: bool = True) -> str:
    """A configuration's speedup (`v["speedup"]`, a Ratio's dict) with its 95% interval,
    and with `verdict` its gain or loss, called only where the interval excludes 1.0."""
    sp = v["speedup"]
    called = f", {sp['verdict']}" if verdict and sp["verdict"] in ("gain", "loss") else ""
    return f"{sp['median']:.2f}x [{sp['low']:.2f}, {sp['high']:.2f}]{called}"


def write_study(study: str, title: str, results: str, script: str, today: str = "") -> Path:
    """Write docs/benchmarks/<study>.md whole: `title`, the day measured, `results` (what this
    run of `script` found) and the notes on reading them.

    The notes are written by hand after a run, so they are carried over from the file this one
    replaces, marked as written for an earlier run when the results changed. The day is
    today's (or `today`) when the results changed, else the old file's (a report rebuilt from
    saved data was measured when the data was)."""
    path = STUDIES / f"{study}.md"
    old = path.read_text() if path.is_file() else ""
    old_results, notes = _between(old, "results"), _between(old, "reading")
    results = results.strip()
    day = re.search(r"^Measured on (\d{4}-\d{2}-\d{2})", old, re.M)
    if results != old_results or not day:
        day_measured = today or date.today().isoformat()
        if notes and not notes.startswith(STALE_NOTES):
            notes = f"{STALE_NOTES}\n\n{notes}"
    else:
        day_measured = day.group(1)
    parts = [
        f"# {title}",
        f"Measured on {day_measured}. `python benchmarks/{script}` rewrites this file whole "
        'on each run, keeping only the notes under "How to read it"; earlier runs are in git '
        "history. [All studies and the headline figures](../BENCHMARKS.md).",
        f"## Results\n\n<!-- results -->\n{results}\n<!-- /results -->",
    ]
    if notes:
        parts.append(f"<!-- reading -->\n{notes}\n<!-- /reading -->")
    STUDIES.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(parts) + "\n")
    return path


def _between(text: str, marker: str) -> str:
    """The text between `<!-- marker -->` and `<!-- /marker -->` (or the end of the file,
    where a hand edit lost the closing marker), stripped ("" if absent)."""
    match = re.search(rf"<!-- {marker} -->\n(.*?)(?:\n?<!-- /{marker} -->|\Z)", text, re.S)
    return match.group(1).strip() if match else ""


def pyplot():
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_json(path: Path) -> dict:
    return json.loads(path.read_text())


def trained_policy(iterations: int = 12, lr: float = 1e-4) -> tuple[str, str]:
    """(policy, draft head) after `iterations` of the project's own GRPO job on SmolLM2 at
    learning rate `lr`, with the head learning online; trained once, then reused."""
    out = default_dir().parent / "runs" / f"smollm2-arith-lr{lr:g}-it{iterations}"
    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is None or int(ckpt.name.rsplit("_", 1)[1]) < iterations:
        config = str(ROOT / "configs" / "smollm2_arith.yaml")
        cli(
            *("train", "--config", config, f"iterations={iterations}"),
            *(f"checkpoint_every={iterations}", f"policy.lr={lr}", f"out={out}"),
            *(["--resume", str(out)] if ckpt else []),
        )
        ckpt = latest_checkpoint(out / "checkpoints")
    return str(ckpt / "policy"), str(ckpt / "draft")
