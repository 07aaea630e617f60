"""The GRPO job scaled out on one machine: 1 vs 2 engines, 1 vs 2 policy ranks (whole on
each rank, or sharded by FSDP2), the learner's memory per rank, and the time to sync the
policy's weights into N engines; SmolLM2-135M, configs/smollm2_arith.yaml.

    python benchmarks/scale_out.py [--iterations N] [--swaps S] [--steps K] [--sequences Q]
        [--only jobs|learner]

Each (engines, ranks, sharding) configuration is its own job: its own Ray actors, engines,
controllers and learners, the same seed and data. Iteration times are the mean over
iterations 2..N (the first one warms caches). The sync comparison runs inside the
two-engine jobs, one after the other with the same weights in the object store: loaded
into the first engine alone, then into both side by side, S times each, interleaved.

The learner alone (1 rank, 2 ranks whole, 2 ranks FSDP) runs in plain processes, as
tests/test_sharding.py runs it, on Q sequences (default: the config's prompts x samples) of
a prompt and max_tokens response tokens: K steps, each rank on its share of the cores; then
each rank reports the bytes it holds of the parameters, gradients and AdamW state (its
shards under FSDP) and its process's peak RSS, and the policy's part of a checkpoint is
written, timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import ASSETS, ROOT, protocol_args, quiet_machine, write_study
from grpo_specdec.config import load_yaml
from grpo_specdec.job.config import TrainConfig

CONFIG = ROOT / "configs" / "smollm2_arith.yaml"
LAYOUTS = [(1, 1, "none"), (2, 1, "none"), (1, 2, "none"), (2, 2, "fsdp")]
LAYOUTS_LEARNER = [(1, "none"), (2, "none"), (2, "fsdp")]
PROMPT_TOKENS = 48
MIB = 2**20
KEYS = ("iteration_s", "generation_s", "policy_update_s", "draft_wait_s", "sync_s")


def _cpu_seconds(engines) -> list[float]:
    import ray

    return ray.get([e.__ray_call__.remote(lambda _: time.process_time()) for e in engines])


def _time_swaps(job, swaps: int) -> dict[str, dict[str, list[float]]]:
    """Wall seconds per swap, and the CPU seconds the engines' processes spent on it."""
    import ray

    weights = job.roles.policy_weights()
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


