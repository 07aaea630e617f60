"""A resumed optimiser keeps its saved moments and steps but runs at the settings it is built
with now (`grpo_specdec/learner_state.py`): torch's `load_state_dict` would bring back the
checkpoint's learning rate and weight decay, so `--resume ... policy.lr=1e-7` kept the old
rate and said nothing."""

from __future__ import annotations

import torch

from grpo_specdec.job.sharding import full_state, load_full_state


def _stepped(lr: float, weight_decay: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_the_policy_learner_resumes_at_the_configured_learning_rate():
    model, opt = _stepped(lr=1e-6, weight_decay=0.1)
    weights, opt_state = full_state(model, opt)
    fresh = torch.nn.Linear(4, 2)
    resumed = torch.optim.AdamW(fresh.parameters(), lr=1e-5, weight_decay=0.0)
    load_full_state(fresh, resumed, weights, opt_state)
    assert resumed.param_groups[0]["lr"] == 1e-5
    assert resumed.param_groups[0]["weight_decay"] == 0.0
    saved = opt.state[next(iter(model.parameters()))]
    kept = resumed.state[next(iter(fresh.parameters()))]
    assert torch.equal(kept["exp_avg"], saved["exp_avg"]) and kept["step"] == saved["step"] == 1


def test_the_draft_trainer_resumes_at_the_configured_learning_rate(tiny_target, tiny_draft):
    from transformers import AutoModelForCausalLM

    from grpo_specdec.draft.head import load_head
    from grpo_specdec.draft.trainer import DraftTrainConfig, DraftTrainer

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    old = DraftTrainer(load_head(tiny_draft, tiny_target, target), DraftTrainConfig(lr=1e-6))
    state = old.state_dict()
    new = DraftTrainer(load_head(tiny_draft, tiny_target, target), DraftTrainConfig(lr=1e-5))
    new.load_state_dict(state)
    assert [g["lr"] for g in new.opt.param_groups] == [1e-5] * len(new.opt.param_groups)
