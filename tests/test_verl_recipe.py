"""The verl recipe (docs/recipes/verl.yaml) through verl's own code: its engine_kwargs
become `vllm serve` arguments as verl 0.9 makes them (`build_cli_args_from_config`, after
verl's own settings, parsed by vLLM's serve parser), and the engine built from them runs
the plugin's scheduler with the worker extension composed with verl's."""

from __future__ import annotations

import asyncio
import json

import pytest
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


def test_verl_engine_runs_the_plugin(
    tiny_target, tiny_draft, job_profile, monkeypatch, questions, plain_engine
):
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
    monkeypatch.setenv("GRPO_SPECDEC_CONTROLLER", json.dumps({"profile": job_profile}))

    async def drive():
        engine = AsyncLLM.from_vllm_config(engine_args.create_engine_config())
        try:
            # verl's call after start, then the plugin's, on the same workers
            vocab = engine.model_config.get_vocab_size()
            await engine.collective_rpc("monkey_patch_model", kwargs={"vocab_size": vocab})
            versions = (await engine.collective_rpc("grpo_weight_versions"))[0]
            text = ""
            params = SamplingParams(max_tokens=16, temperature=0.0)
            async for out in engine.generate(questions[0], params, request_id="verl-0"):
                text = out.outputs[0].text
            return versions, text
        finally:
            engine.shutdown()

    versions, text = asyncio.run(drive())
    assert versions == {"policy": 0, "draft": 0}
    # lossless through the plugin's scheduler and EAGLE drafts: the plain engine's output
    plain = plain_engine.generate(questions[:1], SamplingSettings(max_tokens=16), chat=False)
    assert text == plain.outputs[0][0].text
