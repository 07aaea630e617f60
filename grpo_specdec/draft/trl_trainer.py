"""TRL's `GRPOTrainer` with a draft head learning online beside the policy.

    from grpo_specdec.draft.online import OnlineDraft
    from grpo_specdec.draft.trl_trainer import OnlineDraftGRPOTrainer
    from vllm_plugin.weights.clients import LLMClient

    trainer = OnlineDraftGRPOTrainer(
        model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
        online_draft=OnlineDraft(policy_dir),
        draft_client=lambda trainer: LLMClient(trainer.llm),   # colocated vLLM; or None
    )
    trainer.train()

Each generation's sequences (TRL left-pads prompts and masks completions after EOS) are
kept; after each optimiser step the draft trains on them with the hidden states of the
policy as it now is (the one the next rollouts sample from), and, with a `draft_client`,
is pushed into the engine. Its statistics go to TRL's log as `draft/*`.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import TrainerCallback
from trl import GRPOTrainer

from grpo_specdec.draft.online import OnlineDraft


class OnlineDraftGRPOTrainer(GRPOTrainer):
    def __init__(
        self,
        *args,
        online_draft: OnlineDraft,
        draft_client: Callable[[GRPOTrainer], object] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.online_draft = online_draft
        self.draft_client = draft_client
        self.draft_rows: list[tuple[list[int], int]] = []
        self.add_callback(_LearnAfterStep(self))

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        rows = zip(
            out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"],
            strict=True,
        )  # fmt: skip
        for prompt, prompt_mask, completion, completion_mask in rows:
            prompt = prompt[prompt_mask.bool()].tolist()
            completion = completion[completion_mask.bool()].tolist()
            if completion:
                self.draft_rows.append((prompt + completion, len(prompt)))
        return out


class _LearnAfterStep(TrainerCallback):
    def __init__(self, trainer: OnlineDraftGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        rows, trainer.draft_rows = trainer.draft_rows, []
        if not rows:
            return
        policy = trainer.accelerator.unwrap_model(trainer.model)
        stats = trainer.online_draft.learn_from(
            policy, [ids for ids, _ in rows], [n for _, n in rows]
        )
        if trainer.draft_client is not None and stats.steps:
            trainer.online_draft.push(trainer.draft_client(trainer))
        trainer.log(
            {f"draft/{k.removeprefix('draft_')}": float(v) for k, v in stats.record().items()}
        )
