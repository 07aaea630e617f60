"""What each `grpo-specdec` subcommand does, given its parsed arguments (`cli.py` parses
them): each builds its module's config from the arguments, runs it and prints or writes what
it gives. The heavy imports stay inside each command, so that `--help` and a missing extra
answer at once."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ready_head(draft: str, target: str, field: str) -> str:
    from grpo_specdec.draft.formats import ready_head as ready

    return ready(draft, target, field, log=lambda msg: print(msg, file=sys.stderr))


def models_tiny(args) -> None:
    from grpo_specdec.assets.tiny import build_tiny

    print(build_tiny(args.out, seed=args.seed, architecture=args.architecture))


def models_prepare(args) -> None:
    from grpo_specdec.assets.smollm2 import prepare_smollm2

    print(prepare_smollm2(args.out))


def _write_json(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1))


def generate(args) -> None:
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


def draft_import(args) -> None:
    from grpo_specdec.draft.formats import import_head

    print(import_head(args.head, args.target, args.out))


def draft_train(args) -> None:
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


def profile(args) -> None:
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


def train(args) -> None:
    from grpo_specdec.bench.compare import compare_rollout, comparison_table, what_is_compared
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
        comparison = job.compare_rollout(compare_rollout) if cfg.compare_at_end else None
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


def simulate(args) -> None:
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


def evaluate_policy(args) -> None:
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
