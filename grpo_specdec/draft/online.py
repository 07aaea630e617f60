"""Online draft learning from someone else's training loop: give it your policy module and
the sequences it just rolled out (or their hidden states), and it keeps an EAGLE head
learning on them and pushes it into your vLLM engine through vLLM's weight-update API.

    draft = OnlineDraft("path/to/policy", head="path/to/head")   # or new="eagle3"
    stats = draft.learn_from(policy_model, token_ids, prompt_lens)   # a DraftRound
    draft.push(LLMClient(llm))     # or HTTPClient(url), RPCClient(...)

The draft learner (`learner.py` `DraftLearner`, the job's own) does the training, with its
guards (non-finite steps skipped, a diverged head rolled back, versions that only grow);
this adds the capture (`capture.py`, the same forward hooks the job's policy learner uses)
and the push (`vllm_plugin.weights.trainer.ShmTrainerEngine` with `draft=True`, through a
client of vllm_plugin/weights/clients.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from grpo_specdec.draft.capture import Sequence, capture_hidden
from grpo_specdec.draft.formats import ready_head
from grpo_specdec.draft.learner import DraftData, DraftLearner, DraftRound
from grpo_specdec.draft.trainer import DraftTrainConfig


class OnlineDraft:
    """An EAGLE head learning online for the policy at `policy_dir` (its config and
    architecture; the weights come from the policy module at each `learn_from`). `head`: a
    head folder to continue from (`grpo-specdec draft train`'s, or one as its authors
    publish it, EAGLE-1, EAGLE-3 or speculators, imported on the fly); without one, a new
    head, `new` = "eagle3" (three of the policy's layers, trained unrolled) or "eagle" (its
    last layer)."""

    def __init__(
        self,
        policy_dir: str | Path,
        head: str | Path | None = None,
        *,
        new: str = "eagle3",
        train: DraftTrainConfig | dict | None = None,
        device: str = "cpu",
        seed: int = 0,
    ):
        if new not in ("eagle", "eagle3"):
            raise ValueError(f"new: 'eagle' or 'eagle3', not {new!r}")
        cfg = DraftTrainConfig.model_validate(train or {})
        head = head and ready_head(head, policy_dir, "head")
        self.learner = DraftLearner(
            str(policy_dir), str(head) if head else None, cfg, device, seed, new_head_kind=new
        )
        self._policy_version = 0

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """vLLM's ids of the policy layers the head reads; () for its last layer only."""
        return self.learner.head.aux_layers

    @property
    def version(self) -> int:
        """The head's version: 0 as loaded, +1 for each `learn*` that trained it."""
        return self.learner.version

    def learn_from(
        self,
        policy: nn.Module,
        token_ids: list[list[int]],
        prompt_lens: list[int],
        batch_size: int = 8,
    ) -> DraftRound:
        """Train on sequences (prompt + response ids, and each prompt's length) with the
        hidden states `policy` (a HF causal LM) gives them now, paired with its current
        embedding and lm_head: the ones the engine serves once the policy is pushed."""
        if len(token_ids) != len(prompt_lens):
            raise ValueError(
                f"token_ids has {len(token_ids)} sequences but prompt_lens {len(prompt_lens)}"
            )
        was_training = policy.training
        policy.eval()
        try:
            seqs = capture_hidden(
                policy,
                [Sequence(list(ids), n) for ids, n in zip(token_ids, prompt_lens, strict=True)],
                batch_size,
                self.aux_layers,
            )
        finally:
            policy.train(was_training)
        embed = policy.get_input_embeddings().weight.detach().cpu()
        lm_head = policy.get_output_embeddings().weight.detach().cpu()
        return self.learn(seqs, embed, lm_head)

    def learn(self, seqs: list[Sequence], embed: torch.Tensor, lm_head: torch.Tensor) -> DraftRound:
        """Train on captured sequences (`hidden`, and `aux` for an EAGLE-3 head, filled),
        with the policy's input embedding and lm_head weights: what the round did."""
        if self.aux_layers and any(s.aux is None for s in seqs):
            raise ValueError(
                f"the head reads the policy's layers {list(self.aux_layers)}: every sequence "
                "needs `aux` (capture_hidden(..., aux_layers=draft.aux_layers))"
            )
        self._policy_version += 1
        return self.learner.train(DraftData(seqs, embed, lm_head, self._policy_version))

    def push(self, client) -> int:
        """Send the head into the engine behind `client` (`LLMClient`, `HTTPClient`,
        `RPCClient`); the engine checks it against the head it serves and keeps that one
        if it is refused (the error is raised here). Returns the version sent."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource

        weights, metadata, version, _ = self.learner.export()
        sender = WeightTransferTrainerFactory.trainer_init(
            ShmTrainerInitInfo(rank=0, draft=True, metadata=metadata),
            client=client,
            source=StateDictSource(weights),
        )
        sender.send_weights(version)
        return version

    def save(self, out: str | Path) -> Path:
        """The head as a folder vLLM serves (`speculative_config.model`)."""
        return self.learner.head.save(out)
