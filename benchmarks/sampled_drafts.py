"""Sampled drafting at T = 1 on SmolLM2-135M: how often greedy and sampled drafts are
accepted, for heads trained with the EAGLE loss and with the TV term, over the full and a
reduced vocabulary; and what drawing a sampled draft costs.

    python benchmarks/sampled_drafts.py

1. Offline, on held-out T = 1 rollouts of the policy (SmolLM2 as shipped), at every
   response token, the draft's first position (the target's hidden state in): E[sum
   min(p, q)] (a sampled draft's acceptance), E[p(argmax q)] (a greedy draft's) and
   E[max p] (the ceiling of any one-hot draft).
2. In the engine, on held-out arithmetic prompts at T = 1: mean acceptance length (MAL)
   and per-position acceptance for k = 1..5, greedy vs sampled drafting, per head; one
   engine per (head, drafting).
3. The cost of one draft position at B = 1, 8, 64: greedy, vLLM's sampled path (logits
   scattered into the full vocabulary, softmax, exponential race) and the plugin's (q in
   the head's vocabulary, inverse CDF); keeping q for 3 positions dense or in the head's
   vocabulary; and verification (the plugin's CPU rejection sampler) with either q.
Heads are built by the project's own commands when absent (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from benchmarks.common import (
    ASSETS,
    fixed_k_engine,
    protocol_args,
    quiet_machine,
    smollm2,
    smollm2_head,
    smollm2_t1_head,
    write_study,
)
from grpo_specdec.draft.capture import Sequence, capture_hidden
from grpo_specdec.draft.head import load_head
from grpo_specdec.draft.loss import acceptance, make_batch
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings
from grpo_specdec.tasks.arithmetic import make_problems
from grpo_specdec.vllm_compat import sample_draft_as_vllm
from vllm_plugin.controller import FixedPolicy
from vllm_plugin.patches.features.cpu_sampled_drafts_v0_32 import sample_draft
from vllm_plugin.patches.fixes import cpu_rejection_sample_v0_32 as rejection
from vllm_plugin.settings import hardware_name

K_MAX = 5
SCALES = (0.8, 0.9, 1.1, 1.25)  # draft logits divided by these: q flattened (> 1) or sharpened
MAX_TOKENS = 128


def heads(target: str) -> dict[str, str]:
    return {
        "EAGLE loss, T=0.7 data (default head)": smollm2_head(target),
        "EAGLE loss, +200 steps on T=1 data": smollm2_t1_head(target, 0.0),
        "EAGLE + TV loss, +200 steps on T=1 data": smollm2_t1_head(target, 1.0),
        "EAGLE loss, +600 steps on T=1 data, 1024 prompts": smollm2_t1_head(
            target, 0.0, steps=600, prompts=1024
        ),
        "full vocabulary, EAGLE loss, T=0.7 data": smollm2_head(target, None),
    }


def held_out_prompts(n: int) -> list[str]:
    # Seeds the heads never trained on (bootstrap trains on seed 0, evaluates on 10_000).
    return [p.question for lvl in (1, 2, 3) for p in make_problems(n, seed=20_000, level=lvl)]


def offline(target: str, heads: dict[str, str], prompts: list[str]) -> dict:
    engine = Engine(EngineConfig(model=target, max_model_len=1024, seed=0))
    try:
        res = engine.generate(prompts, SamplingSettings(temperature=1.0, max_tokens=MAX_TOKENS))
    finally:
        engine.shutdown()
    seqs = [
        Sequence(p + g[0].token_ids, len(p))
        for p, g in zip(res.prompt_token_ids, res.outputs, strict=True)
    ]
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    capture_hidden(model, seqs)
    out = {}
    for name, path in heads.items():
        head = load_head(path, target, model).eval()
        scaled_keys = [f"sampled@{scale:g}" for scale in SCALES]
        sums = dict.fromkeys(["sampled", "greedy", "ceiling", *scaled_keys], 0.0)
        count = 0
        with torch.no_grad():
            for start in range(0, len(seqs), 8):
                batch = make_batch(seqs[start : start + 8])
                m = batch.mask
                feats = head(batch.next_ids, batch.hidden_in, batch.positions)[m]
                logits = head.draft_logits(feats)
                acc = acceptance(head, logits, batch.hidden_out[m], 1.0)
                for key in ("sampled", "greedy", "ceiling"):
                    sums[key] += acc[key].sum().item()
                # q sharpened or flattened against p (still lossless: q is what is handed on)
                for scale, key in zip(SCALES, scaled_keys, strict=True):
                    scaled = acceptance(head, logits / scale, batch.hidden_out[m], 1.0)
                    sums[key] += scaled["sampled"].sum().item()
                count += int(m.sum())
        out[name] = {key: v / count for key, v in sums.items()} | {"tokens": count}
        print(name, out[name], flush=True)
    return out


def engine_acceptance(target: str, head: str, draft_sampling: str, prompts: list[str]) -> dict:
    engine = fixed_k_engine(target, head, K_MAX, draft_sampling)
    out = {}
    try:
        for k in range(1, K_MAX + 1):
            engine.scheduler().set_policy(FixedPolicy(k))
            spec = engine.generate(
                prompts, SamplingSettings(temperature=1.0, max_tokens=MAX_TOKENS)
            ).spec
            out[k] = {
                "mal": spec["mean_acceptance_length"],
                "per_position": spec["per_position_acceptance"],
            }
            print(head, draft_sampling, k, out[k], flush=True)
    finally:
        engine.shutdown()
    return out


def _ms(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def costs(head: str, vocab: int) -> dict:
    """Milliseconds per draft position (and per step for q kept over 3 positions, and
    verification) at B = 1, 8, 64, on a head's real vocabulary map."""
    d2t = load_file(str(Path(head) / "model.safetensors"))["d2t"]
    vocab_ids = d2t + torch.arange(len(d2t))
    torch.manual_seed(0)
    out = {batch: _costs_at(batch, vocab_ids, vocab) for batch in (1, 8, 64)}
    print(out, flush=True)
    return out


