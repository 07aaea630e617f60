"""Swap time through vLLM's weight-update API against one direct call, side by side.

    python benchmarks/swap_time.py          # rewrites docs/benchmarks/swap_time.md

One SmolLM2 engine with the package's reduced-vocabulary head. Each update writes the
weights to the swap folder and loads them, validated, on the worker, then resets the
prefix cache; the two paths differ in how the load is asked for:
- "vLLM's API": `Engine.swap_weights`, the `grpo_shm` trainer engine driving
  `start_(draft_)weight_update`, `update_weights`, `finish_weight_update` (and the plugin's
  report call), four engine calls;
- "one call": a single `collective_rpc` that loads and commits on the worker, as the
  plugin's own `grpo_swap_weights` did before its updates went through vLLM's API.
The head and the whole policy, each through both paths, warmed, then --repeats rounds in
shuffled order (grpo_specdec/bench/measure.py); the ratio is paired by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from safetensors.torch import load_file

from benchmarks.common import (
    ASSETS,
    fixed_k_engine,
    protocol_args,
    quiet_machine,
    smollm2,
    smollm2_head,
    write_study,
)
from grpo_specdec.bench.measure import run_protocol, speedup
from grpo_specdec.swap_files import swap_file
from vllm_plugin.settings import hardware_name


def _load_in_one_call(worker, role: str, path: str, version: int) -> None:
    """Runs in the worker: the `grpo_shm` backend's load and commit, without vLLM's API."""
    engine = worker.weight_transfer_engine
    if role == "draft":
        model, config = (
            worker.get_draft_model(),
            worker.vllm_config.speculative_config.draft_model_config,
        )
    else:
        model, config = worker.get_model(), worker.vllm_config.model_config
    engine.swaps.load(role, model, config, path, version)
    engine.swaps.commit(role)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    protocol_args(ap)
    args = ap.parse_args()
    machine = quiet_machine(args)
    target = smollm2()
    head = smollm2_head(target)
    weights = {
        "draft": load_file(str(Path(head) / "model.safetensors")),
        "policy": load_file(str(Path(target) / "model.safetensors")),
    }
    engine = fixed_k_engine(target, head, 3)
    version = iter(range(1, 10_000))

    def through_api(role):
        def run() -> float:
            start = time.perf_counter()
            engine.swap_weights(role, weights[role], next(version))
            return time.perf_counter() - start

        return run

    def one_call(role):
        def run() -> float:
            start = time.perf_counter()
            v = next(version)
            with swap_file(role, weights[role], v, None) as path:
                engine.llm.collective_rpc(_load_in_one_call, args=(role, str(path), v))
            engine.llm.reset_prefix_cache(reset_running_requests=True)
            return time.perf_counter() - start

        return run

    configs = {
        f"{role}, {name}": make(role)
        for role in ("draft", "policy")
        for name, make in (("one call", one_call), ("vLLM's API", through_api))
    }
    try:
        timed = run_protocol(configs, repeats=args.repeats, seed=args.order_seed, progress=print)
    finally:
        engine.shutdown()
    rows = {}
    for role in ("draft", "policy"):
        base, api = timed.runs[f"{role}, one call"], timed.runs[f"{role}, vLLM's API"]
        rows[role] = {
            "one_call_ms": 1000 * statistics.median(base),
            "api_ms": 1000 * statistics.median(api),
            "api_vs_one_call": speedup(base, api).to_dict(),
            "runs": {"one call": base, "vLLM's API": api},
        }
    data = {
        "hardware": hardware_name(),
        "machine": machine,
        "repeats": args.repeats,
        "orders": timed.orders,
        "busy_max": timed.max_busy(),
        "rows": rows,
    }
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / "swap_time.json").write_text(json.dumps(data, indent=1))
    lines = [
        f"Measured with `python benchmarks/swap_time.py` on {data['hardware']}: SmolLM2-135M "
        "and the package's reduced-vocabulary head, each update written to the swap folder, "
        f"loaded and validated, the prefix cache reset. Median of {args.repeats} rounds after "
        "a warm-up, order shuffled per round; the ratio is one call's time over the API's, "
        "paired by round, with its 95% interval (> 1: the API is faster). " + machine["note"],
        "",
        "| weights | one call, ms | vLLM's API, ms | API vs one call |",
        "|---|---|---|---|",
    ]
    for role, r in rows.items():
        ratio = r["api_vs_one_call"]
        lines.append(
            f"| {role} | {r['one_call_ms']:.0f} | {r['api_ms']:.0f} | "
            f"{ratio['median']:.2f}x [{ratio['low']:.2f}, {ratio['high']:.2f}] ({ratio['verdict']}) |"
        )
    text = "\n".join(lines)
    write_study(
        "swap_time", "Swap time: vLLM's weight-update API vs one call", text, "swap_time.py"
    )
    print(text)


if __name__ == "__main__":
    main()