def run_layout(engines: int, ranks: int, sharding: str, iterations: int, swaps: int) -> dict:
    from grpo_specdec.job.run import Job

    out = ROOT / "runs" / "bench-scale-out" / f"e{engines}-r{ranks}-{sharding}"
    cfg = load_yaml(
        TrainConfig,
        CONFIG,
        [
            f"iterations={iterations}",
            f"checkpoint_every={iterations}",
            f"out={out}",
            f"ray.rollout_workers={engines}",
            f"ray.policy_workers={ranks}",
            f"policy.sharding={sharding}",
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
        "sharding": sharding,
        **{key: statistics.mean(r[key] for r in steady) for key in KEYS},
        "policy_sync_s": statistics.mean(r["policy_sync_s"] for r in steady),
        "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in steady),
        "swap_times": swap_times,
    }


def _synthetic_batch(rollout, n: int, vocab: int):
    """n sequences of the config's lengths, every one informative."""
    from grpo_specdec.job.learners import PolicyBatch

    g = torch.Generator().manual_seed(0)
    length = PROMPT_TOKENS + rollout.max_tokens
    return PolicyBatch(
        torch.randint(0, vocab, (n, length), generator=g).tolist(),
        [PROMPT_TOKENS] * n,
        torch.randn(n, generator=g).tolist(),
        [True] * n,
    )


def _learner_rank(
    rank: int, address: str, world: int, sharding: str, steps: int, sequences: int, out: str
):
    from grpo_specdec.job.learners import PolicyLearner
    from grpo_specdec.job.models import resolve_model

    torch.set_num_threads(max(1, os.cpu_count() // world))  # the ranks share the cores
    cfg = load_yaml(
        TrainConfig, CONFIG, [f"ray.policy_workers={world}", f"policy.sharding={sharding}"]
    )
    learner = PolicyLearner(resolve_model(cfg.model.policy), cfg.policy, seed=cfg.seed)
    if world > 1:
        learner.join(address, rank, world)
    batch = _synthetic_batch(cfg.rollout, sequences, learner.model.config.vocab_size)
    step_s = []
    for _ in range(steps):
        start = time.perf_counter()
        learner.prepare(batch)
        learner.update()
        step_s.append(time.perf_counter() - start)
    start = time.perf_counter()
    learner.save(Path(out) / "checkpoint")
    checkpoint_s = time.perf_counter() - start
    result = {"step_s": step_s, "checkpoint_s": checkpoint_s, "memory": learner.memory()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    learner.shutdown()


def run_learner(world: int, sharding: str, steps: int, sequences: int) -> dict:
    import torch.multiprocessing as mp

    from grpo_specdec.job.sharding import rendezvous_address

    out = ROOT / "runs" / "bench-scale-out" / f"learner-r{world}-{sharding}"
    out.mkdir(parents=True, exist_ok=True)
    args = (rendezvous_address("127.0.0.1"), world, sharding, steps, sequences, str(out))
    mp.spawn(_learner_rank, args=args, nprocs=world, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return {"ranks": world, "sharding": sharding, "per_rank": ranks}


def _state_mib(memory: dict) -> float:
    return (memory["params"] + memory["grads"] + memory["optimizer"]) / MIB


def learner_report(results: list[dict], steps: int, sequences: int) -> list[str]:
    """Per rank, the rank holding most: what it holds, vs one rank's; step times."""
    r = load_yaml(TrainConfig, CONFIG).rollout
    one = _state_mib(results[0]["per_rank"][0]["memory"])
    lines = [
        f"The policy learner alone, in plain processes (no Ray, no engines): {steps} step(s) "
        f"(the forward for the rollout's log-probs, then the update) on "
        f"{sequences} sequences of {PROMPT_TOKENS} prompt and "
        f"{r.max_tokens} response tokens, the {os.cpu_count()} cores split between the ranks; "
        "then "
        "what each rank holds (bytes of its shards under FSDP), its process's peak RSS (model "
        "load, activations and all), and the policy's part of one checkpoint (gathered whole "
        "to rank 0 and written):",
        "",
        "| policy ranks | sharding | params MiB | grads MiB | AdamW MiB "
        "| params+grads+AdamW MiB | vs 1 rank | peak RSS MiB | step s (each) "
        "| checkpoint s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        largest = max((rank["memory"] for rank in res["per_rank"]), key=_state_mib)
        rank0 = res["per_rank"][0]
        lines.append(
            f"| {res['ranks']} | {res['sharding']} "
            f"| {largest['params'] / MIB:.0f} | {largest['grads'] / MIB:.0f} "
            f"| {largest['optimizer'] / MIB:.0f} | {_state_mib(largest):.0f} "
            f"| {_state_mib(largest) / one:.2f}x "
            f"| {max(rank['memory']['peak_rss'] for rank in res['per_rank']) / MIB:.0f} "
            f"| {', '.join(f'{t:.1f}' for t in rank0['step_s'])} "
            f"| {rank0['checkpoint_s']:.1f} |"
        )
    return lines


def report(results: list[dict], iterations: int) -> str:
    base = results[0]["iteration_s"]
    r = load_yaml(TrainConfig, CONFIG).rollout
    lines = [
        "Measured with `python benchmarks/scale_out.py`: the SmolLM2 job with 1 or 2 engines "
        "(`ray.rollout_workers`) and 1 or 2 policy ranks (`ray.policy_workers`), whole on "
        "every rank or sharded by FSDP2 (`policy.sharding`), each layout its own job with the "
        "same seed and data; then, inside each two-engine job, the same policy weights loaded "
        "into one engine and into both, interleaved.",
        "",
        f"SmolLM2-135M, configs/smollm2_arith.yaml ({r.prompts_per_iteration} prompts x "
        f"{r.group_size} samples, up to {r.max_tokens} tokens), {iterations} iterations per "
        f"layout, means over iterations 2..{iterations}; {os.cpu_count()} CPU cores shared by "
        "every actor.",
        "",
        "| engines | policy ranks | sharding | iteration s | vs 1+1 | generation s "
        "| policy update s | draft wait s | sync s | policy sync s | rollout tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['engines']} | {r['ranks']} | {r['sharding']} | {r['iteration_s']:.1f} | "
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
                f"| {r['engines']} engines + {r['ranks']} ranks ({r['sharding']}) "
                f"| {len(t['one engine']['wall_s'])} "
                f"| {one:.3f} | {cpu1:.2f} | {two:.3f} | {cpu2:.2f} | {two / one:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="learner steps per layout")
    p.add_argument("--sequences", type=int, help="learner batch; default prompts x samples")
    p.add_argument(
        "--only", choices=["jobs", "learner"], help="measure one part; the other from the JSON"
    )
    p.add_argument("--report-only", action="store_true", help="docs from the saved JSON")
    protocol_args(p, repeats=False)
    args = p.parse_args()
    saved = ASSETS / "scale_out.json"
    results = json.loads(saved.read_text()) if saved.is_file() else {}
    if not args.report_only:
        results["machine"] = quiet_machine(args)
    if not args.report_only and args.only != "learner":
        results["jobs"] = [run_layout(*layout, args.iterations, args.swaps) for layout in LAYOUTS]
        results["iterations"] = args.iterations
    if not args.report_only and args.only != "jobs":
        rollout = load_yaml(TrainConfig, CONFIG).rollout
        sequences = args.sequences or rollout.prompts_per_iteration * rollout.group_size
        results["learner"] = [
            run_learner(*layout, args.steps, sequences) for layout in LAYOUTS_LEARNER
        ]
        results["steps"], results["sequences"] = args.steps, sequences
    if not args.report_only:
        saved.write_text(json.dumps(results, indent=1))
    body = "\n".join(
        [
            report(results["jobs"], results["iterations"]),
            "",
            *learner_report(results["learner"], results["steps"], results["sequences"]),
            "",
            results.get("machine", {}).get("note", "Others' CPU share: not measured."),
        ]
    )
    print(body)
    write_study(
        "scale_out",
        "Scaling out: engines, policy ranks and FSDP (SmolLM2-135M, CPU)",
        body,
        "scale_out.py",
    )


if __name__ == "__main__":
    main()
