"""Weight updates all or none across tensor-parallel ranks: an engine on the tiny models with
TP = 2 on vLLM's CPU backend (two worker processes), updated through vLLM's weight-update
API and the `grpo_shm` backend (vllm_plugin/weights/shm_transfer.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import tiny_engine_config
from vllm_plugin.weights.manifest import MixedWeightsError
from vllm_plugin.weights.rank_weights import agreed_versions, merged_mixed

GREEDY = SamplingSettings(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def tp_engine(tiny_target, tiny_draft):
    # vLLM binds each CPU rank's threads to a NUMA node of its own unless told which cores
    # to use; this machine has one node: one core per rank.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        engine = Engine(tiny_engine_config(tiny_target, tiny_draft), tensor_parallel_size=2)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def policy(tiny_target) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def _noisy(weights: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def _fail_on_rank(rank: int):
    """Runs in each worker: on rank `rank`, the next policy load stops halfway."""

    def plant(worker):
        if worker.rank != rank:
            return
        model = worker.get_model()
        original = model.load_weights

        def broken(weights):
            weights = list(weights)
            original(weights[: len(weights) // 2])
            model.load_weights = original
            raise RuntimeError(f"simulated load failure on rank {rank}")

        model.load_weights = broken

    return plant


def _tokens(result) -> list[list[int]]:
    return [g[0].token_ids for g in result.outputs]


def test_both_ranks_load_an_update_and_report_its_version(tp_engine, policy, questions):
    before = tp_engine.generate(questions, GREEDY)
    tp_engine.swap_weights("policy", _noisy(policy, 1), version=1)
    assert tp_engine.llm.collective_rpc("grpo_weight_versions") == [{"policy": 1, "draft": 0}] * 2
    assert _tokens(tp_engine.generate(questions, GREEDY)) != _tokens(before)
    tp_engine.swap_weights("policy", policy, version=2)
    assert _tokens(tp_engine.generate(questions, GREEDY)) == _tokens(before)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_load_failing_on_either_rank_leaves_both_on_the_old_weights(
    tp_engine, policy, questions, failing
):
    """The other rank loaded the new weights whole; it goes back too. Without the abort
    (grpo_abort_weight_update) it would serve half a model of the new weights."""
    version = tp_engine.weight_versions()["policy"]
    reference = _tokens(tp_engine.generate(questions, GREEDY))
    tp_engine.llm.collective_rpc(_fail_on_rank(failing))
    with pytest.raises(Exception, match=f"simulated load failure on rank {failing}"):
        tp_engine.swap_weights("policy", _noisy(policy, 3), version=version + 1)
    assert tp_engine.weight_versions()["policy"] == version
    assert _tokens(tp_engine.generate(questions, GREEDY)) == reference
    # The engine takes the next update whole.
    tp_engine.swap_weights("policy", policy, version=version + 2)
    assert _tokens(tp_engine.generate(questions, GREEDY)) == reference


def test_ranks_that_disagree_on_versions_are_reported(tp_engine):
    versions = tp_engine.weight_versions()

    def declare_on_rank_one(worker):
        if worker.rank == 1:
            worker.grpo_declare_weight_versions({"draft": 99})

    tp_engine.llm.collective_rpc(declare_on_rank_one)
    try:
        with pytest.raises(
            MixedWeightsError, match=r"rank 0: \{.*'draft': 0.*rank 1: \{.*'draft': 99"
        ):
            tp_engine.weight_versions()
    finally:
        tp_engine.declare_weight_versions(versions)
    assert tp_engine.weight_versions() == versions


def test_versions_and_mixed_roles_merge_over_ranks():
    assert agreed_versions([{"policy": 3}, {"policy": 3}]) == {"policy": 3}
    with pytest.raises(MixedWeightsError, match="rank 1"):
        agreed_versions([{"policy": 3}, {"policy": 4}])
    assert merged_mixed([{}, {"draft": "why"}]) == {"draft": "rank 1: why"}
    assert merged_mixed([{"draft": "why"}]) == {"draft": "why"}
