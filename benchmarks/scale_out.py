"""The GRPO job scaled out on one machine: 1 vs 2 engines and 1 vs 2 policy ranks, and the
time to sync the policy's weights into N engines; SmolLM2-135M, configs/smollm2_arith.yaml.

    python benchmarks/scale_out.py [--iterations N] [--swaps S]

Each (engines, ranks) configuration is its own job: its own Ray actors, engines,
controllers and learners, the same seed and data. Iteration times are the mean over
iterations 2..N (the first one warms caches). The sync comparison runs inside the
two-engine jobs, one after the other with the same weights in the object store: loaded
into the first engine alone, then into both side by side, S times each, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import ASSETS, ROOT, write_study
from grpo_specdec.config import load_yaml
from grpo_specdec.job.config import TrainConfig

CONFIG = ROOT / "configs" / "smollm2_arith.yaml"
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
KEYS = ("iteration_s", "generation_s", "policy_update_s", "draft_wait_s", "sync_s")


def _cpu_seconds(engines) -> list[float]:
    import ray

    return ray.get([e.__ray_call__.remote(lambda _: time.process_time()) for e in engines])


def _time_swaps(job, swaps: int) -> dict[str, dict[str, list[float]]]:
    """Wall seconds per swap, and the CPU seconds the engines' processes spent on it."""
    import ray

    weights = job.policies[0].export_weights.remote(job.weight_dtype)
    version = ray.get(job.rollouts[0].versions.remote())["policy"]
    times = {name: {"wall_s": [], "cpu_s": []} for name in ("one engine", "two engines")}
    for _ in range(swaps):
        for name, engines in (("one engine", job.rollouts[:1]), ("two engines", job.rollouts)):
            cpu = _cpu_seconds(engines)
            start = time.perf_counter()
            ray.get([e.load_weights.remote("policy", weights, version) for e in engines])
            times[name]["wall_s"].append(time.perf_counter() - start)
            times[name]["cpu_s"].append(sum(_cpu_seconds(engines)) - sum(cpu))
    return times


def run_layout(engines: int, ranks: int, iterations: int, swaps: int) -> dict:
    from grpo_specdec.job.run import Job

    out = ROOT / "runs" / "bench-scale-out" / f"e{engines}-r{ranks}"
    cfg = load_yaml(
        TrainConfig,
        CONFIG,
        [
            f"iterations={iterations}",
            f"checkpoint_every={iterations}",
            f"out={out}",
            f"ray.rollout_workers={engines}",
            f"ray.policy_workers={ranks}",
        ],
    )
    if out.exists():
        import shutil

        shutil.rmtree(out)
    job = Job(cfg)
    try:
        records = job.run()
        swap_times = _time_swaps(job, swaps) if engines > 1 else None
    finally:
        job.shutdown()
    steady = records[1:] or records
    return {
        "engines": engines,
        "ranks": ranks,
        **{key: statistics.mean(r[key] for r in steady) for key in KEYS},
        "policy_sync_s": statistics.mean(r["policy_sync_s"] for r in steady),
        "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in steady),
        "swap_times": swap_times,
    }


def report(results: list[dict], iterations: int) -> str:
    base = results[0]["iteration_s"]
    r = load_yaml(TrainConfig, CONFIG).rollout
    lines = [
        "Measured with `python benchmarks/scale_out.py`: the SmolLM2 job with 1 or 2 engines "
        "(`ray.rollout_workers`) and 1 or 2 data-parallel policy ranks (`ray.policy_workers`), "
        "each layout its own job with the same seed and data; then, inside each two-engine "
        "job, the same policy weights loaded into one engine and into both, interleaved.",
        "",
        f"SmolLM2-135M, configs/smollm2_arith.yaml ({r.prompts_per_iteration} prompts x "
        f"{r.group_size} samples, up to {r.max_tokens} tokens), {iterations} iterations per "
        f"layout, means over iterations 2..{iterations}; {os.cpu_count()} CPU cores shared by "
        "every actor.",
        "",
        "| engines | policy ranks | iteration s | vs 1+1 | generation s | policy update s "
        "| draft wait s | sync s | policy sync s | rollout tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['engines']} | {r['ranks']} | {r['iteration_s']:.1f} | "
            f"{base / r['iteration_s']:.2f}x | {r['generation_s']:.1f} | "
            f"{r['policy_update_s']:.1f} | {r['draft_wait_s']:.1f} | {r['sync_s']:.2f} | "
            f"{r['policy_sync_s']:.2f} | {r['tokens_per_s']:.0f} |"
        )
    lines += [
        "",
        "Policy weight sync (the same weights, one object in Ray's object store), medians of "
        "the interleaved swaps in each two-engine job; CPU s is what the engines' processes "
        "spent on one swap, all engines together:",
        "",
        "| job | swaps | into one engine s | CPU s | into two engines s | CPU s | two / one |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = r["swap_times"]
        if t:
            one, two = (statistics.median(t[n]["wall_s"]) for n in ("one engine", "two engines"))
            cpu1, cpu2 = (statistics.median(t[n]["cpu_s"]) for n in ("one engine", "two engines"))
            lines.append(
                f"| {r['engines']} engines + {r['ranks']} ranks | {len(t['one engine']['wall_s'])} "
                f"| {one:.3f} | {cpu1:.2f} | {two:.3f} | {cpu2:.2f} | {two / one:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--report-only", action="store_true", help="docs from the saved JSON")
    args = p.parse_args()
    saved = ASSETS / "scale_out.json"
    if args.report_only:
        results = json.loads(saved.read_text())
    else:
        results = [run_layout(e, r, args.iterations, args.swaps) for e, r in LAYOUTS]
        saved.write_text(json.dumps(results, indent=1))
    body = report(results, args.iterations)
    print(body)
    write_study(
        "scale_out",
        "Scaling out: engines and policy ranks (SmolLM2-135M, CPU)",
        body,
        "scale_out.py",
    )


if __name__ == "__main__":
    main()
