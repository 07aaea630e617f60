"""What the free k = 0 step's bound on kept draft inputs costs in acceptance, where it bites:
a long phase of steps that draft nothing, then a tail that drafts.

    python benchmarks/free_k0_bound.py   # rewrites docs/benchmarks/free_k0_bound.md

`vllm_plugin/patches/features/free_k0_v0_32.py` keeps the draft inputs of steps that skip the draft
pass and catches the draft's KV cache up on the next pass that runs; beyond its byte bound it
drops the oldest kept steps, and those positions keep stale draft KV. On a GPU its default
(256 MiB) holds about 128 steps of B = 256 on a 4096-wide bf16 model, so a rollout's k = 0
phase outlasts it. This study scales the bound to the same number of steps of this run's peak
batch and compares, on one engine and the same greedy outputs:
- vLLM as shipped: the draft pass runs on every step (the reference acceptance);
- kept inputs with no bound;
- bounds holding `STEPS_KEPT` steps of the peak batch;
- no catch-up at all (every skipped position stale): the floor.

Greedy decoding makes every configuration verify the same tokens (each request ends at EOS or
at its budget, with no text past EOS), so acceptance differs only by the draft's cache; one
run each is the whole measurement. Wall times are one round each: not a throughput claim.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import STUDIES, protocol_args, quiet_machine, smollm2, write_study
from grpo_specdec.assets.smollm2 import head_dir
from grpo_specdec.bench.tail_shape import tail_shape
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings
from vllm_plugin.patches.features import free_k0_v0_32 as free_k0

STEPS_KEPT = (150, 20)  # the range the GPU default holds at B = 256 (8k- to 4k-wide models)
UNBOUNDED = 1 << 62
FEW, K = 8, 3  # the tail policy: k = 0 above FEW running sequences, K at or below


class TailOnly:
    """k = 0 while more than `few` sequences run, `k` below: the shape a concurrency-aware
    controller gives a rollout on any hardware, without this machine's profile in it."""

    def __init__(self, few: int, k: int):
        self.few, self.k = few, k

    def choose(self, batch_size: int, context: float | None = None) -> int:
        return self.k if batch_size <= self.few else 0


def _set_kept(engine: Engine, max_bytes: int, catch_up: bool) -> int:
    """Bound the engine's kept inputs at `max_bytes` (emptied), with or without the catch-up;
    returns the bytes one kept position takes in this engine."""

    def configure(worker):
        kept = free_k0.kept_inputs(worker.model_runner.drafter)
        kept.clear()
        kept.max_bytes = max_bytes
        kept.dropped_steps = 0
        if catch_up:
            kept.__dict__.pop("prepend", None)
        else:
            kept.prepend = _no_prepend
        drafter = worker.model_runner.drafter
        # hidden state, then token id (int32), position and KV slot (int64)
        return drafter.hidden_size * drafter.dtype.itemsize + 4 + 8 + 8

    return engine.llm.collective_rpc(configure)[0]


def _no_prepend(*args, **kwargs):
    return None


def _dropped(engine: Engine) -> int:
    def read(worker):
        return free_k0.kept_inputs(worker.model_runner.drafter).dropped_steps

    return engine.llm.collective_rpc(read)[0]


def run(engine: Engine, shape, name: str, enabled: bool, max_bytes: int, catch_up: bool) -> dict:
    _set_kept(engine, max_bytes, catch_up)
    scheduler = engine.scheduler()
    scheduler.set_policy(TailOnly(FEW, K), scheduler.new_acceptance())
    engine.llm.reset_prefix_cache()
    free_k0.ENABLED = enabled
    try:
        res = engine.generate(
            shape.prompts,
            SamplingSettings(temperature=0.0, max_tokens=shape.cap),
            max_tokens=shape.max_tokens,
        )
    finally:
        free_k0.ENABLED = True
    spec = res.spec
    row = {
        "config": name,
        "max_bytes": max_bytes,
        "draft_tokens": spec["draft_tokens"],
        "accepted_tokens": spec["accepted_tokens"],
        "acceptance_rate": spec["acceptance_rate"],
        "mean_acceptance_length": 1 + spec["accepted_tokens"] / max(1, spec["drafts"]),
        "per_position_acceptance": spec["per_position_acceptance"],
        "dropped_steps": _dropped(engine),
        "wall_s": res.wall_s,
        "tokens": [o[0].token_ids for o in res.outputs],
    }
    print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="requests in the rollout")
    ap.add_argument("--budget-median", type=int, default=128)
    protocol_args(ap, repeats=False)
    args = ap.parse_args()
    machine = quiet_machine(args)
    target = smollm2()
    shape = tail_shape(num_prompts=args.prompts, group=1, cap=768, budget_median=args.budget_median)
    engine = Engine(
        EngineConfig(
            model=target,
            max_model_len=1024,
            seed=0,
            speculative={
                "draft": str(head_dir()),
                "k": K,
                "concurrency_aware": True,
                "controller": {"policy": "fixed"},
            },
        )
    )
    position_bytes = _set_kept(engine, UNBOUNDED, True)
    peak = len(shape.prompts)
    configs = [
        ("vLLM as shipped (draft pass every step)", False, UNBOUNDED, True),
        ("kept, no bound", True, UNBOUNDED, True),
        *(
            (f"kept, bound = {s} steps of B = {peak}", True, s * peak * position_bytes, True)
            for s in STEPS_KEPT
        ),
        ("no catch-up (every skipped position stale)", True, UNBOUNDED, False),
    ]
    run(engine, shape, "warm-up", True, UNBOUNDED, True)
    rows = [run(engine, shape, *c) for c in configs]
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    engine.shutdown()
    out = STUDIES / "free_k0_bound.json"
    for r in rows:
        del r["tokens"]
    out.write_text(json.dumps({"rows": rows, "same_outputs": same, "machine": machine}, indent=1))
    write_study(
        "free_k0_bound",
        "The free k = 0 step's bound, where it bites",
        _table(rows, same, shape, position_bytes, machine),
        "free_k0_bound.py",
    )


def _table(rows, same, shape, position_bytes, machine) -> str:
    reference = rows[0]["acceptance_rate"]
    lines = [
        f"SmolLM2-135M with the package's head, {len(shape.prompts)} greedy requests of the tail "
        f"shape (budgets median {sorted(shape.max_tokens)[len(shape.max_tokens) // 2]}, "
        f"max {max(shape.max_tokens)}), k = 0 while more than {FEW} run, k = {K} below. "
        f"One kept position: {position_bytes} bytes. Same outputs in every configuration: "
        f"{'yes' if same else '**no**'}. {machine['note']}",
        "",
        "| configuration | bound (MiB) | steps dropped | acceptance rate | vs shipped | MAL "
        "| per position | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = "none" if r["max_bytes"] >= UNBOUNDED else f"{r['max_bytes'] / 2**20:.1f}"
        per_pos = ", ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        lines.append(
            f"| {r['config']} | {bound} | {r['dropped_steps']} | {r['acceptance_rate']:.3f} | "
            f"{r['acceptance_rate'] / reference:.2f}x | {r['mean_acceptance_length']:.2f} | "
            f"{per_pos} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
