"""The verl recipe (docs/recipes/verl.yaml) through verl's own code: its engine_kwargs
become `vllm serve` arguments as verl 0.9 makes them (`build_cli_args_from_config`, after
verl's own settings, parsed by vLLM's serve parser), and the engine built from them runs
the plugin's scheduler with the worker extension composed with verl's."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
import yaml

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _serve_args(argv: list[str]):
    from vllm.entrypoints.cli import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    subparsers = parser.add_subparsers(dest="subparser")
    for cmd in serve.cmd_init():
        cmd.subparser_init(subparsers)
    args = parser.parse_args(argv)
    args.model = args.model_tag
    return args


def _scrambled(weights: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    return {k: v[torch.randperm(v.shape[0], generator=g)] for k, v in weights.items()}


class VerlLikeTrainer:
    """What verl's trainer holds of its rollout server: a way to call `collective_rpc` on it
    and its `clear_kv_cache`, from another thread than the server's event loop (verl: from
    another process, through Ray). It pushes the policy verl's way (its bucketed sender,
    over shared memory on CPU) and the draft through vLLM's trainer API (`grpo_shm`,
    `RPCClient`)."""

    def __init__(self, engine, loop):
        self.engine, self.loop = engine, loop

    def _wait(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def rpc(self, method: str, kwargs: dict | None = None):
        return self._wait(self.engine.collective_rpc(method, kwargs=kwargs))

    def push_draft(self, weights: dict, version: int) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from grpo_specdec.weight_transfer import RPCClient, ShmTrainerInitInfo, StateDictSource

        client = RPCClient(self.rpc, lambda: self._wait(self.engine.reset_prefix_cache()))
        WeightTransferTrainerFactory.trainer_init(
            ShmTrainerInitInfo(rank=0, draft=True), client=client, source=StateDictSource(weights)
        ).send_weights(version)

    async def push_policy(self, weights: dict) -> None:
        """verl's `vLLMRollout.update_weights`: the workers receive while the sender sends."""
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import (
            BucketedWeightSender,
        )

        receiving = asyncio.ensure_future(
            self.engine.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
        )
        # the socket verl's worker extension opens (`_get_zmq_handle`), for this job id
        handle = f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-0.sock"
        sender = BucketedWeightSender(handle, bucket_size_mb=64, use_shm=True)
        # verl's sender blocks on its socket; the server's loop must keep serving the RPC
        await asyncio.to_thread(asyncio.run, sender.async_send_weights(iter(weights.items())))
        await receiving
        await self.engine.reset_prefix_cache()


def test_verl_engine_runs_the_plugin_and_takes_both_pushes(
    tiny_target, tiny_draft, job_profile, monkeypatch, questions, plain_engine
):
    """verl's engine from the recipe runs the plugin losslessly; its trainer pushes the
    policy its own way and the draft through vLLM's weight-update API, on the same workers:
    the acceptance follows the head pushed, a bad head leaves the old one serving."""
    from safetensors.torch import load_file
    from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from grpo_specdec.engine import SamplingSettings

    fragment = yaml.safe_load((ROOT / "docs" / "recipes" / "verl.yaml").read_text())
    engine_kwargs = fragment["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]
    engine_kwargs["speculative_config"]["model"] = tiny_draft
    verl_settings = {  # the part of verl's own that matters here, sized for the tiny model
        "dtype": "float32",
        "max_model_len": 256,
        "enforce_eager": True,
        "worker_extension_cls": "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
        "kv_cache_memory_bytes": 256 << 20,
        "seed": 0,
    }
    argv = ["serve", tiny_target, *build_cli_args_from_config({**verl_settings, **engine_kwargs})]
    engine_args = AsyncEngineArgs.from_cli_args(_serve_args(argv))
    assert engine_args.scheduler_cls == "vllm_plugin.scheduler.ConcurrencyAwareScheduler"
    assert engine_args.worker_extension_cls.endswith("VerlWeightSwapExtension")
    engine_args.per_request_spec_decode_metrics = "detailed"  # the test's acceptance counts
    monkeypatch.setenv("GRPO_SPECDEC_CONTROLLER", json.dumps({"profile": job_profile}))
    monkeypatch.setenv("VERL_RAY_JOB_ID", f"grpo-specdec-test-{os.getpid()}")
    head = load_file(f"{tiny_draft}/model.safetensors")
    policy = load_file(f"{tiny_target}/model.safetensors")
    prompts = questions[:6]

    async def drive():
        engine = AsyncLLM.from_vllm_config(engine_args.create_engine_config())
        trainer = VerlLikeTrainer(engine, asyncio.get_running_loop())

        async def answers() -> tuple[list[str], float]:
            """Greedy answers one prompt at a time (B = 1, where the controller drafts), and
            draft tokens accepted per draft token verified."""
            texts, drafted, accepted = [], 0, 0
            params = SamplingParams(max_tokens=16, temperature=0.0)
            for prompt in prompts:
                async for out in engine.generate(prompt, params, request_id=f"verl-{next(ids)}"):
                    final = out.outputs[0]
                texts.append(final.text)
                drafted += sum(final.spec_decode_metrics.per_step_drafted)
                accepted += sum(final.spec_decode_metrics.per_step_accepted)
            assert drafted > 0
            return texts, accepted / drafted

        try:
            # verl's call after start, then the plugin's, on the same workers
            vocab = engine.model_config.get_vocab_size()
            await engine.collective_rpc("monkey_patch_model", kwargs={"vocab_size": vocab})
            versions = [(await engine.collective_rpc("grpo_weight_versions"))[0]]
            served = [await answers()]
            for weights, version in ((_scrambled(head), 80), (head, 81)):
                await asyncio.to_thread(trainer.push_draft, weights, version)
                versions.append((await engine.collective_rpc("grpo_weight_versions"))[0])
                served.append(await answers())
            missing = dict(head)
            missing.pop(next(iter(missing)))
            with pytest.raises(Exception, match="missing tensors"):
                await asyncio.to_thread(trainer.push_draft, missing, 82)
            versions.append((await engine.collective_rpc("grpo_weight_versions"))[0])
            served.append(await answers())
            await trainer.push_policy(_scrambled(policy))
            scrambled_policy = await answers()
            await trainer.push_policy(policy)
            served.append(await answers())
            return versions, served, scrambled_policy
        finally:
            engine.shutdown()

    ids = iter(range(10**6))
    versions, served, scrambled_policy = asyncio.run(drive())
    assert versions == [
        {"policy": 0, "draft": 0},
        {"policy": 0, "draft": 80},
        {"policy": 0, "draft": 81},
        {"policy": 0, "draft": 81},  # the head missing a tensor was refused whole
    ]
    # lossless through the plugin's scheduler and every head: the plain engine's answers
    plain = plain_engine.generate(prompts, SamplingSettings(max_tokens=16), chat=False)
    want = [g[0].text for g in plain.outputs]
    assert [texts for texts, _ in served] == [want] * len(served)
    (start, scrambled, trained, after_refusal, after_policy) = (a for _, a in served)
    assert trained > 2 * scrambled and trained == pytest.approx(start)
    assert after_refusal == trained  # the trained head still served
    # verl's own policy sync reaches the same workers: a scrambled policy answers
    # otherwise, and the policy pushed back answers as before with the same head
    assert scrambled_policy[0] != want
    assert after_policy == pytest.approx(trained)
