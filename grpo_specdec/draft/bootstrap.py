"""`grpo-specdec draft train`: bootstrap or refresh an EAGLE head for a target model.

One vLLM engine serves the whole run: it measures acceptance of the starting head on
held-out prompts, generates the training responses (speculation is lossless, so they are
plain target samples), then receives the trained head by hot-swap and measures again.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from transformers import AutoModelForCausalLM

from grpo_specdec.config import DraftSampling, StrictModel
from grpo_specdec.draft.capture import Sequence, capture_hidden
from grpo_specdec.draft.head import draft_vocabulary, load_head, new_head
from grpo_specdec.draft.trainer import DraftTrainConfig, DraftTrainer
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings, read_prompts_file
from grpo_specdec.tasks.arithmetic import make_problems
from vllm_plugin.controller import FixedPolicy


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
    eval_prompts: int = Field(32, ge=1)
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


def _prompt_split(cfg: DraftBootstrapConfig) -> tuple[list[str], list[str]]:
    """(training prompts, held-out evaluation prompts)."""
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
        return train[: cfg.num_prompts], held[: cfg.eval_prompts]
    prompts = [p for p, _ in read_pairs(cfg.pairs)] if cfg.pairs else read_prompts_file(cfg.prompts)
    prompts = list(prompts)
    random.Random(cfg.seed).shuffle(prompts)
    n_eval = min(cfg.eval_prompts, max(1, len(prompts) // 10))
    return prompts[n_eval:], prompts[:n_eval]


def _acceptance(engine: Engine, prompts: list[str], cfg: DraftBootstrapConfig) -> dict:
    engine.scheduler().set_policy(FixedPolicy(cfg.k))
    out = {}
    for name, temperature in (("greedy", 0.0), ("temperature_1", 1.0)):
        res = engine.generate(
            prompts,
            SamplingSettings(temperature=temperature, max_tokens=cfg.max_tokens, seed=cfg.seed),
        )
        out[name] = {
            k: res.spec[k]
            for k in ("mean_acceptance_length", "acceptance_rate", "per_position_acceptance")
        }
    return out


def _training_sequences(
    cfg: DraftBootstrapConfig, engine: Engine, prompts: list[str]
) -> list[Sequence]:
    if cfg.pairs:
        seqs = []
        for prompt, response in read_pairs(cfg.pairs):
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
    res = engine.generate(prompts, sampling, use_tqdm=True)
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


def _log_acceptance(log, when: str, acc: dict, k: int) -> None:
    log(
        f"{when}: mean acceptance length {acc['greedy']['mean_acceptance_length']:.2f} (greedy), "
        f"{acc['temperature_1']['mean_acceptance_length']:.2f} (T=1) at k={k}"
    )


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
    train_prompts, eval_prompts = _prompt_split(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        head = (
            load_head(cfg.init, cfg.target, target)
            if cfg.init
            else new_head(cfg.target, target, cfg.seed)
        )
        # The engine reads its starting head's files again if a swap has to be undone.
        start_dir = cfg.init or str(head.save(Path(tmp) / "start"))
        engine = _measuring_engine(cfg, start_dir)
        try:
            t = time.perf_counter()
            seqs = _training_sequences(cfg, engine, train_prompts)
            seconds["generate_s"] = time.perf_counter() - t
            if cfg.draft_vocab and not cfg.init:
                # The vocabulary comes from the data: rebuild the head and its engine.
                engine.shutdown()
                eos = target.config.eos_token_id
                vocab = draft_vocabulary(
                    seqs, cfg.draft_vocab, eos if isinstance(eos, list) else [eos]
                )
                head = new_head(cfg.target, target, cfg.seed, vocab_ids=vocab)
                start_dir = str(head.save(Path(tmp) / "start_reduced"))
                engine = _measuring_engine(cfg, start_dir)
            trainer = DraftTrainer(head, cfg.train)
            before = _acceptance(engine, eval_prompts, cfg)
            _log_acceptance(log, "before", before, cfg.k)
            t = time.perf_counter()
            capture_hidden(target, seqs)
            seconds["capture_s"] = time.perf_counter() - t
            t = time.perf_counter()
            stats = _train(cfg, trainer, seqs, log)
            seconds["train_s"] = time.perf_counter() - t
            head.save(cfg.out)
            swap = engine.swap_weights(
                "draft", head.export_state_dict(head.export_dtype()), 1, head.swap_metadata()
            )
            after = _acceptance(engine, eval_prompts, cfg)
            _log_acceptance(log, "after", after, cfg.k)
        finally:
            engine.shutdown()
    seconds["total_s"] = time.perf_counter() - t0
    return {
        "out": str(Path(cfg.out)),
        "architecture": head.ARCHITECTURE,
        "draft_vocab_size": head.config.get("draft_vocab_size", head.vocab_size),
        "k": cfg.k,
        "before": before,
        "after": after,
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
