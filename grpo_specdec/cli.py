"""`grpo-specdec` command line. Parses arguments and hands off; the work lives in the modules."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grpo_specdec.runtime import apply_runtime


def ready_head(draft: str, target: str, field: str) -> str:
    from grpo_specdec.draft.formats import ready_head as ready

    return ready(draft, target, field, log=lambda msg: print(msg, file=sys.stderr))


def _models_tiny(args) -> None:
    from grpo_specdec.assets.tiny import build_tiny

    print(build_tiny(args.out, seed=args.seed, architecture=args.architecture))


def _models_prepare(args) -> None:
    from grpo_specdec.assets.smollm2 import prepare_smollm2

    print(prepare_smollm2(args.out))


def _draft_sampling_arg(parser) -> None:
    parser.add_argument(
        "--draft-sampling",
        default="greedy",
        choices=["greedy", "probabilistic"],
        help="the draft proposes its argmax (greedy) or samples from its distribution, "
        "which verification then takes into account (probabilistic)",
    )


def _write_json(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1))


def _generate(args) -> None:
    from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings, read_prompts_file

    prompts = read_prompts_file(args.prompts)
    speculative = None
    if args.draft:
        args.draft = ready_head(args.draft, args.model, "--draft")
        speculative = {"draft": args.draft, "k": args.k, "draft_sampling": args.draft_sampling}
        if args.concurrency_aware:
            controller = {
                "policy": args.policy,
                **({"profile": args.profile} if args.profile else {}),
            }
            speculative.update(concurrency_aware=True, controller=controller)
    elif args.concurrency_aware or args.draft_sampling != "greedy":
        raise ValueError("--concurrency-aware and --draft-sampling need --draft")
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        speculative=speculative,
        enforce_eager=args.eager,
    )
    sampling = SamplingSettings(
        n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    engine = Engine(cfg)
    result = engine.generate(prompts, sampling, chat=not args.raw, use_tqdm=True)
    _write_json(args.json, result.to_json())
    spec = result.spec
    print(
        f"{result.num_generated_tokens} tokens in {result.wall_s:.2f}s "
        f"({result.num_generated_tokens / result.wall_s:.1f} tok/s); "
        f"acceptance rate {spec['acceptance_rate']:.3f}, mean acceptance length "
        f"{spec['mean_acceptance_length']:.2f} -> {args.json}"
    )


def _draft_import(args) -> None:
    from grpo_specdec.draft.formats import import_head

    print(import_head(args.head, args.target, args.out))


def _draft_train(args) -> None:
    from grpo_specdec.draft.bootstrap import DraftBootstrapConfig, bootstrap_draft

    cfg = DraftBootstrapConfig(
        target=args.target,
        out=args.out,
        prompts=args.prompts,
        task=args.task,
        pairs=args.pairs,
        init=args.init and ready_head(args.init, args.target, "--init"),
        steps=args.steps,
        num_prompts=args.num_prompts,
        eval_prompts=args.eval_prompts,
        k=args.k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        enforce_eager=args.eager,
        draft_vocab=args.draft_vocab,
        eagle3=args.eagle3,
        draft_sampling=args.draft_sampling,
        gen_temperature=args.gen_temperature,
        max_model_len=args.max_model_len,
        train={
            "lr": args.lr,
            "batch_size": args.batch_size,
            "tv_weight": args.tv_weight,
            "ttt_steps": args.ttt_steps,
        },
    )
    report = bootstrap_draft(
        cfg, log=lambda msg: print(msg, file=sys.stderr if args.json else sys.stdout)
    )
    if args.json:
        _write_json(args.json, report)
    print(cfg.out)


def _profile(args) -> None:
    from grpo_specdec.profile import ProfileConfig, run_profile

    cfg = ProfileConfig(
        model=args.model,
        draft=ready_head(args.draft, args.model, "--draft"),
        draft_sampling=args.draft_sampling,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        k_max=args.k_max,
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        steps=args.steps,
        enforce_eager=args.eager,
    )
    run_profile(cfg, args.out, args.plot)
    print(args.out)


def _train(args) -> None:
    from grpo_specdec.bench.compare import comparison_table, what_is_compared
    from grpo_specdec.config import load_yaml
    from grpo_specdec.job.config import TrainConfig
    from grpo_specdec.job.metrics import held_out_line, summary_table
    from grpo_specdec.job.run import Job

    overrides = list(args.overrides)
    if args.ray_address:
        overrides.append(f"ray.address={args.ray_address}")
    cfg = load_yaml(TrainConfig, args.config, overrides)
    job = Job(cfg, resume=args.resume)
    try:
        records = job.run()
        comparison = job.compare_rollout() if cfg.compare_at_end else None
    finally:
        job.shutdown()
    print(summary_table(records))
    evals = Path(cfg.out) / "eval.jsonl"
    if evals.is_file():
        print(held_out_line([json.loads(x) for x in evals.read_text().splitlines()]))
    if comparison:
        r = cfg.rollout
        compared = what_is_compared(
            cfg.compare, r.prompts_per_iteration, r.group_size, r.max_tokens
        )
        print(comparison_table(comparison, compared))
        _write_json(str(Path(cfg.out) / "comparison.json"), comparison)
    print(job.vllm_log.summary())
    print(cfg.out)


def _simulate(args) -> None:
    from grpo_specdec.simulate import (
        Workload,
        compare,
        comparison_table,
        load_profile,
        named_lengths,
        read_acceptance,
        read_lengths,
        recommend_table,
    )

    latency, unprofiled = load_profile(args.profile)
    conditional = read_acceptance(args.acceptance)
    lengths = (
        read_lengths(args.lengths) if Path(args.lengths).is_file() else named_lengths(args.lengths)
    )
    workload = Workload(lengths, args.prompt_tokens, args.temperature)
    k_max = args.k_max or len(conditional)
    max_batch = max(args.max_batch or len(lengths), 1)
    table = None
    if args.static_table:
        from vllm_plugin.compat import dense_k_table

        table = dense_k_table(json.loads(args.static_table), max_batch, k_max)
    replays = compare(
        latency, conditional, workload, k_max, max_batch, table, unprofiled, args.draws
    )
    recommended = recommend_table(latency, conditional, k_max, max_batch)
    print(
        f"Modelled, not measured: {len(lengths)} requests replayed on the latency profile "
        f"{args.profile} with acceptance {[round(float(a), 3) for a in conditional]}, "
        + (
            f"the mean of {args.draws} replays with each step's tokens drawn from it"
            if args.draws
            else "each step advancing every request by its expected tokens"
        )
    )
    print(comparison_table(replays))
    print(f"recommended num_speculative_tokens_per_batch_size: {recommended}")
    if args.json:
        _write_json(
            args.json,
            {
                "policies": {
                    n: {
                        "makespan_s": r.makespan_s,
                        "tokens_per_s": r.tokens_per_s,
                        "tail_s": r.tail_s,
                        "mal": r.mal,
                        "steps": r.steps,
                    }
                    for n, r in replays.items()
                },
                "recommended_table": recommended,
            },
        )


def _max_model_len_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's limit, capped to what the KV cache holds)",
    )


def _eval(args) -> None:
    from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings
    from grpo_specdec.evaluate import (
        arithmetic_eval_set,
        evaluate,
        file_eval_set,
        policy_folder,
        report_line,
    )
    from grpo_specdec.job.models import resolve_model

    args.reward = args.reward or ("math_verify" if args.data else "number")
    if args.data:
        examples = file_eval_set(args.data, args.reward, args.num)
    else:
        levels = [int(x) for x in args.levels.split(",")]
        if any(not 1 <= lvl <= 4 for lvl in levels):
            raise ValueError(f"--levels must lie in 1..4, got {args.levels}")
        examples = arithmetic_eval_set(args.seed, levels, args.num or 200)
    model = resolve_model(args.model)
    model = model if model != args.model else policy_folder(args.model)
    engine = Engine(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            # the model's own limit (8192 for SmolLM2) makes every CPU decode step several
            # times slower: a held-out prompt and its answer need far less
            max_model_len=args.max_model_len or 1024,
            kv_cache_gib=args.kv_cache_gib,
            seed=0,
            enforce_eager=args.eager,
        )
    )

    def generate(prompts: list[str], sampling: dict) -> list[list[str]]:
        result = engine.generate(prompts, SamplingSettings(**sampling, seed=0))
        return [[s.text for s in group] for group in result.outputs]

    try:
        report = evaluate(
            generate, examples, args.max_tokens, args.samples, args.temperature, args.reward
        )
    finally:
        engine.shutdown()
    report |= {"model": model, "data": args.data or f"arithmetic levels {args.levels}"}
    if args.json:
        _write_json(args.json, report)
    print(report_line(report))


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The engine settings of a command that starts one engine."""
    p.add_argument("--dtype", default="auto")
    _max_model_len_arg(p)
    p.add_argument(
        "--kv-cache-gib", type=float, default=None, help="default: 1 GiB on CPU, vLLM's on a GPU"
    )
    p.add_argument("--eager", action="store_true", help="skip torch.compile (faster start)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo-specdec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="build or prepare model assets").add_subparsers(
        dest="what", required=True
    )
    tiny = models.add_parser("tiny", help="deterministic tiny target + EAGLE drafts for tests")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--architecture",
        default="llama",
        choices=["llama", "qwen2", "qwen3"],
        help="the target's: Llama, Qwen2 (q/k/v bias) or Qwen3 (q/k norms, untied lm_head)",
    )
    tiny.set_defaults(func=_models_tiny)
    prep = models.add_parser("prepare", help="convert a packaged GGUF into a vLLM-loadable folder")
    prep.add_argument("name", choices=["smollm2"])
    prep.add_argument("--out", default=None)
    prep.set_defaults(func=_models_prepare)

    gen = sub.add_parser("generate", help="generate with vLLM, optionally with EAGLE speculation")
    gen.add_argument("--model", required=True)
    gen.add_argument("--draft", default=None, help="EAGLE draft head folder")
    gen.add_argument("--k", type=int, default=3, help="draft tokens per step")
    gen.add_argument(
        "--concurrency-aware", action="store_true", help="choose k (0..--k) every step"
    )
    _draft_sampling_arg(gen)
    gen.add_argument("--profile", default=None, help="latency profile (default: the profile store)")
    gen.add_argument("--policy", default="goodput", choices=["goodput", "paper", "fixed"])
    gen.add_argument("--prompts", required=True, help="file with one prompt per line")
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--raw", action="store_true", help="send prompts as raw text, no chat template"
    )
    _engine_args(gen)
    gen.add_argument("--json", required=True, help="where to write the outputs and metrics")
    gen.set_defaults(func=_generate)

    draft = sub.add_parser("draft", help="EAGLE draft heads").add_subparsers(
        dest="what", required=True
    )
    dimport = draft.add_parser(
        "import",
        help="a published head (EAGLE-1, EAGLE-3, speculators layouts) in the layout vLLM serves "
        "and the job keeps learning",
    )
    dimport.add_argument("--head", required=True, help="the published head's folder")
    dimport.add_argument("--target", required=True, help="the target model folder it drafts for")
    dimport.add_argument("--out", required=True)
    dimport.set_defaults(func=_draft_import)
    dtrain = draft.add_parser("train", help="train a draft head on the target's own generations")
    dtrain.add_argument("--target", required=True)
    src = dtrain.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="file with one prompt per line")
    src.add_argument("--task", choices=["arithmetic"], help="generated task prompts")
    src.add_argument("--pairs", help="JSONL of {prompt, response} to train on as is")
    dtrain.add_argument("--init", default=None, help="start from this head instead of a new one")
    dtrain.add_argument("--out", required=True)
    dtrain.add_argument("--steps", type=int, default=400)
    dtrain.add_argument("--num-prompts", type=int, default=512)
    dtrain.add_argument(
        "--eval-prompts",
        type=int,
        default=32,
        help="prompts acceptance is measured on before and after (from --prompts or --pairs: "
        "a tenth held out, at least 8, at most this; a file too small to spare them is measured "
        "in-sample)",
    )
    dtrain.add_argument("--k", type=int, default=3, help="draft tokens per step when measuring")
    dtrain.add_argument("--max-tokens", type=int, default=128)
    dtrain.add_argument(
        "--gen-temperature", type=float, default=0.7, help="temperature of the training samples"
    )
    dtrain.add_argument(
        "--tv-weight",
        type=float,
        default=0.0,
        help="add TV(p, q) at T=1 to the loss: trains for sampled drafting's acceptance",
    )
    _draft_sampling_arg(dtrain)
    dtrain.add_argument("--lr", type=float, default=1e-3)
    dtrain.add_argument("--batch-size", type=int, default=8)
    dtrain.add_argument("--seed", type=int, default=0)
    dtrain.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft over only the N most frequent tokens (EAGLE-3 format, d2t map)",
    )
    dtrain.add_argument(
        "--eagle3",
        action="store_true",
        help="a true EAGLE-3 head: reads three of the target's layers (vLLM's default "
        "auxiliary layers) fused, trained unrolled on its own features",
    )
    dtrain.add_argument(
        "--ttt-steps",
        type=int,
        default=None,
        help="draft steps the loss unrolls (training-time test); default 3 with --eagle3, else 1",
    )
    _max_model_len_arg(dtrain)
    dtrain.add_argument("--eager", action="store_true")
    dtrain.add_argument("--json", default=None, help="write the report here")
    dtrain.set_defaults(func=_draft_train)

    prof = sub.add_parser(
        "profile", help="measure step latency vs tokens per step; fit the roofline"
    )
    prof.add_argument("--model", required=True)
    prof.add_argument(
        "--draft", required=True, help="EAGLE head: steps with k drafts are what is timed"
    )
    prof.add_argument("--out", required=True, help="PROFILE.json (also saved to the profile store)")
    prof.add_argument("--plot", default=None, help="PNG of T(n) with its knee")
    prof.add_argument("--dtype", default="auto")
    _max_model_len_arg(prof)
    prof.add_argument("--k-max", type=int, default=4)
    _draft_sampling_arg(prof)
    prof.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    prof.add_argument("--steps", type=int, default=16)
    prof.add_argument("--eager", action="store_true")
    prof.set_defaults(func=_profile)

    ev = sub.add_parser(
        "eval", help="held-out accuracy of a policy: greedy, with a 95%% interval (and mean@G)"
    )
    ev.add_argument(
        "--model",
        required=True,
        help="a model folder, 'smollm2', a checkpoint folder or a run folder (its latest)",
    )
    ev.add_argument(
        "--data",
        default=None,
        help="held-out problems: JSONL (GSM8K's fields), parquet (verl's) or a datasets folder",
    )
    ev.add_argument(
        "--reward",
        default=None,
        choices=["math_verify", "number"],
        help="the grader (tasks/rewards.py); default: number for the arithmetic task (as its "
        "recipe trains), math_verify with --data (as the job's default)",
    )
    ev.add_argument(
        "--task",
        default="arithmetic",
        choices=["arithmetic"],
        help="without --data: the arithmetic task's held-out split (never trained on)",
    )
    ev.add_argument("--levels", default="1,2", help="arithmetic levels, in turn")
    ev.add_argument("--seed", type=int, default=0, help="the training data's seed (data.seed)")
    ev.add_argument("--num", type=int, default=None, help="examples (default: 200 / the file)")
    ev.add_argument("--max-tokens", type=int, default=256)
    ev.add_argument("--samples", type=int, default=0, help="also mean@G over G samples")
    ev.add_argument("--temperature", type=float, default=1.0, help="of the --samples")
    _engine_args(ev)
    ev.add_argument("--json", default=None, help="also write the report here")
    ev.set_defaults(func=_eval)

    train = sub.add_parser("train", help="run the GRPO job on Ray")
    train.add_argument("--config", required=True, help="configs/NAME.yaml")
    train.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. iterations=4 rollout.k=3"
    )
    train.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (default: RAY_ADDRESS or a local one)",
    )
    train.add_argument("--resume", default=None, help="a run folder or checkpoint to continue from")
    train.set_defaults(func=_train)

    sim = sub.add_parser(
        "simulate",
        help="predict a rollout's makespan under each speculation policy from a latency "
        "profile and an acceptance model",
    )
    sim.add_argument("--profile", required=True, help='PROFILE.json: {"latency": ...}')
    sim.add_argument(
        "--acceptance",
        required=True,
        help="conditional acceptance per draft position: 0.6,0.5,... or a JSON file (a list "
        'or {"conditional": [...]})',
    )
    sim.add_argument(
        "--lengths",
        required=True,
        help="per-request output lengths: a file (JSON list or one per line) or a shape "
        "(fixed:N:L, lognormal:N:MEDIAN:SIGMA:CAP)",
    )
    sim.add_argument("--prompt-tokens", type=int, default=64)
    sim.add_argument("--temperature", type=float, default=1.0)
    sim.add_argument("--k-max", type=int, default=None, help="default: acceptance positions")
    sim.add_argument("--max-batch", type=int, default=None, help="default: the requests")
    sim.add_argument(
        "--static-table",
        default=None,
        help="vLLM's num_speculative_tokens_per_batch_size as JSON, e.g. [[1,64,3],[65,512,0]]",
    )
    sim.add_argument(
        "--draws",
        type=int,
        default=32,
        help="replays per policy with each request's accepted drafts drawn, averaged; 0: one "
        "replay of the expected tokens per step, which misses that a batch ends with its "
        "unluckiest request",
    )
    sim.add_argument("--json", default=None, help="also write every replay here")
    sim.set_defaults(func=_simulate)
    return p


# What the `job` extra installs, by import name: the command line drives the job's side.
JOB_EXTRA_MODULES = ("transformers", "yaml", "ray", "matplotlib", "math_verify", "datasets")


def require_job_extra() -> None:
    """Exit with the install command when the `job` extra is missing (a plugin-only install
    has the package's modules but not what the job imports)."""
    import importlib.util

    missing = [m for m in JOB_EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"grpo-specdec: error: the command line needs the job extra, which this install "
            f"lacks (no {', '.join(missing)}): pip install 'grpo-specdec[job]'",
            file=sys.stderr,
        )
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    require_job_extra()
    apply_runtime(argv)
    args = build_parser().parse_args(argv)
    from grpo_specdec.config import ConfigError
    from grpo_specdec.job.restarts import CallPastDeadline, JobStopped

    try:
        args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, JobStopped, CallPastDeadline) as err:
        print(f"grpo-specdec: error: {err}", file=sys.stderr)
        sys.exit(2)
