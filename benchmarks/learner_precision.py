"""The policy learner's precision on this machine: one GRPO learner step (the forward for
old log-probs and hidden states, then forward + backward + AdamW) in fp32 and under
bfloat16 autocast, on SmolLM2-135M and a GRPO-sized batch; and how far apart the two
steps' losses and gradients are.

    python benchmarks/learner_precision.py [--sequences N] [--tokens T] [--repeats R]

Each setting is its own learner, loaded from the same weights; steps alternate between
the two so that machine noise hits both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

import torch

from benchmarks.common import protocol_args, quiet_machine, smollm2, write_study
from grpo_specdec.job.config import PolicySettings
from grpo_specdec.job.learners import PolicyBatch, PolicyLearner
from grpo_specdec.job.precision import cpu_has_bf16

SETTINGS = ("off", "bfloat16")


def _batch(sequences: int, tokens: int, prompt: int = 64) -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    return PolicyBatch(
        [
            torch.randint(0, 30000, (prompt + tokens,), generator=g).tolist()
            for _ in range(sequences)
        ],
        [prompt] * sequences,
        torch.randn(sequences, generator=g).tolist(),
        [True] * sequences,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=32, help="a GRPO batch: 4 prompts x 8")
    p.add_argument("--tokens", type=int, default=128, help="response tokens per sequence")
    p.add_argument("--repeats", type=int, default=2)
    protocol_args(p, repeats=False)
    args = p.parse_args()
    machine = quiet_machine(args)
    model = smollm2()
    batch = _batch(args.sequences, args.tokens)
    learners = {
        s: PolicyLearner(model, PolicySettings(autocast=s, micro_batch=4)) for s in SETTINGS
    }
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    first: dict[str, tuple[float, torch.Tensor]] = {}
    for _ in range(args.repeats):
        for setting, learner in learners.items():
            start = time.perf_counter()
            learner.prepare(batch)
            stats = learner.update()
            times[setting].append(time.perf_counter() - start)
            if setting not in first:  # the first step's loss and gradient, same weights
                grad = torch.cat([q.grad.flatten() for q in learner.model.parameters()]).double()
                first[setting] = (stats["policy_loss"], grad)
    fp32, bf16 = (statistics.median(times[s]) for s in SETTINGS)
    g32, g16 = first["off"][1], first["bfloat16"][1]
    cosine = float(g32 @ g16 / (g32.norm() * g16.norm()))
    body = "\n".join(
        [
            "Measured with `python benchmarks/learner_precision.py`: one policy-learner step "
            "(the forward for the rollout's log-probs and hidden states, then forward + backward "
            "+ AdamW) in fp32 and under bf16 autocast, each its own learner from the same "
            "weights, alternating.",
            "",
            f"SmolLM2-135M, {args.sequences} sequences x ({64} prompt + {args.tokens} response) "
            f"tokens, micro-batch 4, median of {args.repeats} learner steps (prepare + update); "
            f"this CPU has bfloat16 instructions: {cpu_has_bf16()}.",
            "",
            "| learner precision | step s | speed vs fp32 |",
            "|---|---|---|",
            f"| fp32 | {fp32:.1f} | 1.00x |",
            f"| bf16 autocast (fp32 weights and AdamW) | {bf16:.1f} | {fp32 / bf16:.2f}x |",
            "",
            f"First step, same weights and batch: gradient cosine {cosine:.4f}, gradient norm "
            f"bf16 / fp32 {float(g16.norm() / g32.norm()):.4f}; loss fp32 {first['off'][0]:.5f}, "
            f"bf16 autocast {first['bfloat16'][0]:.5f} (the importance ratio is 1 in a first "
            "step, so both are minus the mean advantage up to rounding).",
            "",
            machine["note"],
        ]
    )
    print(body)
    write_study(
        "learner_precision", "Learner precision (SmolLM2-135M, CPU)", body, "learner_precision.py"
    )


if __name__ == "__main__":
    main()
