"""The report of `benchmarks/rollout_throughput.py`: each configuration's rounds summarised
(the one summariser of timed rounds, learning_run.py's too), speedups over no speculation
with their intervals, the study's tables and plots."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.common import ASSETS, interval, ordered, prose, pyplot, table
from grpo_specdec.bench.measure import speedup
from grpo_specdec.bench.tail_shape import in_flight, tail_phase_s
from grpo_specdec.simulate import VLLM_EXAMPLE_TABLES
from vllm_plugin.acceptance import conditional_from_cumulative

TAIL_FRACTION = 0.1  # the tail phase: after all but this share of the requests finished
FEW_IN_FLIGHT = 8  # "few sequences in flight": B at or below this
VLLM_EXAMPLE_TABLES_NAMES = [f"vLLM example table ({n})" for n in VLLM_EXAMPLE_TABLES]
# The configurations in the order the study's tables list them (a run saves them in its own).
FIXED_KS = [f"k={k}" for k in range(1, 9)]
CONFIGS = [
    "no spec",
    "k=0 (draft loaded)",
    "k=0, vLLM as shipped",
    *FIXED_KS,
    "static table",
    *VLLM_EXAMPLE_TABLES_NAMES,
    "paper rule",
    "ours",
    "ours, warmed",
    "ours, no profile, warmed",
    "group",
    "group +history",
    "ours + group",
    "ours + group +history",
    *(f"sampled {k}" for k in FIXED_KS),
    "sampled ours",
    "sampled ours + group",
]


def mean_conditional(per_position: list[list[float]]) -> list[float]:
    """The conditional acceptance per position, averaged over runs, from each run's
    per-position acceptance; a run whose drafts never reached a position (a policy that
    chose a smaller k that time) leaves it to the runs that did."""
    conditional = [conditional_from_cumulative(c) for c in per_position]
    return [
        statistics.fmean(c[i] for c in conditional if i < len(c))
        for i in range(max(len(c) for c in conditional))
    ]


def few_in_flight_share(trace: list) -> float:
    """Share of the rollout's wall time spent in steps with at most FEW_IN_FLIGHT running."""
    if len(trace) < 2:
        return 0.0
    t = np.array([x[0] for x in trace])
    b = np.array([x[1] for x in trace])
    dt = np.diff(t)
    return float(dt[b[:-1] <= FEW_IN_FLIGHT].sum() / dt.sum())


def summarise(timed, section: str, base: str = "no spec") -> dict[str, dict]:
    """The one summary of timed rounds (a `run_protocol` result of `run_config` runs, here
    and in learning_run.py): per configuration the medians, per round what the simulator's
    validation replays (wall time, output lengths where they vary, the conditional
    acceptance per position), the steps per k, and the speedup over `base`."""
    from grpo_specdec.job.rollout_worker import k_by_batch

    per = {}
    for name, runs in timed.runs.items():
        traces = [r.get("trace", ()) for r in runs]
        out = per[name] = {
            "tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "mal": statistics.median(r["mean_acceptance_length"] for r in runs),
            "tokens": runs[-1]["tokens"],
            "tokens_runs": [r["tokens"] for r in runs],
            "wall_s_runs": [r["wall_s"] for r in runs],
            "s_per_token_runs": [r["wall_s"] / r["tokens"] for r in runs],
            "makespan_s_runs": [max(r["finished_s"]) for r in runs],
            "others_cpu_share": timed.busy[name],
            "tokens_after_eos": statistics.median(r["tokens_after_eos"] for r in runs),
            "makespan_s": statistics.median(max(r["finished_s"]) for r in runs),
            "tail_s": statistics.median(tail_phase_s(r["finished_s"], TAIL_FRACTION) for r in runs),
            "k_steps": [dict(Counter(k for _, _, k in trace)) for trace in traces],
            "k_by_batch": k_by_batch([(t, b, k, None) for trace in traces for t, b, k in trace]),
        }
        if all("mal_before_eos" in r for r in runs):
            out["mal_before_eos"] = statistics.median(r["mal_before_eos"] for r in runs)
        if any(len({n for group in r["lengths"] for n in group}) > 1 for r in runs):
            out["lengths_runs"] = [[n for group in r["lengths"] for n in group] for r in runs]
        drafted = [r["per_position_acceptance"] for r in runs if r["per_position_acceptance"]]
        if drafted and runs[-1]["mean_acceptance_length"] > 1.0:
            out["conditional_acceptance"] = mean_conditional(drafted)
        for source in runs[-1].get("group", ()):
            for what in ("draft_tokens", "accepted_tokens"):
                out[f"{source}_{what}"] = statistics.median(r["group"][source][what] for r in runs)
        if "trace" in runs[-1]:
            out["few_in_flight_share"] = statistics.median(map(few_in_flight_share, traces))
    return with_speedups(section, per, base)


