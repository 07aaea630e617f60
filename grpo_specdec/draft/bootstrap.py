"""`grpo-specdec draft train`: bootstrap or refresh an EAGLE head for a target model.

One vLLM engine serves the whole run: it measures acceptance of the starting head on
held-out prompts, generates the training responses (speculation is lossless, so they are
plain target samples), then receives the trained head by hot-swap and measures again.
The report says how many prompts and draft tokens each figure rests on, and warns where
they are too few to tell two heads apart.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from pydantic import Field, model_validator
from transformers import AutoModelForCausalLM

from grpo_specdec.config import DraftSampling, StrictModel
from grpo_specdec.draft.capture import Sequence, capture_hidden
from grpo_specdec.draft.head import draft_vocabulary, eagle3_aux_layers, load_head, new_head
from grpo_specdec.draft.trainer import DraftTrainConfig, DraftTrainer
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings, read_prompts_file
from grpo_specdec.tasks.arithmetic import make_problems
from vllm_plugin.controller import FixedPolicy

# Below these, a before/after figure can rest on next to nothing: a tenth of a 12-prompt
# file once held out one prompt, whose greedy answer was 2 tokens.
MIN_EVAL_PROMPTS = 8
MIN_EVAL_DRAFT_TOKENS = 100  # a rate's standard error is then at most 0.05 (independent draws)


class DraftBootstrapConfig(StrictModel):
    target: str
    out: str
    prompts: str | None = None
    task: Literal["arithmetic"] | None = None
    pairs: str | None = Field(
        None, description="JSONL of {prompt, response} to train on instead of generating"
    )
    init: str | None = None
    steps: int = Field(400, ge=1)
    num_prompts: int = Field(512, ge=1, description="training prompts drawn from --task")
    eval_prompts: int = Field(
        32,
        ge=1,
        description="prompts acceptance is measured on; from a file, a tenth is held out, "
        f"at least {MIN_EVAL_PROMPTS} and at most this",
    )
    k: int = Field(3, ge=1)
    draft_sampling: DraftSampling = Field(
        "greedy", description="how the draft proposes while acceptance is measured"
    )
    gen_temperature: float = Field(0.7, ge=0)
    max_tokens: int = Field(128, ge=1)
    max_model_len: int | None = Field(None, ge=64, description="default: from the model")
    seed: int = 0
    enforce_eager: bool = False
    draft_vocab: int | None = Field(
        None, ge=16, description="reduced draft vocabulary (EAGLE-3 format)"
    )
    eagle3: bool = Field(
        False,
        description="a true EAGLE-3 head: three of the target's layers fused (vLLM's default "
        "auxiliary layers), trained unrolled (train.ttt_steps)",
    )
    train: DraftTrainConfig = DraftTrainConfig(lr=1e-3, batch_size=8)

    @model_validator(mode="after")
    def _one_source(self) -> DraftBootstrapConfig:
        given = [x for x in (self.prompts, self.task, self.pairs) if x]
        if len(given) != 1:
            raise ValueError("give exactly one of --prompts FILE, --task NAME or --pairs JSONL")
        return self


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    pairs = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pairs.append((str(row["prompt"]), str(row["response"])))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(
                f"{path} line {lineno}: expected a JSON object with prompt and response ({err})"
            ) from None
    if not pairs:
        raise ValueError(f"{path} holds no prompt/response pairs")
    return pairs


class Split(NamedTuple):
    train: list  # prompts, or (prompt, response) pairs with --pairs
    eval_prompts: list[str]
    held_out: bool  # False: the evaluation prompts are training prompts too


def _hold_out(items: list, cfg: DraftBootstrapConfig) -> tuple[list, list, bool]:
    """A tenth of a file's items held out for evaluation, at least MIN_EVAL_PROMPTS and at
    most cfg.eval_prompts; a file too small to spare them and keep as many for training
    is measured on its own training items."""
    items = list(items)
    random.Random(cfg.seed).shuffle(items)
    n_eval = min(cfg.eval_prompts, max(MIN_EVAL_PROMPTS, len(items) // 10))
    if len(items) < 2 * n_eval:
        return items, items[: cfg.eval_prompts], False
    return items[n_eval:], items[:n_eval], True


def split_prompts(cfg: DraftBootstrapConfig) -> Split:
    if cfg.task:
        train = [
            p.question
            for lvl in (1, 2, 3)
            for p in make_problems(cfg.num_prompts // 3 + 1, cfg.seed, lvl)
        ]
        held = [
            p.question
            for lvl in (1, 2, 3)
            for p in make_problems(cfg.eval_prompts // 3 + 1, cfg.seed + 10_000, lvl)
        ]
        return Split(train[: cfg.num_prompts], held[: cfg.eval_prompts], True)
    if cfg.pairs:
        train, held, held_out = _hold_out(read_pairs(cfg.pairs), cfg)
        return Split(train, [prompt for prompt, _ in held], held_out)
    return Split(*_hold_out(read_prompts_file(cfg.prompts), cfg))


def _acceptance(engine: Engine, prompts: list[str], cfg: DraftBootstrapConfig) -> dict:
    engine.scheduler().set_policy(FixedPolicy(cfg.k))
    out = {}
    for name, temperature in (("greedy", 0.0), ("temperature_1", 1.0)):
        res = engine.generate(
            prompts,
            SamplingSettings(temperature=temperature, max_tokens=cfg.max_tokens, seed=cfg.seed),
        )
        out[name] = {
            "prompts": len(prompts),
            "generated_tokens": res.num_generated_tokens,
            **{
                k: res.spec[k]
                for k in (
                    "draft_tokens",
                    "mean_acceptance_length",
                    "acceptance_rate",
                    "per_position_acceptance",
                )
            },
        }
    return out


def prompt_warnings(split: Split) -> list[str]:
    """What makes the evaluation prompts weak evidence, whatever the heads draft."""
    warnings = []
    if not split.held_out:
        warnings.append(
            f"acceptance is measured on {len(split.eval_prompts)} training prompts, not "
            f"held-out ones (holding out {MIN_EVAL_PROMPTS} needs {2 * MIN_EVAL_PROMPTS} "
            "prompts or more)"
        )
    if len(split.eval_prompts) < MIN_EVAL_PROMPTS:
        warnings.append(
            f"acceptance is measured on {len(split.eval_prompts)} prompts, fewer than "
            f"{MIN_EVAL_PROMPTS} (--eval-prompts, or a longer prompts file)"
        )
    return warnings


def draft_token_warnings(when: str, acc: dict) -> list[str]:
    """The figures of one measurement (`_acceptance`) that rest on too few draft tokens."""
    return [
        f"{when}: the {mode} figure rests on {m['draft_tokens']} draft tokens, fewer than "
        f"{MIN_EVAL_DRAFT_TOKENS}: too few to compare heads (more prompts or --max-tokens)"
        for mode, m in acc.items()
        if m["draft_tokens"] < MIN_EVAL_DRAFT_TOKENS
    ]


def _training_sequences(cfg: DraftBootstrapConfig, engine: Engine, train: list) -> list[Sequence]:
    if cfg.pairs:
        seqs = []
        for prompt, response in train:
            ids = engine.encode(prompt)
            seqs.append(
                Sequence(
                    ids + engine.tokenizer.encode(response, add_special_tokens=False), len(ids)
                )
            )
        return seqs
    sampling = SamplingSettings(
        temperature=cfg.gen_temperature, max_tokens=cfg.max_tokens, seed=cfg.seed
    )
    engine.scheduler().set_policy(FixedPolicy(0))  # the starting head may be untrained
    res = engine.generate(train, sampling, use_tqdm=True)
    return [
        Sequence(p + g[0].token_ids, len(p))
        for p, g in zip(res.prompt_token_ids, res.outputs, strict=True)
    ]


def _train(cfg: DraftBootstrapConfig, trainer: DraftTrainer, seqs: list[Sequence], log) -> dict:
    rng = random.Random(cfg.seed)
    stats: dict = {}
    for step in range(cfg.steps):
        stats = trainer.step(rng.sample(seqs, min(cfg.train.batch_size, len(seqs))))
        if step % 50 == 0 or step == cfg.steps - 1:
            log(f"step {step}: loss {stats['loss']:.4f} top1 {stats['top1']:.3f}")
    return stats


def _log_acceptance(log, when: str, acc: dict, k: int, held_out: bool) -> list[str]:
    """Log one measurement and its warnings; returns the warnings."""
    greedy, sampled = acc["greedy"], acc["temperature_1"]
    log(
        f"{when}: mean acceptance length {greedy['mean_acceptance_length']:.2f} (greedy, "
        f"{greedy['draft_tokens']} draft tokens), {sampled['mean_acceptance_length']:.2f} "
        f"(T=1, {sampled['draft_tokens']} draft tokens) at k={k} on {greedy['prompts']} "
        f"{'held-out' if held_out else 'training'} prompts"
    )
    return _log_warnings(log, draft_token_warnings(when, acc))


def _log_warnings(log, warnings: list[str]) -> list[str]:
    for warning in warnings:
        log(f"warning: {warning}")
    return warnings


def _measuring_engine(cfg: DraftBootstrapConfig, draft_dir: str) -> Engine:
    # A fixed-k scheduler lets one engine measure at k and generate at k = 0.
    return Engine(
        EngineConfig(
            model=cfg.target,
            max_model_len=cfg.max_model_len,
            seed=cfg.seed,
            enforce_eager=cfg.enforce_eager,
            speculative={
                "draft": draft_dir,
                "k": cfg.k,
                "draft_sampling": cfg.draft_sampling,
                "concurrency_aware": True,
                "controller": {"policy": "fixed"},
            },
        )
    )


def bootstrap_draft(cfg: DraftBootstrapConfig, log=print) -> dict:
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(cfg.target).eval()
    split = split_prompts(cfg)
    warnings = _log_warnings(log, prompt_warnings(split))
    with tempfile.TemporaryDirectory() as tmp:
        aux = eagle3_aux_layers(target.config.num_hidden_layers) if cfg.eagle3 else None
        head = (
            load_head(cfg.init, cfg.target, target)
            if cfg.init
            else new_head(cfg.target, target, cfg.seed, aux_layers=aux)
        )
        # The engine reads its starting head's files again if a swap has to be undone.
        start_dir = cfg.init or str(head.save(Path(tmp) / "start"))
        engine = _measuring_engine(cfg, start_dir)
        try:
            t = time.perf_counter()
            seqs = _training_sequences(cfg, engine, split.train)
            seconds["generate_s"] = time.perf_counter() - t
            if cfg.draft_vocab and not cfg.init:
                # The vocabulary comes from the data: rebuild the head and its engine.
                engine.shutdown()
                eos = target.config.eos_token_id
                vocab = draft_vocabulary(
                    seqs, cfg.draft_vocab, eos if isinstance(eos, list) else [eos]
                )
                head = new_head(cfg.target, target, cfg.seed, vocab_ids=vocab, aux_layers=aux)
                start_dir = str(head.save(Path(tmp) / "start_reduced"))
                engine = _measuring_engine(cfg, start_dir)
            trainer = DraftTrainer(head, cfg.train)
            before = _acceptance(engine, split.eval_prompts, cfg)
            warnings += _log_acceptance(log, "before", before, cfg.k, split.held_out)
            t = time.perf_counter()
            capture_hidden(target, seqs, aux_layers=head.aux_layers)
            seconds["capture_s"] = time.perf_counter() - t
            t = time.perf_counter()
            stats = _train(cfg, trainer, seqs, log)
            seconds["train_s"] = time.perf_counter() - t
            head.save(cfg.out)
            swap = engine.swap_weights(
                "draft", head.export_state_dict(head.export_dtype()), 1, head.swap_metadata()
            )
            after = _acceptance(engine, split.eval_prompts, cfg)
            warnings += _log_acceptance(log, "after", after, cfg.k, split.held_out)
        finally:
            engine.shutdown()
    seconds["total_s"] = time.perf_counter() - t0
    return {
        "out": str(Path(cfg.out)),
        "architecture": head.ARCHITECTURE,
        "draft_vocab_size": head.config.get("draft_vocab_size", head.vocab_size),
        "k": cfg.k,
        "eval": {"prompts": len(split.eval_prompts), "held_out": split.held_out},
        "before": before,
        "after": after,
        "warnings": warnings,
        "train": {
            "last_step": {k: v for k, v in stats.items() if k != "skipped"},
            "steps": trainer.steps,
            "skipped_steps": trainer.skipped_steps,
            "sequences": len(seqs),
        },
        "swap": swap,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
    }
