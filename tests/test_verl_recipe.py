"""The verl recipe (docs/recipes/verl.yaml) through verl's own code: its engine_kwargs
become `vllm serve` arguments as verl 0.9 makes them (`build_cli_args_from_config`, after
verl's own settings, parsed by vLLM's serve parser), and the engine built from them runs
the plugin's scheduler with the worker extension composed with verl's."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from tests.conftest import ROOT, scrambled
from vllm_plugin.settings import CONFIG_KEY

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


class VerlLikeTrainer:
    """What verl's trainer holds of its rollout server: a way to call `collective_rpc` on it
    and its `clear_kv_cache`, from another thread than the server's event loop (verl: from
    another process, through Ray). It pushes the draft through vLLM's trainer API
    (`grpo_shm`, `RPCClient`). verl's own policy sync (its bucketed sender) does not run
    on a machine without an accelerator: verl's platform layer falls back to CUDA there."""

    def __init__(self, engine, loop):
        self.engine, self.loop = engine, loop

    def _wait(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def rpc(self, method: str, kwargs: dict | None = None):
        return self._wait(self.engine.collective_rpc(method, kwargs=kwargs))

    def push_draft(self, weights: dict, version: int) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from vllm_plugin.weights.clients import RPCClient
        from vllm_plugin.weights.trainer import ShmTrainerInitInfo, StateDictSource

        client = RPCClient(self.rpc, lambda: self._wait(self.engine.reset_prefix_cache()))
        WeightTransferTrainerFactory.trainer_init(
            ShmTrainerInitInfo(rank=0, draft=True), client=client, source=StateDictSource(weights)
        ).send_weights(version)


def test_verl_engine_runs_the_plugin_and_takes_draft_pushes_from_its_trainer(
    tiny_target, tiny_draft, job_profile, questions, plain_engine
):
    """verl's engine from the recipe runs the plugin losslessly; its trainer pushes the
    draft through vLLM's weight-update API on the workers verl calls its own methods on:
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
    engine_kwargs["additional_config"][CONFIG_KEY]["profile"] = job_profile
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
    head = load_file(f"{tiny_draft}/model.safetensors")
    prompts = questions[:6]
    # verl sends token ids of chat-templated prompts; the tiny models answer in that format
    # (on raw text the tiny target writes no answer a head can predict, so acceptance there
    # is near 0 whatever head serves, and how near depends on the machine that built it)
    prompt_ids = [plain_engine.encode(p) for p in prompts]

    async def drive():
        engine = AsyncLLM.from_vllm_config(engine_args.create_engine_config())
        trainer = VerlLikeTrainer(engine, asyncio.get_running_loop())

        async def answers() -> tuple[list[str], float]:
            """Greedy answers one prompt at a time (B = 1, where the controller drafts), and
            draft tokens accepted per draft token verified."""
            texts, drafted, accepted = [], 0, 0
            params = SamplingParams(max_tokens=16, temperature=0.0)
            for prompt in prompt_ids:
                request = {"prompt_token_ids": prompt}
                async for out in engine.generate(request, params, request_id=f"verl-{next(ids)}"):
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
            for weights, version in ((scrambled(head), 80), (head, 81)):
                await asyncio.to_thread(trainer.push_draft, weights, version)
                versions.append((await engine.collective_rpc("grpo_weight_versions"))[0])
                served.append(await answers())
            missing = dict(head)
            missing.pop(next(iter(missing)))
            with pytest.raises(Exception, match="missing tensors"):
                await asyncio.to_thread(trainer.push_draft, missing, 82)
            versions.append((await engine.collective_rpc("grpo_weight_versions"))[0])
            served.append(await answers())
            return versions, served
        finally:
            engine.shutdown()

    ids = iter(range(10**6))
    versions, served = asyncio.run(drive())
    assert versions == [
        {"policy": 0, "draft": 0},
        {"policy": 0, "draft": 80},
        {"policy": 0, "draft": 81},
        {"policy": 0, "draft": 81},  # the head missing a tensor was refused whole
    ]
    # lossless through the plugin's scheduler and every head: the plain engine's answers
    plain = plain_engine.generate(prompts, SamplingSettings(max_tokens=16))
    want = [g[0].text for g in plain.outputs]
    assert [texts for texts, _ in served] == [want] * len(served)
    # (k follows the acceptance the scheduler has seen, so rates are compared by far)
    (start, with_scrambled, trained, after_refusal) = (a for _, a in served)
    assert start > 2 * with_scrambled and trained > 2 * with_scrambled
    assert after_refusal > 2 * with_scrambled  # the trained head still served
