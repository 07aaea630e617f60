"""The GPU benchmarks, one entry point: `check` runs the job's learners on a GPU, `profile`
measures a GPU's latency profile, `modelled` replays the CPU-measured rollouts on a GPU
profile (MODELLED, not measured). `check` and `profile` need torch and transformers only
(and pydantic, pyyaml, safetensors, which the project's config and checkpoint code import):
no vLLM, no Ray, no download (random weights from configs with the models' shapes).

    python benchmarks/gpu.py check      # writes docs/benchmarks/gpu_check.md (under 10 min, one H200)
    python benchmarks/gpu.py check --model tiny --device cpu --out /tmp/gpu_check.json   # any CPU
    python benchmarks/gpu.py profile --model llama3.1-8b --out docs/assets/gpu_profile_h200_llama31_8b.json
    python benchmarks/gpu.py profile --tiny --sizes 1,4 --out /tmp/tiny.json            # any CPU
    python benchmarks/gpu.py modelled   # writes docs/assets/gpu_profile_published_llama31_8b.json
                                        # and rewrites docs/benchmarks/gpu_modelled.md

check: the policy learner (GRPO's forward, then its update) and the draft learner (the EAGLE
head trained on that forward's hidden states) on a Qwen2.5-1.5B-shaped model, each step
timed and its peak GPU memory read; every tensor a learner step touches must be on the
learners' device (a mix fails the step).

profile: T(N), one target forward over N sequences decoding one token each, every one
attending to a static KV cache of `context` tokens, in bf16 and replayed from a CUDA graph
(eager where no GPU); the draft: fc(concat(embedding, hidden)) -> one decoder layer -> the
target's lm_head over N sequences. The hinge T(N) is fitted at the first context with the
controller's `fit_latency`; how T grows with context is the latency model's attention term.
About 2 minutes per model on an H200.

modelled: the rollout simulator (grpo_specdec/simulate.py) replays the GRPO shapes measured
on CPU under each policy. Until `profile` has run on a GPU (then pass its JSON with
--profile), the profile is built from published figures: NVIDIA NIM's inter-token latency
of Llama-3.1-8B against concurrency, fitted as the controller's hinge T(N); the draft and
speculation costs are assumed (stated in the profile and the report).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file or a module

from benchmarks.common import ASSETS, command, load_json, parser, prose, table, write_study
from vllm_plugin.controller import LatencyModel, LinearCost, fit_latency

# hidden, layers, heads, kv heads, intermediate, vocab (the models' published configs)
SHAPES = {
    "qwen2.5-1.5b": (Qwen2Config, 1536, 28, 12, 2, 8960, 151936),
    "qwen2.5-7b": (Qwen2Config, 3584, 28, 28, 4, 18944, 152064),
    "llama3.1-8b": (LlamaConfig, 4096, 32, 32, 8, 14336, 128256),
    "tiny": (LlamaConfig, 64, 2, 4, 2, 128, 512),
}
KV_BUDGET_GIB = 60  # (size, context) points whose KV cache would exceed this are skipped
CHECK_ASSET = ASSETS / "gpu_check.json"


def model_config(name: str, layers: int | None = None):
    cls, hidden, n_layers, heads, kv_heads, inter, vocab = SHAPES[name]
    return cls(
        hidden_size=hidden,
        num_hidden_layers=layers or n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )


# --- check: the learners ---------------------------------------------------------------


def random_batch(vocab: int, samples: int, prompt: int, response: int, seed: int):
    """`samples` sequences of random tokens, responses of random lengths up to `response`,
    half the advantages +1 and half -1 (every group informative)."""
    from grpo_specdec.job.learners import PolicyBatch

    rng = random.Random(seed)
    batch = PolicyBatch([], [], [], [])
    for i in range(samples):
        n = prompt + rng.randint(response // 2, response)
        batch.token_ids.append([rng.randrange(vocab) for _ in range(n)])
        batch.prompt_lens.append(prompt)
        batch.advantages.append(1.0 if i % 2 else -1.0)
        batch.informative.append(True)
    return batch


def timed_peak(device: torch.device, fn, *args):
    """`fn(*args)`'s result, its seconds and its peak allocated GPU memory (GiB; None off CUDA)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn(*args)
    if cuda:
        torch.cuda.synchronize()
    gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return out, time.perf_counter() - start, gib