def with_speedups(section: str, per: dict[str, dict], base: str = "no spec") -> dict[str, dict]:
    """Each configuration's speedup over `base`, paired by round, with its 95% interval: in
    makespan on the tail shape, in time per generated token elsewhere."""
    runs = "makespan_s_runs" if section == "tail" else "s_per_token_runs"
    for v in per.values():
        v["speedup"] = speedup(per[base][runs], v[runs]).to_dict()
    return per


def _label(key: str) -> str:
    """A fixed-concurrency workload's sampling, from its key "T/B"."""
    temp = key.split("/")[0]
    return "greedy" if float(temp) == 0 else f"T={temp}"


def _keys(keyed: dict, temp: str | None = None) -> list[str]:
    """A section's workload keys ("T/B") by temperature, then B; at `temp` alone if given."""
    keys = [k for k in keyed if temp is None or k.split("/")[0] == temp]
    return sorted(keys, key=lambda k: (float(k.split("/")[0]), int(k.split("/")[1])))


def _ratio_table(per_key: dict, keys: list[str], header: list[str]) -> list[str]:
    """Tokens/s and the speedup over no speculation of each configuration at each key."""
    rows = (
        [n, *(f"{per_key[k][n]['tokens_per_s']:.0f} ({interval(per_key[k][n])})" for k in keys)]
        for n in ordered(per_key[keys[0]], CONFIGS)
    )
    return table(["config", *header], rows)


def _fixed_summary(fixed: dict, keys: list[str]) -> str:
    """Ours against the best fixed k, and k = 0 with the draft loaded against no
    speculation, at each B: the parts of it that this run measured."""
    names = set(fixed[keys[0]])
    fixed_k = sorted(n for n in names if n.startswith("k=") and n[2] != "0")
    at = {k: f"B={k.split('/')[1]}: " for k in keys}
    parts = []
    if "ours" in names and fixed_k:
        best = {k: max(fixed[k][n]["tokens_per_s"] for n in fixed_k) for k in keys}
        ratios = (f"{at[k]}{fixed[k]['ours']['tokens_per_s'] / best[k]:.2f}x" for k in keys)
        parts.append(f"Ours vs the best fixed k: {', '.join(ratios)}.")
    k0 = [n for n in ("k=0 (draft loaded)", "k=0, vLLM as shipped") if n in names]
    if k0:
        speedups = (at[k] + " / ".join(interval(fixed[k][n]) for n in k0) for k in keys)
        parts.append(f"{' / '.join(k0)} vs no speculation: {', '.join(speedups)}.")
    return " ".join(parts)


