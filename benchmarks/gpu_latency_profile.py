"""Step latency of a decoder and its one-layer EAGLE draft head on one GPU, as a latency
profile the controller and the simulator read. torch and transformers only: no vLLM, no hub
downloads (random weights from a config built by hand with the model's shapes).

    python benchmarks/gpu_latency_profile.py --model llama3.1-8b --out docs/assets/gpu_profile_h200_llama31_8b.json
    python benchmarks/gpu_latency_profile.py --tiny --sizes 1,4 --out /tmp/tiny.json   # any CPU

T(N): one target forward over N sequences decoding one token each, every one attending to a
static KV cache of `context` tokens, in bf16 and replayed from a CUDA graph (eager where no
GPU). The draft: fc(concat(embedding, hidden)) -> one decoder layer -> the target's lm_head
over N sequences. The hinge T(N) is fitted at the first context with the controller's
`fit_latency`; how T grows with context is the latency model's attention term, which the
controller and the simulator both price. About 2 minutes per model on an H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, StaticCache

from vllm_plugin.controller import LatencyModel, LinearCost, fit_latency

# hidden, layers, heads, kv heads, intermediate, vocab (the models' published configs)
SHAPES = {
    "qwen2.5-1.5b": (Qwen2Config, 1536, 28, 12, 2, 8960, 151936),
    "qwen2.5-7b": (Qwen2Config, 3584, 28, 28, 4, 18944, 152064),
    "llama3.1-8b": (LlamaConfig, 4096, 32, 32, 8, 14336, 128256),
    "tiny": (LlamaConfig, 64, 2, 4, 2, 128, 512),
}
KV_BUDGET_GIB = 60  # (size, context) points whose KV cache would exceed this are skipped


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


def kv_gib(config, batch: int, context: int) -> float:
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2
    return batch * (context + 1) * per_token / 2**30


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
    rows, graphed_all = [], True
    for context in contexts:
        for n in sizes:
            if kv_gib(config, n, context) > KV_BUDGET_GIB:
                log(f"skip N={n} context={context}: KV cache over {KV_BUDGET_GIB} GiB")
                continue
            target_ms, graphed = timer(
                decode_step(target, config, n, context, device), device, repeats
            )
            features = torch.zeros((n, 1, 2 * config.hidden_size), device=device, dtype=dtype)
            draft_ms, draft_graphed = timer(
                decode_step(draft, head_config, n, context, device, lambda f=features: fc(f)),
                device,
                repeats,
            )
            graphed_all &= graphed and draft_graphed
            rows.append(
                {"tokens": n, "context": context, "target_ms": target_ms, "draft_ms": draft_ms}
            )
            log(
                f"{name} N={n:4d} context={context:5d}: target {target_ms:7.3f} ms, draft {draft_ms:6.3f} ms"
            )
            torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows, graphed_all


def build_profile(name: str, rows: list[dict], graphed: bool, device) -> dict:
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
    return {
        "source": "measured by benchmarks/gpu_latency_profile.py (random weights, "
        f"{'CUDA graphs' if graphed else 'eager'}, bf16)",
        "model_shape": name,
        "hardware": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "latency": latency.to_dict(),
        "fit_rms_ms": rms,
        "measurements": rows,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", choices=[s for s in SHAPES if s != "tiny"], default="llama3.1-8b")
    ap.add_argument("--tiny", action="store_true", help="a tiny config, for tests on CPU")
    ap.add_argument(
        "--sizes", default="1,2,4,8,16,32,64,96,128,192,256,384,512", help="tokens per step N"
    )
    ap.add_argument(
        "--contexts",
        default="1024,4096",
        help="KV tokens each sequence attends to; the first is the fit's",
    )
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    name = "tiny" if args.tiny else args.model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("no GPU: only --tiny runs on CPU")
    sizes = [int(s) for s in args.sizes.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows, graphed = measure(name, sizes, contexts, args.repeats, device)
    profile = build_profile(name, rows, graphed, device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=1))
    t = profile["latency"]["target"]
    print(
        f"T(N) = {t['flat']:.3f} + {t['slope']:.4f} * max(N - {t['knee']:.0f}, 0) ms, "
        f"C_peak {profile['latency']['c_peak']:.0f} tokens -> {args.out}"
    )


if __name__ == "__main__":
    main()
