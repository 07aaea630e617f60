"""EAGLE head quality and cost on SmolLM2-135M: full vocabulary vs reduced vocabulary.

    python benchmarks/draft_heads.py

For each head: mean acceptance length at k = 3 on held-out arithmetic prompts, greedy and
at temperature 1.0; the cost of one draft step as a fraction of a target step (from each
head's latency profile, at B = 1 and B = 32); and hot-swap latency of the draft and of the
whole policy into the running engine (median of 5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
    smollm2_profile,
    write_study,
)
from grpo_specdec.engine import SamplingSettings
from grpo_specdec.tasks.arithmetic import make_problems
from vllm_plugin.controller import FixedPolicy, profile_latency
from vllm_plugin.settings import hardware_name

K = 3
DRAFT_VOCAB = 4096


def measure(
    target: str, draft: str, profile: Path, prompts: list[str], policy_weights: dict
) -> dict:
    engine = fixed_k_engine(target, draft, K)
    try:
        engine.scheduler().set_policy(FixedPolicy(K))
        acc = {}
        for name, temperature in (("greedy", 0.0), ("temperature_1", 1.0)):
            spec = engine.generate(
                prompts, SamplingSettings(temperature=temperature, max_tokens=128)
            ).spec
            acc[name] = {
                "mean_acceptance_length": spec["mean_acceptance_length"],
                "per_position_acceptance": spec["per_position_acceptance"],
            }
        head = load_file(str(Path(draft) / "model.safetensors"))
        meta = json.loads((Path(draft) / "config.json").read_text())
        swap_meta = {"hidden_size": str(meta["hidden_size"]), "vocab_size": str(meta["vocab_size"])}
        draft_swaps = [
            engine.swap_weights("draft", head, v, swap_meta)["total_s"] for v in range(1, 6)
        ]
        policy_swaps = [
            engine.swap_weights("policy", policy_weights, v)["total_s"] for v in range(1, 6)
        ]
    finally:
        engine.shutdown()
    lat = profile_latency(json.loads(profile.read_text()))
    return {
        **acc,
        "draft_params": sum(t.numel() for k, t in head.items() if t.is_floating_point()),
        "draft_step_fraction": {b: float(lat.draft(b) / lat.target(b)) for b in (1, 32)},
        "draft_swap_ms": 1000 * statistics.median(draft_swaps),
        "policy_swap_ms": 1000 * statistics.median(policy_swaps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    protocol_args(ap, repeats=False)
    machine = quiet_machine(ap.parse_args())
    target = smollm2()
    heads = {"full vocabulary (EAGLE)": smollm2_head(target, draft_vocab=None)}
    heads[f"reduced vocabulary, {DRAFT_VOCAB} tokens (EAGLE-3 format)"] = smollm2_head(
        target, DRAFT_VOCAB
    )
    prompts = [p.question for lvl in (1, 2, 3) for p in make_problems(11, seed=10_000, level=lvl)][
        :32
    ]
    policy = load_file(str(Path(target) / "model.safetensors"))
    results = {
        name: measure(target, d, smollm2_profile(target, d, 5), prompts, policy)
        for name, d in heads.items()
    }
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / "draft_heads.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"Measured with `python benchmarks/draft_heads.py` on {hardware_name()}; k = {K}, 32 held-out prompts, "
        "128 new tokens. Draft step cost is D(B)/T(B) from each head's latency profile.",
        "",
        "| head | trainable params | MAL greedy | MAL T=1.0 | draft step / target step, B=1 | B=32 | draft swap ms | policy swap ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['draft_params'] / 1e6:.1f}M | {r['greedy']['mean_acceptance_length']:.2f} | "
            f"{r['temperature_1']['mean_acceptance_length']:.2f} | {r['draft_step_fraction'][1]:.2f} | "
            f"{r['draft_step_fraction'][32]:.2f} | {r['draft_swap_ms']:.0f} | {r['policy_swap_ms']:.0f} |"
        )
    body = "\n".join([*lines, "", machine["note"]])
    write_study("draft_heads", "Draft heads (SmolLM2-135M)", body, "draft_heads.py")
    print(body)


if __name__ == "__main__":
    main()