def check(args) -> dict:
    from grpo_specdec.draft.learner import DraftLearner
    from grpo_specdec.draft.trainer import DraftTrainConfig
    from grpo_specdec.job.config import PolicySettings
    from grpo_specdec.job.learners import PolicyLearner

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
            data, forward_s, forward_gib = timed_peak(device, policy.prepare, batch)
            policy_round, update_s, update_gib = timed_peak(device, policy.update)
            draft_round, draft_s, draft_gib = timed_peak(device, draft.train, data)
            hidden = sum(s.hidden.numel() * s.hidden.element_size() for s in data.seqs)
            steps.append(
                {
                    "forward_s": forward_s,
                    "update_s": update_s,
                    "draft_s": draft_s,
                    "forward_peak_gib": forward_gib,
                    "update_peak_gib": update_gib,
                    "draft_peak_gib": draft_gib,
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
        "device": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
        "model": args.model,
        "layers": config.num_hidden_layers,
        "vocab": config.vocab_size,
        "resident_gib": resident,
        "steps": steps,
        "command": command(),
        "torch": torch.__version__,
    }


def check_report(data: dict) -> str:
    def gib(x):
        return "" if x is None else f"{x:.1f}"

    header = ["step", "tokens", "policy forward s (peak GiB)", "policy update s (peak GiB)"]
    header += ["draft step s (peak GiB)", "hidden states GiB (dtype)"]
    rows = [
        [i, s["tokens"]]
        + [f"{s[f'{p}_s']:.2f} ({gib(s[f'{p}_peak_gib'])})" for p in ("forward", "update", "draft")]
        + [f"{s['hidden_gib']:.2f} ({s['hidden_dtype']})"]
        for i, s in enumerate(data["steps"])
    ]
    fields = {k: data[k] for k in ("command", "device", "torch", "model", "layers", "vocab")}
    header_text = prose("gpu", "check", **fields, resident=gib(data["resident_gib"]))
    return header_text + "\n\n" + "\n".join(table(header, rows))


# --- profile: a GPU's latency profile ---------------------------------------------------


def timer(fn, device: torch.device, repeats: int):
    """Median ms of `fn`, replayed from a CUDA graph where it captures (else eager);
    returns (ms, graphed)."""
    if device.type != "cuda":
        fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(1000 * (time.perf_counter() - t0))
        return statistics.median(samples), False
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run, graphed = graph.replay, True
    except RuntimeError:
        torch.cuda.synchronize()
        run, graphed = fn, False
    run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples), graphed


def decode_step(model, config, batch: int, context: int, device, hidden_in=None):
    """A closure running one decode forward of `batch` sequences at position `context`
    over a static cache (inputs_embeds = `hidden_in` for the draft's layer)."""
    cache = StaticCache(config=config, max_cache_len=context + 1)
    position = torch.full((batch, 1), context, device=device, dtype=torch.long)
    cache_position = torch.tensor([context], device=device)
    ids = torch.zeros((batch, 1), device=device, dtype=torch.long)

    def step():
        kwargs = {"inputs_embeds": hidden_in()} if hidden_in else {"input_ids": ids}
        return model(
            **kwargs,
            position_ids=position,
            cache_position=cache_position,
            past_key_values=cache,
            use_cache=True,
        ).logits

    return step


@torch.inference_mode()
def measure(name: str, sizes: list[int], contexts: list[int], repeats: int, device, log=print):
    dtype = torch.bfloat16
    config = model_config(name)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        head_config = model_config(name, layers=1)
        draft = AutoModelForCausalLM.from_config(head_config, dtype=dtype).eval()
        fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False, dtype=dtype)
    draft.lm_head = target.lm_head  # EAGLE shares the target's lm_head
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # bytes
    rows, graphed_all = [], True
    for context in contexts:
        for n in sizes:
            if n * (context + 1) * kv_per_token / 2**30 > KV_BUDGET_GIB:
                log(f"skip N={n} context={context}: KV cache over {KV_BUDGET_GIB} GiB")
                continue
            step = decode_step(target, config, n, context, device)
            target_ms, graphed = timer(step, device, repeats)
            features = torch.zeros((n, 1, 2 * config.hidden_size), device=device, dtype=dtype)
            step = decode_step(draft, head_config, n, context, device, lambda f=features: fc(f))
            draft_ms, draft_graphed = timer(step, device, repeats)
            graphed_all &= graphed and draft_graphed
            rows.append(
                {"tokens": n, "context": context, "target_ms": target_ms, "draft_ms": draft_ms}
            )
            log(
                f"{name} N={n:4d} context={context:5d}: target {target_ms:7.3f} ms, draft {draft_ms:6.3f} ms"
            )
            torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows, graphed_all


