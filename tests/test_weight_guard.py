"""No step on weights that may be a mix, whichever client drove the update: the engine core's
guard (vllm_plugin/patches/features/weight_guard_v0_32.py) on a tiny engine whose loads can
be made to fail (tests/faulty_swap_extension.py), generating through vLLM's own
`LLM.generate` (not the plugin's `Engine.generate`, which refuses by itself), updated by a
trainer that reaches it only through `collective_rpc` (`RPCClient`, as verl's) or by raw
calls of vLLM's update lifecycle. The served engine driven by vLLM's HTTP routes:
tests/test_vllm_serve.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_specdec.engine import Engine
from tests.conftest import tiny_engine_config
from vllm_plugin.patches.features.weight_guard_v0_32 import WeightGuard
from vllm_plugin.settings import DEADLINE_ENV

DEADLINE_S = 3.0


def test_the_guard_holds_for_a_live_update_and_refuses_a_mix_or_an_update_past_its_deadline():
    guard = WeightGuard(deadline_s=10)
    assert guard.clear and guard.refusal(0.0) is None
    guard.learn([{"session": "policy update held by pid 7", "mixed": {}}] * 2, now=100.0)
    assert not guard.clear
    assert guard.refusal(105.0) is None  # held: its requests wait
    assert "past the 10 s deadline" in guard.refusal(111.0)
    guard.learn([{"session": None, "mixed": {}}, {"session": None, "mixed": {"policy": "x"}}], 112)
    assert guard.session is None
    assert "the policy weights may be a mix (rank 1: x)" in guard.refusal(112.0)
    guard.learn([{"session": None, "mixed": {}}] * 2, now=113.0)
    assert guard.clear
    guard.cannot_ask(RuntimeError("worker died"), now=114.0)
    assert "could not say what they hold (RuntimeError: worker died)" in guard.refusal(114.0)


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    return folder / "fail-loads", folder / "slow-loads"


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft, faults):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GRPO_TEST_FAIL_LOADS", str(faults[0]))
        env.setenv("GRPO_TEST_SLOW_LOADS", str(faults[1]))
        env.setenv(DEADLINE_ENV, str(DEADLINE_S))
        # Its own engine-core process: vLLM mixes an extension into the worker class of the
        # process that builds the workers, where an in-process engine of another test may
        # have mixed in the plugin's own.
        engine = Engine(
            tiny_engine_config(tiny_target, tiny_draft, engine_process="separate"),
            worker_extension_cls="tests.faulty_swap_extension.FaultyLoadsExtension",
            weight_transfer_config={"backend": "grpo_shm_faulty"},
        )
        yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def policy(tiny_target) -> dict[str, torch.Tensor]:
    from pathlib import Path

    return load_file(Path(tiny_target) / "model.safetensors")


def _noisy(weights: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def _generate(engine, questions):
    """vLLM's own `LLM.generate`: (token ids, finish reason, stop reason) per prompt."""
    from vllm import SamplingParams

    outputs = engine.llm.generate(
        questions, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False
    )
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outputs]  # fmt: skip


def _rpc_trainer(engine, weights: dict):
    """A trainer reaching the engine only through `collective_rpc`, as verl's does."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_plugin.weights.clients import RPCClient
    from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource

    client = RPCClient(
        lambda method, kwargs: engine.llm.collective_rpc(method, kwargs=kwargs),
        lambda: engine.llm.reset_prefix_cache(),
    )
    return WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0), client=client, source=StateDictSource(weights)
    )


def test_a_policy_left_a_mix_by_a_collective_rpc_trainer_serves_no_token_to_llm_generate(
    engine, policy, questions, faults
):
    """Before the guard, `LLM.generate` went on generating on the half-loaded policy."""
    reference = _generate(engine, questions)
    assert all(tokens and why != "error" for tokens, why, _ in reference)
    faults[0].write_text("2")  # the update's load, then the restore's
    with pytest.raises(Exception, match="simulated load failure"):
        _rpc_trainer(engine, _noisy(policy, 1)).send_weights(version=5)
    refused = _generate(engine, questions)
    assert [(tokens, why) for tokens, why, _ in refused] == [([], "error")] * len(questions)
    assert "the policy weights may be a mix" in refused[0][2]
    # An update of that role that loads whole mends it.
    _rpc_trainer(engine, policy).send_weights(version=6)
    assert _generate(engine, questions) == reference


def test_an_open_update_holds_requests_and_past_its_deadline_refuses_them(engine, questions):
    """A session opened through vLLM's own call and left open: the requests wait (no step on
    weights half loaded), then end with an error at the deadline rather than hang."""
    reference = _generate(engine, questions)
    engine.llm.collective_rpc("start_weight_update")
    start = time.monotonic()
    refused = _generate(engine, questions)
    waited = time.monotonic() - start
    engine.llm.collective_rpc("grpo_abort_weight_update")
    assert [(tokens, why) for tokens, why, _ in refused] == [([], "error")] * len(questions)
    assert f"past the {DEADLINE_S:g} s deadline" in refused[0][2]
    assert waited >= DEADLINE_S
    assert _generate(engine, questions) == reference


def test_a_load_whose_trainer_died_before_committing_it_is_undone_before_a_step(
    engine, policy, questions, tmp_path
):
    """The dead trainer's weights are in the model under the old version: the guard's
    question to the workers ends its session and undoes the load, and the requests run on
    the weights the engine had."""
    reference = _generate(engine, questions)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = Path(engine.llm.collective_rpc("grpo_swap_folder")[0])
    path = folder / f"policy-v9-p{gone.pid}-deadbeef.safetensors"
    save_file({k: v.contiguous() for k, v in _noisy(policy, 2).items()}, path)
    try:
        engine.llm.collective_rpc("start_weight_update")
        engine.llm.collective_rpc(
            "update_weights", kwargs={"update_info": {"path": str(path), "version": 9}}
        )
    finally:
        path.unlink()
    assert _generate(engine, questions) == reference
    assert engine.weight_versions()["policy"] != 9