def _costs_at(batch: int, vocab_ids: torch.Tensor, vocab: int, k: int = 3) -> dict:
    meta = SimpleNamespace(
        all_greedy=False, all_random=True, temperature=torch.ones(batch), generators={}
    )
    small = torch.randn(batch, len(vocab_ids))
    reduced_q = small.softmax(-1)
    dense_q = rejection.to_target_vocab(reduced_q, vocab_ids, vocab)
    drafts = vocab_ids[torch.randint(len(vocab_ids), (batch * k,))].int()
    target_logits = torch.randn(batch * k, vocab)

    def scattered():  # what the EAGLE-3 model's compute_logits returns
        logits = small.new_full((batch, vocab), float("-inf"))
        logits[:, vocab_ids] = small
        return logits

    def verify(q):
        probs = torch.cat([q] * k)
        if q.shape[1] != vocab:
            setattr(probs, rejection.VOCAB_IDS_ATTR, vocab_ids)
        rejection.rejection_sample(
            drafts,
            [k] * batch,
            k,
            torch.arange(1, batch + 1) * k,
            probs,
            target_logits,
            torch.zeros(batch, 1, dtype=torch.long),
            meta,
        )

    return {
        "greedy": _ms(lambda: scattered().argmax(-1)),
        "plugin_greedy": _ms(lambda: vocab_ids[small.argmax(-1)]),
        "vllm_sampled": _ms(lambda: sample_draft_as_vllm(scattered(), meta)),
        "plugin_sampled": _ms(lambda: sample_draft(small, meta.temperature, vocab_ids)),
        "keep_q_dense": _ms(lambda: torch.stack([dense_q] * k, 1).contiguous()),
        "keep_q_reduced": _ms(lambda: torch.stack([reduced_q] * k, 1).contiguous()),
        "verify_dense_q": _ms(lambda: verify(dense_q)),
        "verify_reduced_q": _ms(lambda: verify(reduced_q)),
    }