def profile(args) -> None:
    name = "tiny" if args.tiny else args.model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("no GPU: only --tiny runs on CPU")
    sizes = [int(s) for s in args.sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows, graphed = measure(name, sizes, contexts, args.repeats, device)
    reference = rows[0]["context"]
    at_ref = [r for r in rows if r["context"] == reference]
    n = [r["tokens"] for r in at_ref]
    target, rms = fit_latency(n, [0] * len(n), [r["target_ms"] for r in at_ref])
    slope, base = (
        np.polyfit(n, [r["draft_ms"] for r in at_ref], 1)
        if len(n) > 1
        else (0.0, at_ref[0]["draft_ms"])
    )
    # Attention's cost per query token per context token, from the same N at two contexts.
    by_point = {(r["tokens"], r["context"]): r["target_ms"] for r in rows}
    growth = [
        (by_point[(t, c)] - by_point[(t, reference)]) / (t * (c - reference))
        for (t, c) in by_point
        if c > reference and (t, reference) in by_point
    ]
    latency = LatencyModel(
        target.target,
        LinearCost(max(float(base), 0.0), max(float(slope), 0.0)),
        attention=max(statistics.median(growth), 0.0) if growth else 0.0,
        context=float(reference),
    )
    measured = {
        "source": "measured by `python benchmarks/gpu.py profile` (random weights, "
        f"{'CUDA graphs' if graphed else 'eager'}, bf16)",
        "model_shape": name,
        "hardware": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "latency": latency.to_dict(),
        "fit_rms_ms": rms,
        "measurements": rows,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(measured, indent=1))
    t = measured["latency"]["target"]
    print(
        f"T(N) = {t['flat']:.3f} + {t['slope']:.4f} * max(N - {t['knee']:.0f}, 0) ms, "
        f"C_peak {measured['latency']['c_peak']:.0f} tokens -> {args.out}"
    )


# --- modelled: the simulator on a GPU profile --------------------------------------------

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
# Each acceptance the report replays: its label, and the run's policy whose calibration
# measured it (None: assumed).
ACCEPTANCES = {
    "measured: SmolLM2 bootstrapped head, T=1": "base",
    "measured: online-trained head, T=1": "trained",
    "ASSUMED: 8B EAGLE-3 head": None,
}


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


def workloads(run: dict) -> dict:
    """The run's GRPO shapes (in the rollout benchmark's order; the tail shape is not one)
    as workloads, and the `long` shape `REPLICAS` times over where the run has it."""
    from benchmarks.rollout_throughput import SHAPES as GRPO_SHAPES
    from grpo_specdec.simulate import Workload, lengths_from_trace

    prompt = 62.0  # mean prompt tokens of the arithmetic GRPO prompts (chat template)
    calibration = run["calibration_conditional_acceptance"]
    out = {}
    for name, (model, _, _, _) in GRPO_SHAPES.items():
        if name in run["traces"] and model in calibration:
            lengths = lengths_from_trace(run["traces"][name], calibration[model])
            out[name] = Workload(lengths, np.full(len(lengths), prompt), 1.0)
    if "long" in out:
        long = out["long"]
        out[f"long x{REPLICAS}"] = Workload(
            np.tile(long.output_lengths, REPLICAS), np.tile(long.prompt_lengths, REPLICAS), 1.0
        )
    return out


def modelled_report(latency: LatencyModel, source: str, run: dict) -> str:
    from grpo_specdec.simulate import (
        VLLM_EXAMPLE_TABLES,
        Workload,
        compare,
        recommend_table,
        replay,
    )
    from vllm_plugin.compat import dense_k_table

    calibration = run["calibration_conditional_acceptance"]
    acceptances = {
        label: EAGLE3_ASSUMED if policy is None else calibration[policy]
        for label, policy in ACCEPTANCES.items()
        if policy is None or policy in calibration
    }
    t, d = latency.target, latency.draft
    fields = {"flat": f"{t.flat:.2f}", "slope": f"{t.slope:.4f}", "knee": f"{t.knee:.0f}"}
    fields |= {"c_peak": f"{latency.c_peak:.0f}", "draft_base": f"{d.base:.2f}"}
    fields |= {"draft_per_seq": f"{d.per_seq:.4f}", "run": MEASURED_RUN, "replicas": REPLICAS}
    fields |= {"eagle3": EAGLE3_ASSUMED[0], "positions": len(EAGLE3_ASSUMED)}
    lines = [prose("gpu", "modelled", source=source, **fields)]
    for acc_name, conditional in acceptances.items():
        conditional = np.asarray(conditional, dtype=float)
        k_max = len(conditional)
        lines += ["", f"### Acceptance {acc_name}: {np.round(conditional, 2).tolist()}"]
        for shape, w in workloads(run).items():
            max_batch = max(len(w.output_lengths), 512)
            examples = {
                f"vLLM example table ({n})": dense_k_table(table, max_batch, k_max)
                for n, table in VLLM_EXAMPLE_TABLES.items()
            }
            recommended = recommend_table(latency, conditional, k_max, max_batch)
            recommended = dense_k_table(recommended, max_batch, k_max)
            replays = compare(latency, conditional, w, k_max, max_batch, recommended)
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
            speedup = r["no spec"].makespan_s / r["ours"].makespan_s
            fixed.append(f"B={b}: {speedup:.2f}x (TLT {TLT[b]:.2f}x)")
        lines.append(f"Fixed concurrency, 512 tokens each, ours vs no spec: {', '.join(fixed)}.")
    tlt = ", ".join(f"{v}x at {b}" for b, v in TLT.items())
    tables = "; ".join(f"{n} `{t}`" for n, t in VLLM_EXAMPLE_TABLES.items())
    lines += ["", prose("gpu", "published", tlt=tlt, tables=tables)]
    return "\n".join(lines)


def modelled(args) -> None:
    from grpo_specdec.simulate import load_profile

    if args.profile is None:
        PUBLISHED_PROFILE.write_text(json.dumps(published_profile(), indent=1))
        path = PUBLISHED_PROFILE
    else:
        path = Path(args.profile)
    latency, _ = load_profile(path)
    source = load_json(path).get("source", str(path))
    text = modelled_report(latency, source, load_json(ASSETS / f"{MEASURED_RUN}.json"))
    title = "What a GPU user can expect — MODELLED, not measured"
    write_study("gpu_modelled", title, text, "gpu.py modelled")
    print(text)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="the job's two learners on a GPU: step times, peak memory")
    c.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    c.add_argument("--layers", type=int, default=None, help="default: the model's own")
    c.add_argument("--device", default="cuda")
    c.add_argument("--samples", type=int, default=32)
    c.add_argument("--micro-batch", type=int, default=8)
    c.add_argument("--prompt-tokens", type=int, default=256)
    c.add_argument("--response-tokens", type=int, default=1024)
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--out", default=None, help=f"the JSON; default {CHECK_ASSET} and the study")
    p = sub.add_parser("profile", help="a GPU's latency profile, for the controller and simulator")
    p.add_argument("--model", choices=[s for s in SHAPES if s != "tiny"], default="llama3.1-8b")
    p.add_argument("--tiny", action="store_true", help="a tiny config, for tests on CPU")
    sizes = "1,2,4,8,16,32,64,96,128,192,256,384,512"
    p.add_argument("--sizes", default=sizes, help="tokens per step N")
    what = "KV tokens each sequence attends to; the first is the fit's"
    p.add_argument("--contexts", default="1024,4096", help=what)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", required=True)
    m = sub.add_parser("modelled", help="MODELLED: the CPU-measured rollouts on a GPU profile")
    what = "a GPU profile JSON (default: the published-figure one)"
    m.add_argument("--profile", default=None, help=what)
    args = ap.parse_args(argv)
    if args.command == "profile":
        profile(args)
    elif args.command == "modelled":
        modelled(args)
    else:
        data = check(args)
        if args.out:
            Path(args.out).write_text(json.dumps(data, indent=1))
            return
        CHECK_ASSET.write_text(json.dumps(data, indent=1))
        print(write_study("gpu_check", "The learners on a GPU", check_report(data), "gpu.py check"))


if __name__ == "__main__":
    main()
