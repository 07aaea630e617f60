"""`grpo-specdec` command line. Parses arguments and hands off; the work lives in the modules."""

from __future__ import annotations

import argparse
import sys

from grpo_specdec import commands
from grpo_specdec.runtime import apply_runtime


def _draft_sampling_arg(parser) -> None:
    parser.add_argument(
        "--draft-sampling",
        default="greedy",
        choices=["greedy", "probabilistic"],
        help="the draft proposes its argmax (greedy) or samples from its distribution, "
        "which verification then takes into account (probabilistic)",
    )


def _max_model_len_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's limit, capped to what the KV cache holds)",
    )


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
    tiny.set_defaults(func=commands.models_tiny)
    prep = models.add_parser("prepare", help="convert a packaged GGUF into a vLLM-loadable folder")
    prep.add_argument("name", choices=["smollm2"])
    prep.add_argument("--out", default=None)
    prep.set_defaults(func=commands.models_prepare)

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
    gen.set_defaults(func=commands.generate)

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
    dimport.set_defaults(func=commands.draft_import)
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
    dtrain.set_defaults(func=commands.draft_train)

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
    prof.set_defaults(func=commands.profile)

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
    ev.set_defaults(func=commands.evaluate_policy)

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
    train.set_defaults(func=commands.train)

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
    sim.set_defaults(func=commands.simulate)
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