def report(r: dict) -> str:
    lines = [
        f"Measured with `python benchmarks/sampled_drafts.py` on {r['hardware']}. Policy: "
        f"SmolLM2 as shipped; held-out arithmetic prompts ({r['prompts']}), at most "
        f"{MAX_TOKENS} tokens, T = 1. Heads: the default bootstrapped head (300 steps on "
        "T = 0.7 samples), the same head after 200 more steps on T = 1 samples with the "
        "EAGLE loss alone or with the TV term (`draft train --init ... --gen-temperature 1 "
        "--tv-weight 1`), after 600 more on T = 1 answers to twice the prompts, and the "
        "full-vocabulary head bootstrapped like the default one.",
        "",
        f"### Offline: the draft's first position on held-out T=1 rollouts ({r['offline_tokens']} response tokens)",
        "",
        "| head | E[sum min(p,q)]: sampled draft accepted | E[p(argmax q)]: greedy draft accepted | E[max p]: ceiling of greedy drafts |",
        "|---|---|---|---|",
    ]
    for name, o in r["offline"].items():
        lines.append(f"| {name} | {o['sampled']:.3f} | {o['greedy']:.3f} | {o['ceiling']:.3f} |")
    lines += [
        "",
        "Sampled acceptance with the draft's logits divided by a scale before sampling (q "
        "flatter above 1, sharper below; any q stays lossless):",
        "",
        "| head | " + " | ".join(f"scale {s:g}" for s in sorted((*SCALES, 1.0))) + " |",
        "|---|" + "---|" * (len(SCALES) + 1),
    ]
    for name, o in r["offline"].items():
        cells = [o[f"sampled@{s:g}"] if s != 1.0 else o["sampled"] for s in sorted((*SCALES, 1.0))]
        lines.append(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    lines += [
        "",
        "### In the engine: mean acceptance length at T=1, k = 1..5 (per-position acceptance at k = 3)",
        "",
        "| head | drafting | "
        + " | ".join(f"k={k}" for k in range(1, K_MAX + 1))
        + " | per position, k=3 |",
        "|---|---|" + "---|" * (K_MAX + 1),
    ]
    for name, by_method in r["engine"].items():
        for method, per_k in by_method.items():
            pos = ", ".join(f"{a:.2f}" for a in per_k["3"]["per_position"])
            lines.append(
                f"| {name} | {method} | "
                + " | ".join(f"{per_k[str(k)]['mal']:.2f}" for k in range(1, K_MAX + 1))
                + f" | {pos} |"
            )
    lines += [
        "",
        "### Cost of sampled drafting (ms, median of 30; reduced 4096-token head, target vocabulary 49152)",
        "",
        "| B | greedy draft position: vLLM's path / plugin | sampled: vLLM's path / plugin | keep q of 3 positions: dense / head vocabulary | verify 3 positions: dense q / head-vocabulary q |",
        "|---|---|---|---|---|",
    ]
    for batch, c in r["costs"].items():
        lines.append(
            f"| {batch} | {c['greedy']:.2f} / {c['plugin_greedy']:.2f} | "
            f"{c['vllm_sampled']:.2f} / {c['plugin_sampled']:.2f} | "
            f"{c['keep_q_dense']:.2f} / {c['keep_q_reduced']:.2f} | "
            f"{c['verify_dense_q']:.2f} / {c['verify_reduced_q']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    protocol_args(ap, repeats=False)
    machine = quiet_machine(ap.parse_args())
    target = smollm2()
    all_heads = heads(target)
    prompts = held_out_prompts(11)[:32]
    result = {
        "hardware": hardware_name(),
        "prompts": len(prompts),
        "offline": offline(target, all_heads, prompts),
    }
    result["offline_tokens"] = next(iter(result["offline"].values()))["tokens"]
    result["engine"] = {
        name: {
            method: engine_acceptance(target, path, method, prompts)
            for method in ("greedy", "probabilistic")
        }
        for name, path in all_heads.items()
    }
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    result["costs"] = costs(smollm2_head(target), vocab)
    result = json.loads(json.dumps(result))  # the saved form: keys as strings
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / "sampled_drafts.json").write_text(json.dumps(result, indent=1))
    text = report(result) + "\n\n" + machine["note"]
    write_study(
        "sampled_drafts", "Sampled drafting at T=1 (SmolLM2-135M)", text, "sampled_drafts.py"
    )
    print(text)


if __name__ == "__main__":
    main()
