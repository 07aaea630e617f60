"""The job's two learners on a GPU: the policy learner (GRPO's forward, then its update) and
the draft learner (the EAGLE head trained on that forward's hidden states), on a
Qwen2.5-1.5B-shaped model from random weights (no download), each step timed and its peak
GPU memory read. It needs torch and transformers (and pydantic, pyyaml, safetensors, which the
project's config and checkpoint code import); no vLLM, no Ray. Under 10 minutes on one H200.

    python benchmarks/gpu_check.py                                       # writes docs/benchmarks/gpu_check.md
    python benchmarks/gpu_check.py --model tiny --device cpu --out /tmp/gpu_check.json   # any CPU

What it checks beyond the timings: every tensor a learner step touches is on the learners'
device (a mix fails the step), and the draft step's peak memory against the hidden states
it was given.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.gpu_latency_profile import SHAPES, model_config
from grpo_specdec.draft.learner import DraftLearner
from grpo_specdec.draft.trainer import DraftTrainConfig
from grpo_specdec.job.config import PolicySettings
from grpo_specdec.job.learners import PolicyBatch, PolicyLearner

STUDY = "gpu_check"
ASSET = Path(__file__).resolve().parents[1] / "docs" / "assets" / "gpu_check.json"


def random_batch(vocab: int, samples: int, prompt: int, response: int, seed: int) -> PolicyBatch:
    """`samples` sequences of random tokens, responses of random lengths up to `response`,
    half the advantages +1 and half -1 (every group informative)."""
    rng = random.Random(seed)
    batch = PolicyBatch([], [], [], [])
    for i in range(samples):
        n = prompt + rng.randint(response // 2, response)
        batch.token_ids.append([rng.randrange(vocab) for _ in range(n)])
        batch.prompt_lens.append(prompt)
        batch.advantages.append(1.0 if i % 2 else -1.0)
        batch.informative.append(True)
    return batch


class Peak:
    """Seconds and peak allocated GPU memory (GiB) of the block; no peak off CUDA."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.gib = torch.cuda.max_memory_allocated() / 2**30
        else:
            self.gib = None
        self.s = time.perf_counter() - self.start


def run(args) -> dict:
    device = torch.device(args.device)
    config = model_config(args.model, args.layers)
    steps = []
    with tempfile.TemporaryDirectory() as policy_dir:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(policy_dir)
        policy = PolicyLearner(
            policy_dir, PolicySettings(micro_batch=args.micro_batch), args.device
        )
        draft = DraftLearner(
            policy_dir, None, DraftTrainConfig(batch_size=args.micro_batch), args.device
        )
        resident = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
        for step in range(args.steps):
            batch = random_batch(
                config.vocab_size, args.samples, args.prompt_tokens, args.response_tokens, step
            )
            with Peak(device) as forward:
                data = policy.prepare(batch)
            with Peak(device) as update:
                policy_round = policy.update()
            with Peak(device) as train:
                draft_round = draft.train(data)
            hidden = sum(s.hidden.numel() * s.hidden.element_size() for s in data.seqs)
            steps.append(
                {
                    "forward_s": forward.s,
                    "update_s": update.s,
                    "draft_s": train.s,
                    "forward_peak_gib": forward.gib,
                    "update_peak_gib": update.gib,
                    "draft_peak_gib": train.gib,
                    "hidden_gib": hidden / 2**30,
                    "hidden_dtype": str(data.seqs[0].hidden.dtype),
                    "tokens": sum(len(t) for t in batch.token_ids),
                    "policy_loss": policy_round.means.get("loss"),
                    "draft_loss": draft_round.means.get("loss"),
                    "draft_steps": draft_round.steps,
                }
            )
            print(json.dumps(steps[-1]), flush=True)
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else args.device,
        "model": args.model,
        "layers": config.num_hidden_layers,
        "vocab": config.vocab_size,
        "resident_gib": resident,
        "steps": steps,
        "command": " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]),
        "torch": torch.__version__,
    }


def report(data: dict) -> str:
    def gib(x):
        return "" if x is None else f"{x:.1f}"

    rows = [
        "| step | tokens | policy forward s (peak GiB) | policy update s (peak GiB) | "
        "draft step s (peak GiB) | hidden states GiB (dtype) |",
        "|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(data["steps"]):
        rows.append(
            f"| {i} | {s['tokens']} | {s['forward_s']:.2f} ({gib(s['forward_peak_gib'])}) | "
            f"{s['update_s']:.2f} ({gib(s['update_peak_gib'])}) | {s['draft_s']:.2f} "
            f"({gib(s['draft_peak_gib'])}) | {s['hidden_gib']:.2f} ({s['hidden_dtype']}) |"
        )
    return (
        f"Measured with `{data['command']}` on {data['device']} (torch {data['torch']}): "
        f"{data['model']}-shaped, {data['layers']} layers, vocabulary {data['vocab']}, random "
        f"weights; {gib(data['resident_gib'])} GiB resident after both learners started. Step 0 "
        "includes warm-up.\n\n" + "\n".join(rows)
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's own")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--response-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help=f"the JSON; default {ASSET} and the study")
    args = ap.parse_args(argv)
    data = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1))
        return
    from benchmarks.common import write_study

    ASSET.write_text(json.dumps(data, indent=1))
    print(write_study(STUDY, "The learners on a GPU", report(data), "gpu_check.py"))


if __name__ == "__main__":
    main()