def report(r: dict) -> str:
    a, res = r["args"], r["results"]
    shares = [
        s
        for keyed in res.values()
        for per in keyed.values()
        for v in per.values()
        for s in v.get("others_cpu_share", [])
        if s is not None
    ]
    protocol = prose(
        "rollout_throughput",
        "protocol",
        command=r.get("command", "python benchmarks/rollout_throughput.py"),
        hardware=r["hardware"],
        k_max=r["k_max"],
        head=f"head `{Path(a['head']).name}`"
        if a.get("head")
        else "default head (reduced vocabulary)",
        c_peak=f"{r['c_peak']:.0f}",
        repeats=a["repeats"],
        note=r.get("machine", {}).get("note", "Others' CPU share: not measured."),
        busiest=f"{max(shares):.1%} of the machine" if shares else "an unmeasured share",
    )
    lines = [protocol, *(["", a["note"]] if a.get("note") else [])]
    fixed = res.get("fixed", {})
    for temp in sorted({k.split("/")[0] for k in fixed}, key=float):
        keys = _keys(fixed, temp)
        lines += [
            "",
            f"### Fixed concurrency, {_label(temp)}: {a['tokens']} tokens per request, arithmetic questions",
            "",
            *_ratio_table(fixed, keys, [f"B={k.split('/')[1]}" for k in keys]),
            "",
            _fixed_summary(fixed, keys),
        ]
    if outside := res.get("outside", {}):
        keys = _keys(outside)
        header = [f"{_label(k)}, B={k.split('/')[1]}" for k in keys]
        lines += [
            "",
            f"### Prompts outside the head's task (general instructions), {a['tokens']} tokens per request",
            "",
            *_ratio_table(outside, keys, header),
        ]
    grpo = res.get("grpo", {})
    for shape in ordered(grpo, r["shapes"]):
        per, (policy, n_prompts, group, cap) = grpo[shape], r["shapes"][shape]
        what = (
            f"the policy after {a['trained_iterations']} iterations of `grpo-specdec train` "
            f"at lr {a['trained_lr']:g}, with its online head"
            if policy == "trained"
            else "SmolLM2 as shipped, the bootstrapped head"
        )
        few = per["ours"].get("few_in_flight_share", 0.0)
        lines += [
            "",
            f"### GRPO shape `{shape}`: {n_prompts} prompts x {group} samples, T=1, max {cap} tokens; {what}",
            "",
            f"Share of wall time with at most {FEW_IN_FLIGHT} sequences in flight (ours): {few:.0%}.",
            "",
            *table(
                ["config", "tokens/s", "vs no spec", "wall s", "mean acceptance length"]
                + ["group tokens drafted / accepted", "model tokens drafted / accepted"],
                (
                    [n, f"{v['tokens_per_s']:.0f}", interval(v), f"{v['wall_s']:.1f}"]
                    + [f"{v['mal']:.2f}", _by_source(v)]
                    for n, v in ((n, per[n]) for n in ordered(per, CONFIGS))
                ),
            ),
        ]
    tail = res.get("tail", {}).get("tail")
    if tail:
        lines += ["", *_tail_report(tail, r)]
    tag = a["study"]
    lines += [
        "",
        "Static tables used: "
        + "; ".join(f"{p}: `{t}`" for p, t in r["static_tables"].items())
        + " (from the profile and acceptance measured once at k_max on that policy's GRPO rollout).",
        "",
        *([f"![throughput vs B](../assets/{tag}_vs_b.png)"] * bool(fixed)),
        *(
            ["", f"![concurrency and k over each GRPO rollout](../assets/{tag}_k_trace.png)"]
            * bool(r["traces"])
        ),
        *(["", f"![the tail shape's B over time](../assets/{tag}_tail_b.png)"] * bool(tail)),
    ]
    return "\n".join(lines)


def _by_source(v: dict) -> str:
    """The 'group / model tokens drafted / accepted' cells of a row (empty without them)."""
    return " | ".join(
        f"{v[f'{s}_draft_tokens']:.0f} / {v[f'{s}_accepted_tokens']:.0f}"
        if f"{s}_draft_tokens" in v
        else ""
        for s in ("group", "model")
    )


