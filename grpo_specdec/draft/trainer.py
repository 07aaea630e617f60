"""AdamW on the draft head, with gradient clipping and a guard against non-finite steps."""

from __future__ import annotations

import math
import random

import torch
from pydantic import Field

from grpo_specdec.config import StrictModel
from grpo_specdec.draft.capture import Sequence
from grpo_specdec.draft.head_model import DraftHead
from grpo_specdec.draft.loss import eagle_loss, make_batch
from grpo_specdec.learner_state import configured_settings_kept


class DraftTrainConfig(StrictModel):
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    hidden_weight: float = Field(2.0, ge=0)
    ce_weight: float = Field(0.1, ge=0)
    tv_weight: float = Field(
        0.0,
        ge=0,
        description="weight of TV(p, q) at `temperature`: 1 minus a sampled draft's acceptance",
    )
    temperature: float = Field(
        1.0, gt=0, description="the sampling temperature whose acceptance tv_weight trains for"
    )
    ttt_steps: int | None = Field(
        None,
        ge=1,
        le=8,
        description="draft steps the loss unrolls on the draft's own features (training-time "
        "test); default: 3 for an EAGLE-3 head, 1 (teacher-forced) for the others",
    )
    batch_size: int = Field(8, ge=1)
    epochs: int = Field(1, ge=1, description="passes over each rollout's sequences")


class DraftTrainer:
    """Plain-Python trainer; the Ray DraftLearner is a shell over it."""

    def __init__(self, head: DraftHead, cfg: DraftTrainConfig):
        self.head, self.cfg = head, cfg
        params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.steps = 0
        self.skipped_steps = 0
        self.ttt_steps = cfg.ttt_steps or (3 if head.aux_layers else 1)

    def step(self, seqs: list[Sequence]) -> dict:
        """One optimiser step. Non-finite loss or gradients skip it and leave weights untouched."""
        self.head.train()
        self.opt.zero_grad(set_to_none=True)
        cfg = self.cfg
        loss, stats = eagle_loss(
            self.head,
            make_batch(seqs, next(self.head.parameters()).device),
            cfg.hidden_weight,
            cfg.ce_weight,
            cfg.tv_weight,
            cfg.temperature,
            steps=self.ttt_steps,
        )
        ok = math.isfinite(stats["loss"])
        if ok:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip)
            ok = bool(torch.isfinite(norm))
            stats["grad_norm"] = float(norm)
        if ok:
            self.opt.step()
            self.steps += 1
        else:
            self.opt.zero_grad(set_to_none=True)
            self.skipped_steps += 1
        stats["skipped"] = not ok
        return stats

    def train(
        self, seqs: list[Sequence], rng: random.Random | None = None
    ) -> tuple[dict[str, float], int]:
        """`epochs` shuffled passes over the sequences: (each step statistic's mean over the
        steps taken, the steps taken)."""
        rng = rng or random.Random(self.steps)
        usable = [s for s in seqs if len(s.token_ids) - s.prompt_len >= 1]
        totals: dict[str, float] = {}
        count = 0
        for _ in range(self.cfg.epochs):
            order = list(usable)
            rng.shuffle(order)
            for start in range(0, len(order), self.cfg.batch_size):
                stats = self.step(order[start : start + self.cfg.batch_size])
                if stats["skipped"]:
                    continue
                count += 1
                for k, v in stats.items():
                    if isinstance(v, float):
                        totals[k] = totals.get(k, 0.0) + v
        return ({k: v / count for k, v in totals.items()} if count else {}), count

    def state_dict(self) -> dict:
        return {
            "head": self.head.export_state_dict(),
            "opt": self.opt.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.head.load_export_state_dict(state["head"])
        with configured_settings_kept(self.opt):
            self.opt.load_state_dict(state["opt"])
        self.steps, self.skipped_steps = state["steps"], state["skipped_steps"]
