"""The draft learner from someone else's loop (`draft/online.py`), and TRL's real
`GRPOTrainer` with it (`draft/trl_trainer.py`): TRL generates with transformers here (its
vLLM modes need a GPU or a `trl vllm-serve` server), trains the tiny policy, and after each
step the head learns on the policy's hidden states of that step's completions and is pushed
into a running vLLM engine through vLLM's weight-update API."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_specdec.draft.online import OnlineDraft
from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import scrambled, tiny_engine_config
from vllm_plugin.weights.clients import LLMClient

pytestmark = pytest.mark.slow


def _acceptance(engine: Engine, prompts: list[list[int]]) -> float:
    spec = engine.generate(prompts, SamplingSettings(max_tokens=32)).spec
    return spec["accepted_tokens"] / max(spec["draft_tokens"], 1)


def test_an_online_draft_learns_from_a_policy_module_and_is_pushed_into_vllm(
    tiny_target, tiny_draft, questions
):
    """A scrambled head, given to OnlineDraft as a user's loop would, learns from the
    policy's rollouts (the engine's own greedy answers) and, pushed, drafts what vLLM
    accepts again."""
    policy = AutoModelForCausalLM.from_pretrained(tiny_target)
    engine = Engine(tiny_engine_config(tiny_target, tiny_draft))
    try:
        prompts = [engine.encode(q) for q in questions]  # chat-templated, as rollouts are
        draft = OnlineDraft(tiny_target, tiny_draft, train={"lr": 3e-3, "epochs": 4})
        good = _acceptance(engine, prompts)
        draft.learner.head.load_export_state_dict(scrambled(draft.learner.head.export_state_dict()))
        assert draft.push(LLMClient(engine.llm)) == 0
        bad = _acceptance(engine, prompts)
        assert bad < good / 2
        outputs = engine.generate(prompts, SamplingSettings(max_tokens=48)).outputs
        rows = [p + list(g[0].token_ids) for p, g in zip(prompts, outputs, strict=True)]
        for _ in range(3):
            stats = draft.learn_from(policy, rows, [len(p) for p in prompts])
        assert stats.steps > 0 and math.isfinite(stats.means["loss"])
        assert draft.push(LLMClient(engine.llm)) == 3
        assert engine.weight_versions()["draft"] == 3
        assert _acceptance(engine, prompts) > 2 * bad + 0.05
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="token_ids has 2 sequences but prompt_lens 1"):
        draft.learn_from(policy, rows[:2], [3])


def test_trl_grpo_trainer_keeps_the_draft_learning(tiny_target, questions, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig

    from grpo_specdec.draft.trl_trainer import OnlineDraftGRPOTrainer

    pushed = []

    class Client(LLMClient):
        def finish_weight_update(self, weight_version=None):
            super().finish_weight_update(weight_version)
            pushed.append(True)

    draft = OnlineDraft(tiny_target, new="eagle3", train={"lr": 1e-3})
    head_dir = draft.save(tmp_path / "head")
    engine = Engine(tiny_engine_config(tiny_target, str(head_dir)))
    try:
        args = GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=24,
            max_steps=2,
            learning_rate=1e-5,
            use_cpu=True,
            bf16=False,
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            temperature=1.0,
        )
        trainer = OnlineDraftGRPOTrainer(
            model=tiny_target,
            reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": questions[:8]}),
            online_draft=draft,
            draft_client=lambda _trainer: Client(engine.llm),
        )
        fc_before = draft.learner.head.fc.weight.detach().clone()
        trainer.train()
        logged = [r for r in trainer.state.log_history if "draft/steps" in r]
        assert len(logged) == 2 and all(r["draft/steps"] > 0 for r in logged)
        assert all(math.isfinite(r["draft/ce_loss_3"]) for r in logged)  # unrolled 3 steps
        assert not torch.equal(fc_before, draft.learner.head.fc.weight)
        assert len(pushed) == 2 and engine.weight_versions()["draft"] == draft.version == 2
        # the pushed head drafts in the engine
        assert engine.generate(questions[:4], SamplingSettings(max_tokens=16)).spec["draft_tokens"]
    finally:
        engine.shutdown()
