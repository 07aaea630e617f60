"""Hot-swap weights into a served engine over HTTP: `POST /v1/grpo/weights`.

A `vllm.endpoint_plugins` entry point, `grpo_specdec_weights`, which vLLM loads only when
VLLM_PLUGINS names it. It refuses to start without an API key (`--api-key` or
VLLM_API_KEY): vLLM checks the key on /v1 routes, so every call needs the token, and no
server exposes weight loading to whoever can reach its port. vLLM's own weight-update
routes (VLLM_SERVER_DEV_MODE) are outside that check and NCCL-only.

The body names a safetensors file on the server's machine, written by a trainer next to
it (`grpo_specdec.served.ServedWeights`): {"role": "policy" | "draft", "path", "version"}.
Validation and loading are the weight-swap worker extension's (`grpo_swap_weights`): a
rejected swap (400) leaves the engine serving its old weights; one whose load failed and
whose restore failed too (500, "mixed") leaves an engine that refuses to generate until a
swap of that role succeeds.
"""

from __future__ import annotations

import os
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

router = APIRouter()


class SwapRequest(BaseModel):
    role: Literal["policy", "draft"]
    path: str
    version: int = Field(ge=0)


@router.post("/v1/grpo/weights")
async def swap_weights(body: SwapRequest, request: Request):
    engine = request.app.state.grpo_engine
    try:
        report = await engine.collective_rpc(
            "grpo_swap_weights", args=(body.role, body.path, body.version)
        )
    except Exception as err:  # the worker's reason (bad names, shapes, values, a failed load)
        # The engine core hands back the worker's message, not its type: a load that failed
        # and whose restore failed too says its weights "may be a mix" (MixedWeightsError).
        mixed = "may be a mix" in str(err)
        return JSONResponse(
            {"error": f"{type(err).__name__}: {err}", "mixed": mixed},
            status_code=500 if mixed else 400,
        )
    await engine.reset_prefix_cache()  # cached prefixes hold KV of the old weights
    return report[0]


@router.get("/v1/grpo/weights")
async def weight_versions(request: Request):
    return (await request.app.state.grpo_engine.collective_rpc("grpo_weight_versions"))[0]


class WeightsEndpoint:
    name = "grpo_specdec_weights"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        if not any(args.api_key or [os.environ.get("VLLM_API_KEY")]):
            raise RuntimeError(
                "the grpo_specdec_weights endpoint loads weights: start vllm serve with "
                "--api-key (or VLLM_API_KEY) so that only holders of the key can call it"
            )
        if engine_client is None:
            raise RuntimeError("the grpo_specdec_weights endpoint needs an engine")
        state.grpo_engine = engine_client
