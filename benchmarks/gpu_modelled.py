"""What a GPU user can expect, MODELLED (not measured): the rollout simulator
(grpo_specdec/simulate.py) replays the GRPO shapes measured on CPU under each policy with a
GPU latency profile and an acceptance model.

    python benchmarks/gpu_modelled.py     # writes docs/assets/gpu_profile_published_llama31_8b.json
                                          # and rewrites docs/benchmarks/gpu_modelled.md

Until benchmarks/gpu_latency_profile.py has run on a GPU (then pass its JSON with
--profile), the profile is built from published figures: NVIDIA NIM's inter-token latency
of Llama-3.1-8B against concurrency, fitted as the controller's hinge T(N); the draft and
speculation costs are assumed (stated in the profile and the report).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import ASSETS, load_json, write_study
from benchmarks.rollout_throughput import SHAPES
from grpo_specdec.simulate import (
    VLLM_EXAMPLE_TABLES,
    Workload,
    compare,
    lengths_from_trace,
    load_profile,
    recommend_table,
    replay,
)
from vllm_plugin.compat import dense_k_table
from vllm_plugin.controller import LatencyModel, LinearCost, fit_latency

# NVIDIA NIM for LLMs benchmarks, Llama-3.1-8B-Instruct: inter-token latency (ms) at each
# concurrency (/work/shared/fastgrpo-notes.md section 7).
NIM_ITL_MS = {1: 4.63, 50: 5.91, 100: 7.57, 150: 9.81, 200: 12.65, 250: 16.14}
# Assumed: a one-layer EAGLE head of an 8B model reads ~0.8 B weights (one decoder layer,
# fc and the 128k-vocabulary lm_head) of the target's 8 B, so a draft step costs ~10% of a
# target step, flat and per sequence alike; verification overhead assumed nil.
DRAFT_SHARE = 0.10
PUBLISHED_PROFILE = ASSETS / "gpu_profile_published_llama31_8b.json"
# Assumed acceptance of an 8B EAGLE-3 head: 0.9 at each of 7 chain positions (E[tokens | 7]
# = 5.7), near the ~6 acceptance length the EAGLE-3 paper reports at depth 7 with trees at
# T = 0; not verified from the notes, and optimistic for T = 1 rollouts.
EAGLE3_ASSUMED = [0.9] * 7
MEASURED_RUN = "rollout_throughput"  # the run whose GRPO traces give the shapes
REPLICAS = 8  # the `long` shape repeated: 512 requests, a GPU-sized GRPO batch
# TLT's reported EAGLE speedup vs batch size (64 verify tokens).
TLT = {1: 3.62, 2: 3.38, 4: 2.98, 8: 2.27, 16: 1.91, 32: 1.70}


def published_profile() -> dict:
    b = list(NIM_ITL_MS)
    fitted, rms = fit_latency(b, [0] * len(b), list(NIM_ITL_MS.values()))
    t = fitted.target
    latency = LatencyModel(t, LinearCost(DRAFT_SHARE * t.flat, DRAFT_SHARE * t.slope))
    return {
        "source": "PUBLISHED figures, not measured here: NVIDIA NIM for LLMs benchmark, "
        "Llama-3.1-8B-Instruct inter-token latency vs concurrency "
        f"{NIM_ITL_MS} ms, fitted as T(N) with vllm_plugin.controller.fit_latency (k = 0); "
        f"draft step ASSUMED {DRAFT_SHARE:.0%} of a target step; speculation overhead ASSUMED 0",
        "latency": latency.to_dict(),
        "fit_rms_ms": rms,
        "measurements": [
            {"batch": c, "k": 0, "tokens": c, "ms": ms} for c, ms in NIM_ITL_MS.items()
        ],
    }


def shapes(run: dict) -> dict[str, Workload]:
    prompt = 62.0  # mean prompt tokens of the arithmetic GRPO prompts (chat template)
    out = {}
    for name, trace in run["traces"].items():
        model, _, _, _ = SHAPES[name]
        lengths = lengths_from_trace(trace, run["calibration_conditional_acceptance"][model])
        out[name] = Workload(lengths, np.full(len(lengths), prompt), 1.0)
    long = out["long"]
    out[f"long x{REPLICAS}"] = Workload(
        np.tile(long.output_lengths, REPLICAS), np.tile(long.prompt_lengths, REPLICAS), 1.0
    )
    return out


def report(latency: LatencyModel, source: str, run: dict) -> str:
    acceptances = {
        "measured: SmolLM2 bootstrapped head, T=1": run["calibration_conditional_acceptance"][
            "base"
        ],
        "measured: online-trained head, T=1": run["calibration_conditional_acceptance"]["trained"],
        "ASSUMED: 8B EAGLE-3 head": EAGLE3_ASSUMED,
    }
    t = latency.target
    lines = [
        "**MODELLED, not measured.** Every figure below is a replay by the rollout simulator "
        "(`grpo_specdec/simulate.py`), not a GPU run.",
        "",
        f"Profile: {source}. T(N) = {t.flat:.2f} + {t.slope:.4f}·max(N − {t.knee:.0f}, 0) ms, "
        f"C_peak {latency.c_peak:.0f} tokens; D(B) = {latency.draft.base:.2f} + "
        f"{latency.draft.per_seq:.4f}·B ms.",
        "",
        "Shapes: the GRPO rollouts measured on CPU (output lengths reconstructed from the "
        f"`ours` traces of `docs/assets/{MEASURED_RUN}.json`, 62 prompt tokens each), and "
        f"`long x{REPLICAS}`: the `long` shape's lengths {REPLICAS} times over (512 requests). "
        "Acceptance: per-position conditional acceptance as the engine measures it; the "
        "measured ones carry over from CPU (acceptance is a property of the models); "
        f"the EAGLE-3 one is assumed: {EAGLE3_ASSUMED[0]} at each of {len(EAGLE3_ASSUMED)} "
        "positions (E[tokens | 7] = 5.7, near the EAGLE-3 paper's reported ~6 at depth 7 with "
        "tree drafts at T = 0; not verified here, optimistic for T = 1).",
    ]
    for acc_name, conditional in acceptances.items():
        conditional = np.asarray(conditional, dtype=float)
        k_max = len(conditional)
        lines += ["", f"### Acceptance {acc_name}: {np.round(conditional, 2).tolist()}"]
        for shape, w in shapes(run).items():
            max_batch = max(len(w.output_lengths), 512)
            examples = {
                f"vLLM example table ({n})": dense_k_table(table, max_batch, k_max)
                for n, table in VLLM_EXAMPLE_TABLES.items()
            }
            recommended = recommend_table(latency, conditional, k_max, max_batch)
            replays = compare(
                latency,
                conditional,
                w,
                k_max,
                max_batch,
                dense_k_table(recommended, max_batch, k_max),
            )
            replays = {
                ("recommended table" if n == "static table" else n): r for n, r in replays.items()
            }
            replays.update({n: replay(latency, conditional, w, p) for n, p in examples.items()})
            base = replays["no spec"].makespan_s
            lines += [
                "",
                f"Shape `{shape}` ({len(w.output_lengths)} requests, {w.output_lengths.sum():.0f} tokens): "
                + ", ".join(
                    f"{n} {base / r.makespan_s:.2f}x" for n, r in replays.items() if n != "no spec"
                ),
                f"(no spec {base:.2f} s, tail after 90% done {replays['no spec'].tail_s:.2f} s; ours "
                f"{replays['ours'].makespan_s:.2f} s, tail {replays['ours'].tail_s:.2f} s).",
            ]
        lines.append(
            f"Recommended `num_speculative_tokens_per_batch_size`: `{recommend_table(latency, conditional, k_max, 512)}`"
        )
        fixed = []
        for b in TLT:
            w = Workload(np.full(b, 512.0), np.full(b, 62.0), 1.0)
            r = compare(latency, conditional, w, k_max, 512)
            fixed.append(
                f"B={b}: {r['no spec'].makespan_s / r['ours'].makespan_s:.2f}x (TLT {TLT[b]:.2f}x)"
            )
        lines.append(
            "Fixed concurrency, 512 tokens each, ours vs no spec: " + ", ".join(fixed) + "."
        )
    lines += [
        "",
        "Published for comparison (GPU, measured by their authors): FastGRPO 2.35–2.91x generation "
        "speedup (Qwen2.5-7B / Llama-3.1-8B / DS-R1-Distill-7B, trees, online-trained EAGLE head); "
        "TLT's EAGLE speedup vs batch size at 64 verify tokens: "
        + ", ".join(f"{v}x at {b}" for b, v in TLT.items())
        + ". vLLM's example tables: "
        + "; ".join(f"{n} `{t}`" for n, t in VLLM_EXAMPLE_TABLES.items())
        + ".",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--profile", default=None, help="a GPU profile JSON (default: the published-figure one)"
    )
    args = ap.parse_args()
    if args.profile is None:
        import json

        PUBLISHED_PROFILE.write_text(json.dumps(published_profile(), indent=1))
        path = PUBLISHED_PROFILE
    else:
        path = Path(args.profile)
    latency, _ = load_profile(path)
    source = load_json(path).get("source", str(path))
    text = report(latency, source, load_json(ASSETS / f"{MEASURED_RUN}.json"))
    write_study(
        "gpu_modelled",
        "What a GPU user can expect — MODELLED, not measured",
        text,
        "gpu_modelled.py",
    )
    print(text)


if __name__ == "__main__":
    main()
