"""Hot-swap weights into a served engine over HTTP: `POST /v1/grpo/weights`.

The `vllm.endpoint_plugins` entry point `grpo_specdec_weights` (reached through
vllm_plugin/weights_endpoint.py, the path installs name), which vLLM loads only when
VLLM_PLUGINS names it. It refuses to start without an API key (`--api-key` or
VLLM_API_KEY), which vLLM checks on /v1 routes, and without a weights token of its own
(GRPO_SPECDEC_WEIGHTS_TOKEN), which a swap must also carry (`X-Weights-Token`): whoever
may ask the server for completions may not thereby change its weights, and no server
exposes weight loading to whoever can reach its port. vLLM's own weight-update routes
(`/start_weight_update` ..., mounted only under VLLM_SERVER_DEV_MODE beside its other dev
routes, `/collective_rpc` among them) are outside every check: this route is the same
update behind the keys, and a server started in dev mode beside it says at ERROR that its
weights are open to anyone.

The body names a safetensors file that a trainer on the server's machine, run by the
server's user, wrote to the engine's private swap folder, which `GET /v1/grpo/weights/folder`
names to holders of the weights token (`served_weights.ServedWeights`):
{"role": "policy" | "draft", "path", "version"}. The route drives vLLM's weight-update
lifecycle on the engine, the one a trainer's client drives (`lifecycle`), with the
`grpo_shm` transfer backend (start the server with `--weight-transfer-config
'{"backend": "grpo_shm"}'`), which validates and loads nothing from outside that folder: a
rejected swap (400) leaves every rank serving its old weights (`grpo_abort_weight_update`
takes back a rank that had loaded them).

Generation is paused (vLLM's `pause_generation`, requests in flight kept) while the
weights change; then the prefix cache is reset with the running requests preempted, so
that no request, in flight or new, computes with KV of the old weights. A swap whose load
failed and whose restore failed too (500, "mixed"), or whose cache reset failed (500),
leaves a server that answers 503 to every other POST (completions, chat, ...) until a
whole swap of that role succeeds; the requests that were in flight are aborted, and the
engine stays paused until then.

A swap has a deadline (GRPO_SPECDEC_SWAP_DEADLINE_S, 600 s by default): past it the call
answers 503, and until the swap ends (it cannot be stopped halfway: a load runs in the
workers) the server answers 503 to `/health` and to every POST, so that a load balancer or
an orchestrator stops sending it work instead of waiting on a paused engine.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from vllm_plugin.compat import engine_core_utility
from vllm_plugin.settings import DEADLINE_ENV, swap_deadline_s
from vllm_plugin.weights.clients import AsyncEngineClient
from vllm_plugin.weights.lifecycle import run_update
from vllm_plugin.weights.manifest import MixedWeightsError
from vllm_plugin.weights.rank_weights import agreed_versions, merged_mixed, mixed_reasons
from vllm_plugin.weights.served_weights import TOKEN_ENV, TOKEN_HEADER
from vllm_plugin.weights.shm_transfer import BACKEND
from vllm_plugin.weights.swap_folder import agreed_folder

ROUTE = "/v1/grpo/weights"
HEALTH = "/health"  # vLLM's
# The routes that generate, whose requests the engine core's guard is asked about (not
# vLLM's RL routes, which must reach an engine to mend it, nor /health, which would wait on
# a load in progress).
GENERATING = ("/v1/", "/inference/")
router = APIRouter()
# under vLLM's "vllm" logger, whose handler prints to the server's console
logger = logging.getLogger(f"vllm.{__name__}")


class SwapRequest(BaseModel):
    role: Literal["policy", "draft"]
    path: str
    version: int = Field(ge=0)


def _refusal(state, overdue: bool = True) -> str | None:
    """Why the engine must not generate now, or None; `overdue`: a swap past its deadline
    counts (not for the swap itself, which ends it)."""
    reasons = mixed_reasons(getattr(state, "grpo_mixed", {}))
    if getattr(state, "grpo_stale_cache", None):
        reasons.append(state.grpo_stale_cache)
    if overdue:
        reasons += getattr(state, "grpo_overdue", {}).values()
    return "; ".join(reasons) or None


async def _mixed_roles(engine) -> dict[str, str]:
    return merged_mixed(await engine.collective_rpc("grpo_mixed_weights"))


async def _update(engine, body: SwapRequest) -> dict:
    info = {"path": body.path, "version": body.version}
    client = AsyncEngineClient(engine, asyncio.get_running_loop())
    await asyncio.to_thread(run_update, client, body.role, info, body.version)
    report = (await engine.collective_rpc("grpo_last_swap_report"))[0]
    return {"version": body.version, **report}


def _without_token(request: Request) -> JSONResponse | None:
    given = request.headers.get(TOKEN_HEADER, "")
    if hmac.compare_digest(given.encode(), request.app.state.grpo_weights_token.encode()):
        return None
    return JSONResponse(
        {"error": f"a weight swap needs the server's weights token in {TOKEN_HEADER}"},
        status_code=403,
    )


@router.get(ROUTE + "/folder")
async def swap_folder(request: Request):
    """The engine's own swap folder, where a trainer writes the files it names."""
    refused = _without_token(request)
    if refused is not None:
        return refused
    per_rank = await request.app.state.grpo_engine.collective_rpc("grpo_swap_folder")
    return {"swap_folder": agreed_folder(per_rank)}


@router.post(ROUTE)
async def swap_weights(body: SwapRequest, request: Request):
    state = request.app.state
    refused = _without_token(request)
    if refused is not None:
        return refused
    swap = asyncio.create_task(_swap(state, body))
    state.grpo_swaps.add(swap)  # the event loop holds tasks weakly
    swap.add_done_callback(state.grpo_swaps.discard)
    done, _ = await asyncio.wait({swap}, timeout=state.grpo_swap_deadline_s)
    if done:
        return swap.result()
    why = (
        f"a {body.role} swap to version {body.version} has run past the server's "
        f"{state.grpo_swap_deadline_s:g} s deadline ({DEADLINE_ENV}); generation stays paused "
        "until it ends"
    )
    mark_overdue(state, swap, why)
    return JSONResponse({"error": why, "mixed": False}, status_code=503)


def mark_overdue(state, swap: asyncio.Task, why: str) -> None:
    """`swap` past its deadline: the server refuses, naming it, until it ends. Each overdue
    swap is kept apart: one that ends does not clear another still running (swaps queue on
    the lock, so a second can run past its deadline while the first still loads)."""
    state.grpo_overdue[swap] = why
    swap.add_done_callback(lambda ended: _overdue_ended(state, ended))


def _overdue_ended(state, swap: asyncio.Task) -> None:
    state.grpo_overdue.pop(swap, None)
    if not swap.cancelled():
        swap.exception()  # its outcome is in the versions and the state it left


async def _swap(state, body: SwapRequest):
    """The swap with generation paused, one at a time; it runs to its end even when its
    caller stopped waiting (a load cannot be stopped halfway)."""
    engine = state.grpo_engine
    async with state.grpo_swap_lock:
        await engine.pause_generation(mode="keep", clear_cache=False)
        try:
            response = await _swap_while_paused(engine, state, body)
        except BaseException:
            await engine.resume_generation()
            raise
        if _refusal(state, overdue=False):
            # Nothing may run on weights that may be a mix or on stale KV: the frozen
            # requests are aborted, and the engine stays paused until a swap succeeds.
            await engine.pause_generation(mode="abort", clear_cache=False)
        else:
            await engine.resume_generation()
        return response


async def _swap_while_paused(engine, state, body: SwapRequest):
    try:
        report = await _update(engine, body)
    except Exception as err:  # the worker's reason (bad names, shapes, values, a failed load)
        # The engine core hands back the worker's message, not its type: a load that failed
        # and whose restore failed too says its weights "may be a mix" (MixedWeightsError).
        state.grpo_mixed = await _mixed_roles(engine)
        mixed = body.role in state.grpo_mixed
        return JSONResponse(
            {"error": f"{type(err).__name__}: {err}", "mixed": mixed},
            status_code=500 if mixed else 400,
        )
    state.grpo_mixed = await _mixed_roles(engine)
    try:
        reset = await engine.reset_prefix_cache(reset_running_requests=True)
        why = "vLLM refused"
    except Exception as err:
        reset, why = False, f"{type(err).__name__}: {err}"
    if not reset:
        state.grpo_stale_cache = (
            f"{body.role} version {body.version} is loaded, but resetting the prefix cache "
            f"failed ({why}), so it may hold KV of the old weights; a successful swap clears this"
        )
        return JSONResponse({"error": state.grpo_stale_cache, "mixed": False}, status_code=500)
    state.grpo_stale_cache = None
    return report


