"""The policy's part of a checkpoint folder, written and read by its ranks.

`policy/` is a complete Hugging Face model, tokenizer included: the engines restart from
it as they would from any model folder. `policy_state.pt` holds what the model folder does
not: the optimiser state, the policy's version and torch's RNG, so that a resumed run
draws what the run it continues would have drawn.

Under several ranks (sharding.py) every rank must be called: the state is gathered from
all of them to rank 0, which alone writes the files, and on a load rank 0 alone reads them
and scatters them (the others only map the state file, for its structure).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_specdec.job import sharding
from grpo_specdec.learner_state import load_learner_state


def save_policy(
    folder: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    version: int,
    tokenizer_dir: str,
) -> None:
    """`model` (with the tokenizer of `tokenizer_dir`) and its training state into checkpoint
    `folder`."""
    weights, opt_state = sharding.full_state(model, opt)
    if rank != 0:
        return
    model.save_pretrained(folder / "policy", state_dict=untied(model, weights))
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder / "policy")
    torch.save(
        {"opt": opt_state, "version": version, "rng": torch.get_rng_state()},
        folder / "policy_state.pt",
    )


def load_policy(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> int:
    """`model` and `opt` as checkpoint `folder` holds them, and torch's RNG; -> the policy's
    version."""
    reads = rank == 0
    state = load_learner_state(folder / "policy_state.pt", mmap=not reads)
    weights = (
        AutoModelForCausalLM.from_pretrained(folder / "policy", dtype=model.dtype).state_dict()
        if reads
        else {}
    )
    sharding.load_full_state(model, opt, weights, state["opt"] if reads else {})
    torch.set_rng_state(state["rng"])
    return state["version"]


def untied(model: torch.nn.Module, sd: dict) -> dict:
    """`sd` without the lm_head a tied model shares with its embedding (a gathered state
    dict holds it as a tensor of its own, which HF would then write)."""
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd
