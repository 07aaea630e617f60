"""`grpo-specdec profile`: measure engine step latency on this hardware and fit the roofline.

Real engine steps are timed: B sequences decoding together while the scheduler drafts a
fixed k each step, for a grid of B and k. Step time is the interval between successive
scheduler steps (model forward, sampling, drafting and bookkeeping: everything a step
costs). The fit gives T(n), the step latency with n = B * (k + 1) tokens in the target
forward, whose knee is C_peak, and D(B), the cost of one draft step over B sequences.
A few of the (B, k) are timed again at a long context (k = 0 and the largest k), for the
attention term: what each sequence and each query token pay per token of context they
attend to (the tail of a rollout runs there).
Two costs the controller does not price are timed for the rollout simulator
(`grpo_specdec.simulate.UnprofiledCosts`): each run's prefill step, per prompt token, and,
where the profile drafts greedily, a few steps again sampling at T = 1, per verified token.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
from pydantic import Field

from grpo_specdec.atomic_file import write_atomic
from grpo_specdec.config import DraftSampling, StrictModel
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings
from grpo_specdec.engine_config import Dtype
from grpo_specdec.tasks.arithmetic import make_problems
from vllm_plugin.controller import (
    FixedPolicy,
    fit_attention,
    fit_latency,
    own_steps,
    profile_latency,
    timed_temperature,
)
from vllm_plugin.settings import engine_shape, profile_key, store_path


class ProfileConfig(StrictModel):
    model: str
    draft: str = Field(description="EAGLE head: steps with k drafts per sequence are timed")
    draft_sampling: DraftSampling = Field(
        "greedy",
        description="probabilistic: time sampled drafting, with requests sampling at T = 1",
    )
    dtype: Dtype = "auto"
    k_max: int = Field(4, ge=1, le=16)
    batch_sizes: list[int] = [1, 2, 4, 8, 16, 32, 64]
    steps: int = Field(16, ge=4, description="decode steps timed per (B, k)")
    max_model_len: int | None = Field(None, ge=16, description="default: from the model")
    enforce_eager: bool = False


LONG_CONTEXT = 512  # prompt tokens of the long-context steps (at most half the context)
# Those of the profiled batch sizes timed at the long context and, for a greedy profile,
# sampling at T = 1: at k = 0 and k_max.
LONG_BATCHES = (1, 4, 16)


def _time_steps(
    engine: Engine,
    prompts: list[str] | list[list[int]],
    batch: int,
    k: int,
    steps: int,
    temperature: float = 0.0,
) -> tuple[list[float], float | None]:
    """Milliseconds of each decode-only step with exactly `batch` running and `k` drafted,
    and of the prefill: from the run's first step to its first decode-only one (None if
    the trace no longer holds the first)."""
    scheduler = engine.scheduler()
    scheduler.set_policy(FixedPolicy(k))
    engine.llm.reset_prefix_cache()  # every run prefills its prompts in full
    mark = scheduler.steps_scheduled
    # Enough tokens for `steps` decode steps even if every draft is accepted, plus a few
    # for prefill and the first step, whose draft length differs.
    engine.generate(
        prompts[:batch],
        SamplingSettings(
            temperature=temperature, max_tokens=(steps + 4) * (k + 1), ignore_eos=True
        ),
    )
    trace = scheduler.steps_since(mark)
    decode = [
        1000 * (after[0] - before[0])
        for before, after in zip(trace, trace[1:])
        if before[1] == batch and before[2] == k and before[3]
    ][:steps]
    first_decode = next((r[0] for r in trace if r[3]), None)
    whole = len(trace) == scheduler.steps_scheduled - mark
    prefill = 1000 * (first_decode - trace[0][0]) if whole and first_decode is not None else None
    return decode, prefill


def measure(cfg: ProfileConfig, log=print) -> tuple[list[dict], dict]:
    """The timed steps, and the engine they were timed on (`settings.engine_shape`)."""
    max_batch = max(cfg.batch_sizes)
    engine = Engine(
        EngineConfig(
            model=cfg.model,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=max_batch,
            enforce_eager=cfg.enforce_eager,
            # The fixed policy lets the profile set k per run; k = 0 turns drafting off.
            speculative={
                "draft": cfg.draft,
                "k": cfg.k_max,
                "draft_sampling": cfg.draft_sampling,
                "concurrency_aware": True,
                "controller": {"policy": "fixed", "fixed_k": cfg.k_max},
            },
        )
    )
    try:
        prompts = [engine.encode(p.question) for p in make_problems(max_batch, seed=1, level=2)]
        # The same prompts, each its own ids repeated to the long context's length.
        long = min(LONG_CONTEXT, engine.cfg.max_model_len // 2)
        long_prompts = [(p * (long // len(p) + 1))[:long] for p in prompts]
        temperature = timed_temperature(cfg.draft_sampling)
        # warm up every code path
        _time_steps(engine, prompts, max_batch, cfg.k_max, 4, temperature)
        if temperature == 0.0:
            _time_steps(engine, prompts, max_batch, cfg.k_max, 4, 1.0)
        ends = (0, cfg.k_max)
        grid = [(b, k, False, temperature) for b in cfg.batch_sizes for k in range(cfg.k_max + 1)]
        grid += [
            (b, k, True, temperature) for b in cfg.batch_sizes if b in LONG_BATCHES for k in ends
        ]
        if temperature == 0.0:
            grid += [(b, k, False, 1.0) for b in cfg.batch_sizes if b in LONG_BATCHES for k in ends]
        rows = []
        for batch, k, at_long, temp in grid:
            timed = long_prompts if at_long else prompts
            samples, prefill_ms = _time_steps(engine, timed, batch, k, cfg.steps, temp)
            prompt_tokens = sum(len(p) for p in timed[:batch])
            if k == 0 and not at_long and temp == temperature and prefill_ms is not None:
                rows.append(
                    {
                        "prefill": True,
                        "batch": batch,
                        "prompt_tokens": prompt_tokens,
                        "ms": prefill_ms,
                    }
                )
            if samples:
                ms = statistics.median(samples)
                # Mean context over the timed steps: the prompt, then about a token a step.
                context = prompt_tokens / batch + cfg.steps / 2
                rows.append(
                    {
                        "batch": batch,
                        "k": k,
                        "tokens": batch * (k + 1),
                        "ms": ms,
                        "samples": len(samples),
                        "context": context,
                        "long_context": at_long,
                        "temperature": temp,
                    }
                )
                log(
                    f"B={batch:4d} k={k} context {context:4.0f} T={temp:g}: {ms:7.2f} ms/step "
                    f"over {len(samples)} steps"
                )
        return rows, engine_shape(engine.llm.llm_engine.vllm_config)
    finally:
        engine.shutdown()


def build_profile(cfg: ProfileConfig, rows: list[dict], engine: dict) -> dict:
    """T, S and D fitted on the steps at short context, then the attention term on the
    long-context ones against that fit; the prefill and T = 1 sampling costs the
    simulator adds (`unprofiled`), where they were timed."""
    temperature = timed_temperature(cfg.draft_sampling)
    steps = [r for r in rows if not r.get("prefill")]
    short, long = own_steps(rows, cfg.draft_sampling)
    latency, rms = fit_latency(
        [r["batch"] for r in short], [r["k"] for r in short], [r["ms"] for r in short]
    )
    if long:
        latency = fit_attention(
            latency,
            *([r[f] for r in long] for f in ("batch", "k", "context", "ms")),
            reference=statistics.fmean(r["context"] for r in short),
        )
    sampled = [r for r in steps if r.get("temperature", temperature) != temperature]
    prefills = [r for r in rows if r.get("prefill")]
    unprofiled = {}
    if sampled:
        excess = [
            r["ms"] - float(latency.step_ms(r["batch"], r["k"], r["context"])) for r in sampled
        ]
        unprofiled["sampling_ms_per_token"] = max(
            0.0, _slope([r["tokens"] for r in sampled], excess, [r["ms"] for r in sampled])
        )
    if prefills:
        ms = [r["ms"] for r in prefills]
        unprofiled["prefill_ms_per_token"] = _slope([r["prompt_tokens"] for r in prefills], ms, ms)
    return {
        "key": profile_key(cfg.model, cfg.dtype, cfg.draft, cfg.draft_sampling),
        "engine": engine,
        "latency": latency.to_dict(),
        "unprofiled": unprofiled,
        "fit_rms_ms": rms,
        "measurements": rows,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _slope(x, y, scale) -> float:
    """The a of y = a x, least squares relative to `scale` (each step's time): a B = 1 step
    weighs as much as a B = 64 one."""
    x, y, scale = (np.asarray(v, dtype=float) for v in (x, y, scale))
    return float((x * y / scale**2).sum() / ((x / scale) ** 2).sum())


def plot_profile(profile: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latency = profile_latency(profile)
    temperature = timed_temperature(profile["key"].get("draft_sampling", "greedy"))
    rows = [  # the steps the latency model is fitted on
        r
        for r in profile["measurements"]
        if not r.get("prefill") and r.get("temperature", temperature) == temperature
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    n = np.array([r["tokens"] for r in rows], dtype=float)
    target_ms = np.array(
        [
            r["ms"]
            - float(
                latency.step_ms(r["batch"], r["k"], r.get("context")) - latency.target(r["tokens"])
            )
            for r in rows
        ]
    )
    ax1.scatter(
        n,
        target_ms,
        c=[r["k"] for r in rows],
        cmap="viridis",
        label="measured (draft cost removed)",
    )
    grid = np.linspace(1, n.max(), 400)
    ax1.plot(grid, latency.target(grid), "k-", label="fit T(n)")
    ax1.axvline(
        latency.c_peak,
        color="r",
        ls="--",
        label=f"C_peak = {latency.c_peak:.0f} tokens (T doubles)",
    )
    ax1.set(
        xscale="log",
        xlabel="tokens in the target forward n = B(k+1)",
        ylabel="ms",
        title="Step latency T(n)",
    )
    ax1.legend(fontsize=8)
    for k in sorted({r["k"] for r in rows}):
        pts = [(r["batch"], r["ms"]) for r in rows if r["k"] == k and not r.get("long_context")]
        b = np.array([p[0] for p in pts], dtype=float)
        ax2.scatter(b, [p[1] for p in pts], label=f"k={k}")
        ax2.plot(b, latency.step_ms(b, k), "--", lw=1)
    ax2.set(
        xscale="log",
        xlabel="concurrency B",
        ylabel="ms per step",
        title="Measured steps (points) vs model (dashed)",
    )
    ax2.legend(fontsize=8)
    fig.suptitle(
        f"{Path(profile['key']['model']).name} on {profile['key']['hardware']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_profile(
    cfg: ProfileConfig, out: str | Path, plot: str | Path | None = None, log=print
) -> dict:
    profile = build_profile(cfg, *measure(cfg, log))
    for path in {Path(out), store_path(profile["key"])}:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(profile, indent=1))
    if plot:
        plot_profile(profile, plot)
    lat = profile["latency"]
    log(
        f"C_peak {lat['c_peak']:.1f} tokens; T(n) = {lat['target']['flat']:.2f} + {lat['target']['slope']:.3f} * "
        f"max(n - {lat['target']['knee']:.0f}, 0) ms; D(B) = {lat['draft']['base']:.2f} + "
        f"{lat['draft']['per_seq']:.3f} B ms; attention {1e6 * lat['attention_per_seq']:.0f} ns per "
        f"sequence + {1e6 * lat['attention']:.0f} ns per query token, per context token beyond "
        f"{lat['context']:.0f}; rms {profile['fit_rms_ms']:.2f} ms"
    )
    extra = profile["unprofiled"]
    if extra:
        log(
            "for the simulator: "
            + "; ".join(
                f"{what} {1000 * extra[key]:.0f} µs per {unit}"
                for key, what, unit in (
                    ("prefill_ms_per_token", "prefill", "prompt token"),
                    ("sampling_ms_per_token", "sampling at T = 1", "verified token"),
                )
                if key in extra
            )
        )
    return profile
