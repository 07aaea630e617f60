"""Record a trace for the controller's regime suite (grpo_specdec/regimes.py).

Rolls out the demo recipe's prompts (arithmetic, levels 1-2) as the tail shape, each
sample its own request with a log-normal length budget around 128 tokens (cap 512), on
the project's engine with the given policy and EAGLE head, drafting a fixed k every step
(so that every output position is covered by a verified draft), sampling as the job
does (T = 0.7, probabilistic drafts); and saves, per request, its prompt and output
lengths, its first EOS and every verified draft (position, drafted, accepted), as the
scheduler saw them. `--ignore-eos` makes each request run to its budget past EOS, as the
benchmarks' equal-token rounds do. Step times are not recorded: the suite prices steps
from each profile.

    python benchmarks/regime_traces.py --name end --policy RUN/iter_10/policy \\
        --draft RUN/iter_10/draft --out tests/data/regimes/end.json.gz
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_specdec.engine import Engine, EngineConfig  # noqa: E402
from grpo_specdec.regimes import Request, Rollout, Trace  # noqa: E402
from grpo_specdec.tasks.arithmetic import make_problems  # noqa: E402
from grpo_specdec.tasks.length_budgets import with_budgets  # noqa: E402
from vllm_plugin.controller import FixedPolicy  # noqa: E402

CAP, MEDIAN, SIGMA = 512, 128, 0.7


def stop_ids(engine: Engine) -> set[int]:
    """The tokens that end an answer: the tokenizer's EOS and the generation config's."""
    ids = {engine.tokenizer.eos_token_id}
    config = Path(engine.cfg.model) / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def record_rollout(engine: Engine, questions, group, temperature, ignore_eos, seed) -> Rollout:
    from vllm import SamplingParams

    shape = with_budgets(questions, group, CAP, MEDIAN, SIGMA, seed)
    scheduler = engine.scheduler()
    prompt_ids = [engine.encode(p) for p in shape.prompts]
    params = [
        SamplingParams(temperature=temperature, max_tokens=budget, ignore_eos=ignore_eos)
        for budget in shape.max_tokens
    ]
    scheduler.draft_events.clear()
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    drafts = collections.defaultdict(list)
    for request_id, position, drafted, accepted, _ in scheduler.draft_events:
        drafts[request_id.rsplit("-", 1)[0]].append((position, drafted, accepted))
    eos_ids = stop_ids(engine)
    requests = []
    for prompt, out in zip(prompt_ids, outputs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        eos = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        requests.append(Request(len(prompt), len(tokens), eos, drafts[out.request_id]))
    return Rollout(requests)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--name", required=True)
    ap.add_argument("--policy", required=True, help="the policy's model folder")
    ap.add_argument("--draft", required=True, help="the EAGLE head's folder")
    ap.add_argument("--out", required=True, help="the trace file (.json.gz)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--rollouts", type=int, default=3, help="batches of prompts, in turn")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--k", type=int, default=4, help="draft tokens every step")
    ap.add_argument("--seed", type=int, default=1000, help="which problems and budgets")
    ap.add_argument("--source", default="", help="what the policy and head are, for the trace")
    args = ap.parse_args()
    engine = Engine(
        EngineConfig.model_validate(
            {
                "model": args.policy,
                "max_model_len": CAP + 256,
                "max_num_seqs": args.prompts * args.group,
                "speculative": {
                    "draft": args.draft,
                    "k": args.k,
                    "draft_sampling": "probabilistic",
                    "concurrency_aware": True,
                    "draft_watch": False,
                },
            }
        )
    )
    try:
        engine.scheduler().set_policy(FixedPolicy(args.k))
        rollouts = []
        for r in range(args.rollouts):
            half = args.prompts // 2
            seed = args.seed + r
            problems = make_problems(half, seed, 1) + make_problems(args.prompts - half, seed, 2)
            rollout = record_rollout(
                engine,
                [p.question for p in problems],
                args.group,
                args.temperature,
                args.ignore_eos,
                seed,
            )
            drafted = sum(len(q.drafts) for q in rollout.requests)
            print(f"{args.name}: rollout {r + 1}: {drafted} verified drafts", flush=True)
            rollouts.append(rollout)
    finally:
        engine.shutdown()
    source = (
        f"{args.source or f'policy {args.policy}, head {args.draft}'}; k = {args.k} every "
        f"step, T = {args.temperature}, {'EOS ignored' if args.ignore_eos else 'natural EOS'}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Trace(args.name, rollouts, args.temperature, source).save(args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