def _tail_report(per: dict, r: dict) -> list[str]:
    base, tail = per["no spec"], r["tail_shape"]
    fixed = [n for n in per if n.startswith(("k=", "sampled k=")) and not n.startswith("k=0")]
    best_fixed = min(fixed, key=lambda n: per[n]["makespan_s"], default=None)
    endings = r.get("tail_reference_endings", {})
    fields = {"eos": endings.get("eos", 0), "requests": sum(endings.values()), **tail}
    fields["finished"] = f"{1 - TAIL_FRACTION:.0%}"
    header = ["config", "makespan s", "speedup", "tail phase s", "tail speedup", "tokens/s"]
    header += ["mean acceptance length", "MAL before EOS", "after EOS"]
    header += ["group tokens drafted / accepted", "model tokens drafted / accepted"]

    def row(n: str, v: dict) -> list:
        after_eos, before_eos = v.get("tokens_after_eos"), v.get("mal_before_eos")
        cells = [n, f"{v['makespan_s']:.1f}", interval(v), f"{v['tail_s']:.1f}"]
        cells += [f"{base['tail_s'] / v['tail_s']:.2f}x", f"{v['tokens_per_s']:.0f}"]
        cells += [f"{v['mal']:.2f}", "-" if before_eos is None else f"{before_eos:.2f}"]
        return [*cells, "-" if after_eos is None else f"{after_eos:.0f}", _by_source(v)]

    lines = [
        prose("rollout_throughput", "tail", **fields),
        "",
        *table(header, (row(n, per[n]) for n in ordered(per, CONFIGS))),
    ]
    rivals = [best_fixed, "static table", "paper rule", *VLLM_EXAMPLE_TABLES_NAMES]
    rivals = [n for n in rivals if n in per]
    best = f" (best fixed k: {best_fixed})" if best_fixed else ""
    for ours in ("ours", "sampled ours", "ours + group", "sampled ours + group"):
        if ours in per and rivals:  # none was run (a study of ours alone): nothing to say
            ratios = ", ".join(
                f"{n}: {per[n]['makespan_s'] / per[ours]['makespan_s']:.2f}x" for n in rivals
            )
            lines += ["", f"{ours} vs {ratios} in makespan{best}."]
    return lines


def plot(r: dict) -> None:
    plt = pyplot()

    tag = r["args"]["study"]
    fixed = r["results"].get("fixed", {})
    temps = sorted({k.split("/")[0] for k in fixed}, key=float)
    if temps:
        fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4.5), squeeze=False)
        for ax, temp in zip(axes[0], temps, strict=True):
            keys = _keys(fixed, temp)
            bs = [int(k.split("/")[1]) for k in keys]
            for n in fixed[keys[0]]:
                style = "-o" if n in ("ours", "no spec", "paper rule", "static table") else ":."
                tokens_per_s = [fixed[k][n]["tokens_per_s"] for k in keys]
                ax.plot(bs, tokens_per_s, style, label=n, lw=2 if n == "ours" else 1)
            title = f"Fixed concurrency, {_label(temp)}"
            ax.set(xscale="log", xlabel="concurrency B", ylabel="generated tokens/s", title=title)
            ax.set_xticks(bs, [str(b) for b in bs])
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(ASSETS / f"{tag}_vs_b.png", dpi=120)
        plt.close(fig)

    timelines = r.get("tail_timelines", {})
    if timelines:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for n in ("no spec", "ours", "sampled ours", "sampled ours + group", "static table"):
            if n in timelines:
                times, counts = in_flight(*map(list, zip(*timelines[n], strict=True)))
                ax.step(times, counts, where="post", label=n)
        ax.set(
            xlabel="seconds since the first request was scheduled",
            ylabel="sequences in flight B",
            title="Tail shape: B over time",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(ASSETS / f"{tag}_tail_b.png", dpi=120)
        plt.close(fig)

    traces = {s: t for s, t in r["traces"].items() if t}
    if not traces:
        return
    fig, axes = plt.subplots(len(traces), 1, figsize=(8, 2.4 * len(traces)), squeeze=False)
    for ax, (shape, trace) in zip(axes[:, 0], traces.items(), strict=True):
        t0 = trace[0][0]
        t = [x[0] - t0 for x in trace]
        ax.plot(t, [x[1] for x in trace], color="C1", label="sequences in flight B")
        ax.axhline(FEW_IN_FLIGHT, color="C1", ls=":", lw=1)
        ax.set_ylabel(f"{shape}\nB")
        ax2 = ax.twinx()
        ax2.step(t, [x[2] for x in trace], where="post", color="C0", label="k chosen")
        ax2.set_ylabel("k")
    axes[-1, 0].set_xlabel("seconds into the GRPO-shaped rollout (ours)")
    fig.suptitle("Concurrency B (orange) and k chosen (blue) over each rollout")
    fig.tight_layout()
    fig.savefig(ASSETS / f"{tag}_k_trace.png", dpi=120)
