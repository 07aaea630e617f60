"""EAGLE-3 on SmolLM2-135M: three fused layers and training-time test, against the head
the shipped recipe uses (one layer, teacher-forced, the same 4096-token draft vocabulary).

    python benchmarks/eagle3_heads.py            # build what is missing, measure, write
    python benchmarks/eagle3_heads.py --report-only

1. Heads: `grpo-specdec draft train --task arithmetic --draft-vocab 4096 --eagle3` with the
   shipped head's recipe (300 steps, 512 prompts, 128-token answers), unrolled 3 steps (the
   default) and teacher-forced (`--ttt-steps 1`).
2. Offline: each head beside the shipped one at a fixed k = 4 on 32 held-out prompts,
   greedy, T = 0.7 (the recipe's) and T = 1: mean acceptance length (MAL) and the
   acceptance at each draft position.
3. Online: the shipped recipe (configs/smollm2_arith.yaml, 25 iterations, its end-of-run
   comparison on) with the shipped head and with the unrolled EAGLE-3 head, each learning
   online: the rollout's MAL per iteration, and the end-of-run comparison against no
   speculation.
Each part is saved to docs/assets/eagle3_heads.json as it finishes; a rerun skips what is
there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import (
    ASSETS,
    ROOT,
    _draft_train,
    cli,
    fixed_k_engine,
    protocol_args,
    quiet_machine,
    smollm2,
    smollm2_head,
    write_study,
)
from grpo_specdec.assets.smollm2 import default_dir

SAVED = ASSETS / "eagle3_heads.json"
K = 4
DRAFT_VOCAB = 4096
TEMPERATURES = {"greedy": 0.0, "T=0.7": 0.7, "T=1": 1.0}
ITERATIONS = 25
SHIPPED = "shipped (1 layer, teacher-forced)"
UNROLLED = "EAGLE-3 (3 layers, unrolled 3 steps)"
FORCED = "EAGLE-3 (3 layers, teacher-forced)"


def eagle3_head(target: str, ttt_steps: int) -> str:
    out = default_dir().parent / "heads" / f"smollm2-arith-v{DRAFT_VOCAB}-eagle3-ttt{ttt_steps}"
    if not (out / "model.safetensors").is_file():
        _draft_train(
            target, out, 300, 512, "--draft-vocab", str(DRAFT_VOCAB), "--eagle3",
            "--ttt-steps", str(ttt_steps), "--k", str(K),
        )  # fmt: skip
    return str(out)


def offline(target: str, head: str) -> dict:
    from grpo_specdec.engine import SamplingSettings
    from grpo_specdec.tasks.arithmetic import make_problems
    from vllm_plugin.controller import FixedPolicy

    prompts = [p.question for lvl in (1, 2, 3) for p in make_problems(11, seed=10_000, level=lvl)]
    engine = fixed_k_engine(target, head, K, draft_sampling="probabilistic")
    try:
        engine.scheduler().set_policy(FixedPolicy(K))
        out = {}
        for name, temperature in TEMPERATURES.items():
            spec = engine.generate(
                prompts[:32], SamplingSettings(temperature=temperature, max_tokens=128)
            ).spec
            out[name] = {
                "mal": spec["mean_acceptance_length"],
                "per_position": spec["per_position_acceptance"],
                "draft_tokens": spec["draft_tokens"],
            }
        return out
    finally:
        engine.shutdown()


def online(head: str, name: str) -> dict:
    out = default_dir().parent / "runs" / f"eagle3-heads-{name}"
    cli(
        "train", "--config", str(ROOT / "configs" / "smollm2_arith.yaml"),
        f"model.draft={head}", f"iterations={ITERATIONS}", "compare_at_end=true", f"out={out}",
    )  # fmt: skip
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "mal": [r.get("mean_acceptance_length") for r in records],
        "reward": [r.get("reward_mean") for r in records],
        "comparison": json.loads((out / "comparison.json").read_text()),
    }


def _save(data: dict) -> None:
    ASSETS.mkdir(parents=True, exist_ok=True)
    SAVED.write_text(json.dumps(data, indent=1))


def report(data: dict, machine_note: str) -> str:
    lines = [
        f"Offline: k = {K} fixed, 32 held-out arithmetic prompts, 128 new tokens, sampled drafts "
        "(the recipe's). Acceptance at draft position i: the share of steps whose first i "
        "drafts were all accepted.",
        "",
        "| head | sampling | MAL | position 1 | 2 | 3 | 4 |",
        "|---|---|---|---|---|---|---|",
    ]
    for head, by_t in data.get("offline", {}).items():
        for t, r in by_t.items():
            cells = " | ".join(f"{x:.2f}" for x in r["per_position"])
            lines.append(f"| {head} | {t} | {r['mal']:.2f} | {cells} |")
    runs = data.get("online", {})
    if runs:
        lines += [
            "",
            f"Online: the shipped recipe, {ITERATIONS} iterations at T = 0.7, the head learning "
            "online; MAL of the rollout (the controller picks k per step), mean over "
            "iterations.",
            "",
            "| head | MAL 1-5 | 11-15 | 21-25 | ours vs no speculation at the end |",
            "|---|---|---|---|---|",
        ]
        for head, r in runs.items():

            def mean(a, b, mal=r["mal"]):
                part = [m for m in mal[a:b] if m is not None]
                return f"{statistics.mean(part):.2f}" if part else "-"

            lines.append(
                f"| {head} | {mean(0, 5)} | {mean(10, 15)} | {mean(20, 25)} | "
                f"{_speedup(r['comparison'])} |"
            )
    return "\n".join([*lines, "", machine_note])


def _speedup(comparison: dict) -> str:
    """Each speculative row's speedup over no speculation with its 95% interval and MAL."""
    cells = []
    for name, v in comparison.items():
        if "no speculation" in name:
            continue
        r = v["speedup"]
        cells.append(
            f"{name}: {r['median']:.2f}x [{r['low']:.2f}, {r['high']:.2f}], "
            f"MAL {v['mean_acceptance_length']:.2f}"
        )
    return "; ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    protocol_args(ap, repeats=False)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    data = json.loads(SAVED.read_text()) if SAVED.is_file() else {}
    if not args.report_only:
        data["machine"] = quiet_machine(args)
        target = smollm2()
        heads = {
            SHIPPED: smollm2_head(target),
            UNROLLED: eagle3_head(target, 3),
            FORCED: eagle3_head(target, 1),
        }
        data.setdefault("offline", {})
        for name, head in heads.items():
            if name not in data["offline"]:
                data["offline"][name] = offline(target, head)
                _save(data)
        data.setdefault("online", {})
        for name, slug in ((SHIPPED, "shipped"), (UNROLLED, "eagle3")):
            if name not in data["online"]:
                data["online"][name] = online(heads[name], slug)
                _save(data)
    body = report(data, data.get("machine", {}).get("note", ""))
    write_study("eagle3_heads", "EAGLE-3 heads (SmolLM2-135M)", body, "eagle3_heads.py")
    print(body)


if __name__ == "__main__":
    main()