@router.get(ROUTE)
async def weight_versions(request: Request):
    per_rank = await request.app.state.grpo_engine.collective_rpc("grpo_weight_versions")
    try:
        return agreed_versions(per_rank)
    except MixedWeightsError as err:
        return JSONResponse({"error": str(err), "per_rank": per_rank}, status_code=409)


async def _engine_refusal(engine) -> str | None:
    """Why the engine core refuses every request (its weight guard,
    patches/features/weight_guard_v0_32.py), whoever drove the update that left it so;
    None where that patch does not run (vLLM unpatched)."""
    try:
        return await engine_core_utility(engine, "grpo_weight_refusal")
    except Exception:
        return None


class RefuseWhileMixed:
    """ASGI middleware: 503 to every POST but the swap route, and to `/health`, while the
    engine must not generate: after a swap of this route that failed (its state), or when
    the engine core says so (an update driven through vLLM's own routes or RPCs; the engine
    refuses such requests itself, this names why)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (
            (scope["method"] == "POST" and scope["path"] != ROUTE) or scope["path"] == HEALTH
        ):
            state = scope["app"].state
            why = _refusal(state)
            if not why and scope["path"].startswith(GENERATING):
                why = await _engine_refusal(state.grpo_engine)
            if why:
                refusal = {"message": f"refusing to generate: {why}", "type": "Unavailable"}
                response = JSONResponse({"error": {**refusal, "code": 503}}, status_code=503)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class WeightsEndpoint:
    name = "grpo_specdec_weights"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(router)
        app.add_middleware(RefuseWhileMixed)

    async def init_state(self, engine_client, state, args) -> None:
        if not any(args.api_key or [os.environ.get("VLLM_API_KEY")]):
            raise RuntimeError(
                "the grpo_specdec_weights endpoint loads weights: start vllm serve with "
                "--api-key (or VLLM_API_KEY) so that only holders of the key can call it"
            )
        token = os.environ.get(TOKEN_ENV, "")
        if not token or token in (args.api_key or []) or token == os.environ.get("VLLM_API_KEY"):
            raise RuntimeError(
                f"the grpo_specdec_weights endpoint loads weights: set {TOKEN_ENV} to a token "
                "of its own (not the API key), which each swap must carry in "
                f"{TOKEN_HEADER}, so that those who may ask for completions cannot change "
                "the weights"
            )
        if engine_client is None:
            raise RuntimeError("the grpo_specdec_weights endpoint needs an engine")
        from vllm import envs

        if envs.VLLM_SERVER_DEV_MODE:
            logger.error(
                "VLLM_SERVER_DEV_MODE is set: vLLM's /collective_rpc and weight-update routes "
                "are mounted without any key, so whoever reaches this port can change the "
                "weights the grpo_specdec_weights route guards; unset it on a server others "
                "can reach"
            )
        # Without a transfer engine (no --weight-transfer-config) every swap would fail
        # inside the workers, a 500 naming nothing the user can act on.
        if getattr(engine_client.vllm_config, "weight_transfer_config", None) is None:
            raise RuntimeError(
                "the grpo_specdec_weights endpoint loads weights through vLLM's weight-transfer "
                f'API: start vllm serve with --weight-transfer-config \'{{"backend": '
                f'"{BACKEND}"}}\''
            )
        state.grpo_engine = engine_client
        state.grpo_weights_token = token
        state.grpo_swap_lock = asyncio.Lock()
        state.grpo_mixed = {}
        state.grpo_stale_cache = None
        state.grpo_overdue = {}  # swap task -> why it is overdue
        state.grpo_swaps = set()
        state.grpo_swap_deadline_s = swap_deadline_s()
