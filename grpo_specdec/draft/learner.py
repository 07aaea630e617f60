"""The online draft learner: an EAGLE head trained on each rollout's hidden states, with
its guards (non-finite steps skipped by the trainer, a diverged head rolled back) and its
versions, which only grow. The job runs it as a Ray actor (job/learners.py); a user's own
loop through `OnlineDraft` (online.py)."""

from __future__ import annotations

import copy
import os
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from grpo_specdec.draft.capture import Sequence
from grpo_specdec.draft.head import eagle3_aux_layers, load_head, new_head
from grpo_specdec.draft.head_model import DraftHead
from grpo_specdec.draft.trainer import DraftTrainConfig, DraftTrainer
from grpo_specdec.learner_state import load_learner_state


@dataclass
class DraftData:
    seqs: list[Sequence]
    # The policy's input embedding and lm_head these hidden states came from (rank 0 only).
    embed: torch.Tensor | None
    lm_head: torch.Tensor | None
    policy_version: int

    @staticmethod
    def gather(parts: tuple[DraftData, ...]) -> DraftData:
        """The policy ranks' shards, in rank order, as one."""
        return DraftData(
            [s for part in parts for s in part.seqs],
            parts[0].embed,
            parts[0].lm_head,
            parts[0].policy_version,
        )


@dataclass
class DraftRound:
    """What one round of training on a rollout did."""

    steps: int  # optimiser steps taken; none: no new head, nothing to swap in
    skipped_steps: int  # non-finite steps the trainer skipped since it began
    sequences: int
    rolled_back: bool  # the head diverged and went back to its last good state
    seconds: float
    version: int  # the newest head's version after this round
    means: dict[str, float]  # each step statistic's mean over the round (loss terms, grad norm)

    def record(self) -> dict:
        """As the job's metrics records name them (`draft_*`)."""
        counts = {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "sequences": self.sequences,
            "rolled_back": self.rolled_back,
            "version": self.version,
        }
        return {f"draft_{k}": v for k, v in (self.means | counts).items()}


class DraftLearner:
    """Trains the head on each rollout's hidden states and numbers the heads it makes (the
    one owner of the draft version): `init` a head folder to continue from, else a new head
    of `new_head_kind` ("eagle": the target's last layer; "eagle3": three of its layers).
    `resume_from`: a folder `save` wrote, whose state it continues.

    It keeps the state behind its last KEPT heads, so that when an engine's draft watch
    (draft_watch.py) goes back from a collapsed head to an older one, learning goes back
    there too (`return_to`) instead of training on from the collapse."""

    KEPT = 3

    def __init__(
        self,
        policy_dir: str,
        init: str | None,
        cfg: DraftTrainConfig,
        device: str = "cpu",
        seed: int = 0,
        new_head_kind: str = "eagle",
        resume_from: Path | None = None,
    ):
        target = AutoModelForCausalLM.from_pretrained(policy_dir)
        if init:
            self.head: DraftHead = load_head(init, policy_dir, target)
        else:
            layers = target.config.num_hidden_layers
            aux = eagle3_aux_layers(layers) if new_head_kind == "eagle3" else None
            self.head = new_head(policy_dir, target, seed, aux_layers=aux)
        del target
        self.head.to(device)
        self.device = device
        self.trainer = DraftTrainer(self.head, cfg)
        self.rng = random.Random(seed)
        self.version = 0
        self.trained_on_policy = 0
        self.resumed_from: str | None = None
        # A checkpoint of a run whose draft was frozen holds the head it served (`init`
        # here) but no learner state: learning starts from that head.
        if resume_from is not None and (Path(resume_from) / "draft_state.pt").is_file():
            self.load(Path(resume_from))
            self.resumed_from = str(resume_from)
        self._last_good = copy.deepcopy(self.trainer.state_dict())
        self._kept: OrderedDict[int, dict] = OrderedDict({self.version: self._last_good})

    def train(self, *shards: DraftData, after_version: int = 0) -> DraftRound:
        """Train on one rollout: the hidden states of every policy rank's shard.
        `after_version`: the newest draft version the job has issued. A learner that Ray
        restarted from an older checkpoint numbers its next weights above it, so that no
        version names two different heads."""
        start = time.perf_counter()
        data = DraftData.gather(shards)
        # The draft must predict with the embedding and lm_head the engine will pair it with.
        self.head.embed_weight = data.embed.to(self.device)
        self.head.lm_head_weight = data.lm_head.to(self.device)
        means, steps = self.trainer.train(data.seqs, self.rng)
        rolled_back = not all(torch.isfinite(p).all() for p in self.head.parameters())
        if rolled_back:
            # Diverged despite the per-step guard: return to the last good state.
            skipped = self.trainer.skipped_steps
            self.trainer.load_state_dict(copy.deepcopy(self._last_good))
            self.trainer.skipped_steps = skipped
            steps = 0
        if steps:
            self.version = max(self.version, after_version) + 1
            self.trained_on_policy = data.policy_version
            self._last_good = copy.deepcopy(self.trainer.state_dict())
            self._kept[self.version] = self._last_good
            while len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
        return DraftRound(
            steps,
            self.trainer.skipped_steps,
            len(data.seqs),
            rolled_back,
            time.perf_counter() - start,
            self.version,
            means,
        )

    def return_to(self, version: int) -> bool:
        """Learn on from head `version` (its weights and optimiser state), an engine having
        gone back to it; the next head is numbered above every one made so far. False where
        that head is no longer kept (learning goes on from the newest)."""
        state = self._kept.get(version)
        if state is None:
            return False
        skipped = self.trainer.skipped_steps
        self.trainer.load_state_dict(copy.deepcopy(state))
        self.trainer.skipped_steps = skipped
        self._last_good = state
        for newer in [v for v in self._kept if v > version]:
            del self._kept[newer]  # the collapsed lineage
        return True

    def export(self) -> tuple[dict[str, torch.Tensor], dict[str, str], int, int]:
        """(weights, metadata, draft version, policy version it was trained on)."""
        weights = self.head.export_state_dict(self.head.export_dtype())
        return weights, self.head.swap_metadata(), self.version, self.trained_on_policy

    def save(self, path: Path) -> None:
        self.head.save(path / "draft")
        torch.save(
            {
                "trainer": self.trainer.state_dict(),
                "version": self.version,
                "rng": self.rng.getstate(),
                "trained_on_policy": self.trained_on_policy,
            },
            path / "draft_state.pt",
        )

    def load(self, path: Path) -> None:
        state = load_learner_state(path / "draft_state.pt")
        self.trainer.load_state_dict(state["trainer"])
        self.version, self.trained_on_policy = state["version"], state["trained_on_policy"]
        self.rng.setstate(state["rng"])

    def status(self) -> dict:
        return {"pid": os.getpid(), "version": self.version, "resumed_from": self.resumed_from}
