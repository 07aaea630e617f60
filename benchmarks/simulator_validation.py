"""The rollout simulator (grpo_specdec/simulate.py) against every configuration measured by
benchmarks/rollout_throughput.py: predicted vs measured wall time, one row each.

    python benchmarks/simulator_validation.py      # rewrites docs/benchmarks/simulator.md

Runs that carry their own profiles (profile format >= 5, `profiles` in the run's JSON, e.g.
`rollout_throughput.py --fresh-profile`) are predicted from what a simulator user has: the
profile of the configuration's drafting (greedy or sampled) with the prefill and sampling
costs it timed, the acceptance per position the engine measured on that workload at fixed
k = k_max with the same drafting, and each repeat's output lengths; nothing is fitted.
Earlier runs, whose profiles (formats 3-4) lack those costs, are no longer predicted: their
last predictions are in the study at commit d5ddf00.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import ASSETS, load_json, parser, prose, table, write_study
from benchmarks.rollout_throughput import OUTSIDE_PROMPTS, SHAPES, TAIL, max_batch_of
from grpo_specdec.assets.smollm2 import default_dir
from grpo_specdec.simulate import (
    VLLM_EXAMPLE_TABLES,
    MeasuredSteps,
    UnprofiledCosts,
    Workload,
    drawn_replay,
    replay,
)
from grpo_specdec.tasks.arithmetic import make_problems
from vllm_plugin.acceptance import FrozenAcceptance
from vllm_plugin.compat import dense_k_table
from vllm_plugin.controller import (
    NO_COST,
    FixedPolicy,
    GoodputPolicy,
    LatencyModel,
    PaperPolicy,
    profile_latency,
)

GOAL, LIMIT = 0.07, 0.15  # within GOAL for >= 90% of configurations, none beyond LIMIT
DRAWS = 16  # replays per repeat of a run with its own profiles, tokens drawn (`drawn_replay`)


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_dir())


def prompt_tokens(prompts: list[str]) -> np.ndarray:
    """Token counts of user prompts through SmolLM2's chat template, as Engine.encode makes
    them."""
    tok = _tokenizer()
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    return np.array([len(tok.encode(t, add_special_tokens=False)) for t in texts], dtype=float)


def workload_of(section: str, key: str, args: dict) -> tuple[str, np.ndarray, float]:
    """(the policy that answered, per-request prompt lengths, temperature) of a workload,
    as benchmarks/rollout_throughput.py made it."""
    if section == "grpo":
        model, n_prompts, group, _ = SHAPES[key]
        prompts = [p.question for p in make_problems(n_prompts, seed=11, level=2)]
        return model, np.repeat(prompt_tokens(prompts), group), 1.0
    if section == "tail":
        return "base", prompt_tokens(TAIL.prompts), 1.0
    temp, b = key.split("/")
    questions = [p.question for p in make_problems(max_batch_of(args), seed=7, level=2)]
    prompts = (questions if section == "fixed" else OUTSIDE_PROMPTS)[: int(b)]
    return "base", prompt_tokens(prompts), float(temp)


def setup_of(config: str, model: str, data: dict, latency: LatencyModel, conditional):
    """(policy, latency the steps cost, k_max, draft pass at k = 0) of a configuration, as
    benchmarks/rollout_throughput.py built it for the policy `model`. Acceptance-driven
    policies price k on `conditional`."""
    args, k_max = data["args"], data["k_max"]
    max_batch = max_batch_of(args)
    name = config.removeprefix("sampled ")
    if name in ("no spec", "k=0 (draft loaded)", "k=0, vLLM as shipped"):
        return FixedPolicy(0), latency, k_max, name == "k=0, vLLM as shipped"
    if name.startswith("k="):
        return FixedPolicy(int(name[2:])), latency, k_max, False
    if name == "static table":
        table = dense_k_table(data["static_tables"][model], max_batch, k_max)
        return table, latency, k_max, False
    if name.startswith("vLLM example table ("):
        table = VLLM_EXAMPLE_TABLES[name[len("vLLM example table (") : -1]]
        return dense_k_table(table, max_batch, k_max), latency, k_max, False
    if name == "paper rule":
        return PaperPolicy(latency.c_peak, k_max), latency, k_max, False
    # The goodput controller: ours (sampled, + group) on the EAGLE engine, and drafts from
    # the group's text alone, whose drafts cost nothing to make (no draft model).
    alone = name in ("group", "group +history")
    k = args["group_k_max"] if alone else k_max
    cost = LatencyModel(latency.target, NO_COST, latency.speculation) if alone else latency
    return GoodputPolicy(latency, FrozenAcceptance(conditional[:k]), max_batch), cost, k, False


@dataclass
class Repeats:
    """A configuration of a run with profiles of its own: each repeat's wall time and
    workload, and the acceptance the engine measured on that workload."""

    run: str
    section: str
    key: str
    config: str
    wall_s: list[float]
    workloads: list[Workload]
    model: str
    workload_acceptance: np.ndarray  # at fixed k = k_max, the configuration's drafting
    own_acceptance: np.ndarray  # this configuration's own drafts

    @property
    def spread(self) -> float:
        """How far the repeats lie from their median, the largest of them, relative."""
        median = float(np.median(self.wall_s))
        return max(abs(w / median - 1) for w in self.wall_s)


def current_configs(run: str, data: dict) -> list[Repeats]:
    args, k_max = data["args"], data["k_max"]
    rows = []
    for section, keyed in data["results"].items():
        for key, configs in keyed.items():
            model, prompt_lengths, temperature = workload_of(section, key, args)
            for config, v in configs.items():
                source = "sampled " if config.startswith("sampled") else ""
                at_k_max = configs.get(f"{source}k={k_max}", {}).get("conditional_acceptance")
                own = v.get("conditional_acceptance", at_k_max)
                at_k_max = at_k_max or own or [0.0] * k_max  # none drafted: any will do
                lengths = v.get("lengths_runs") or [
                    [float(args["tokens"])] * len(prompt_lengths)
                ] * len(v["wall_s_runs"])
                workloads = [
                    Workload(np.array(n, dtype=float), prompt_lengths, temperature) for n in lengths
                ]
                own = np.asarray(own or at_k_max, dtype=float)
                at = np.asarray(at_k_max, dtype=float)
                rows.append(
                    Repeats(run, section, key, config, v["wall_s_runs"], workloads, model, at, own)
                )
    return rows


def predict_repeats(
    r: Repeats, data: dict, conditional: np.ndarray, draws: int = DRAWS
) -> np.ndarray:
    """Each repeat's predicted makespan, from the profile of the configuration's drafting
    and the costs that profile timed: the mean of `draws` replays with tokens drawn from
    `conditional` (0: one replay of the expected tokens). Each step is priced by the
    profile's timed steps (interpolated), not by the latency model the controller decides
    with."""
    profile = data["profiles"]["probabilistic" if r.config.startswith("sampled") else "greedy"]
    latency = profile_latency(profile)
    costs = UnprofiledCosts(**(profile.get("unprofiled") or {}))
    policy, cost, _, shipped_k0 = setup_of(r.config, r.model, data, latency, conditional)
    # group drafts cost nothing to make: the timed steps less the fitted draft pass
    steps = replace(
        MeasuredSteps.from_profile(profile),
        less_draft=latency.draft if cost.draft == NO_COST else NO_COST,
    )
    run = functools.partial(drawn_replay, draws) if draws else replay
    later = (policy, costs, shipped_k0, steps)
    return np.array([run(cost, conditional, w, *later).makespan_s for w in r.workloads])


def verdict(errors: list) -> str:
    e = np.abs([x for x in errors if x is not None])
    return (
        f"{(e <= GOAL).mean():.0%} of {len(e)} within ±{GOAL:.0%} (goal ≥ 90%), "
        f"{(e > LIMIT).sum()} beyond ±{LIMIT:.0%} (goal 0), worst {e.max():+.1%}"
    )


def current_report(runs: dict[str, dict]) -> str:
    rows = []
    still = {}  # per configuration: its repeats and its no-spec's all within GOAL
    for run, data in runs.items():
        configs = current_configs(run, data)
        predicted = {id(r): predict_repeats(r, data, r.workload_acceptance) for r in configs}
        expected = {id(r): predict_repeats(r, data, r.workload_acceptance, 0) for r in configs}
        base = {(r.section, r.key): r for r in configs if r.config == "no spec"}
        for r in configs:
            measured, at_k_max = float(np.median(r.wall_s)), float(np.median(predicted[id(r)]))
            own = float(np.median(predict_repeats(r, data, r.own_acceptance)))
            # Against no speculation in the same repeat (configurations run interleaved).
            plain = base[(r.section, r.key)]
            speedup = float(np.median(np.divide(plain.wall_s, r.wall_s)))
            modelled = float(np.median(predicted[id(plain)] / predicted[id(r)]))
            by_expectation = float(np.median(expected[id(plain)] / expected[id(r)]))
            rows.append(
                (r, measured, at_k_max / measured - 1, own / measured - 1, at_k_max)
                + (
                    (speedup, modelled, modelled / speedup - 1, by_expectation / speedup - 1)
                    if r is not plain
                    else (None,) * 4
                )
            )
            still[id(r)] = max(r.spread, plain.spread) <= GOAL
    spread = np.array([r.spread for r, *_ in rows])
    held = [row[7] for row in rows if still[id(row[0])]]
    by_run = [
        f"{run}: {verdict([row[7] for row in rows if row[0].run == run])}; the measurement "
        f"against itself {np.mean([row[0].spread <= GOAL for row in rows if row[0].run == run]):.0%}"
        for run in runs
    ]
    created = {
        f"{run} ({name})": p.get("created")
        for run, d in runs.items()
        for name, p in d["profiles"].items()
    }
    fields = {
        "runs": ", ".join(f"`{n}`" for n in runs),
        "created": "; ".join(f"{n} at {c}" for n, c in created.items()),
        "draws": DRAWS,
        "goal": f"{GOAL:.0%}",
        "workload": verdict([row[2] for row in rows]),
        "own": verdict([row[3] for row in rows]),
        "speedups": verdict([row[7] for row in rows]),
        "expected": verdict([row[8] for row in rows]),
        "itself": f"{(spread <= GOAL).mean():.0%} of {len(rows)}",
        "spread": f"{spread.max():.1%}",
        "held": verdict(held) if held else "none",
        "by_run": "; ".join(by_run),
    }

    def row(r, measured, err, own_err, predicted, speedup, modelled, speedup_err, _) -> list:
        cells = [r.run, f"{r.section} {r.key}", r.config, f"{measured:.2f}", f"±{r.spread:.1%}"]
        cells += [f"{predicted:.2f}", f"{err:+.1%}", f"{own_err:+.1%}"]
        if speedup is None:
            return cells + ["—", "—", "—"]
        return cells + [f"{speedup:.2f}x", f"{modelled:.2f}x", f"{speedup_err:+.1%}"]

    header = ["run", "workload", "config", "measured s", "repeats within", "predicted s"]
    header += ["error", "error, own acceptance", "vs no spec: measured", "predicted"]
    table_lines = table([*header, "error"], (row(*r) for r in rows))
    return "\n".join([prose("simulator", "runs", **fields), "", *table_lines])


def main() -> None:
    parser(__doc__).parse_args()
    stored = {p.stem: load_json(p) for p in sorted(ASSETS.glob("rollout_*.json"))}
    current = {run: data for run, data in stored.items() if "profiles" in data}
    text = prose("simulator", "intro") + "\n\n" + current_report(current)
    title = "Rollout simulator vs the measured runs (SmolLM2-135M, CPU)"
    write_study("simulator", title, text, "simulator_validation.py")
    print(text)


if __name__ == "__main__":
    main()
