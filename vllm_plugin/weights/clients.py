"""The clients through which vLLM's weight-update lifecycle (`lifecycle`) reaches an engine,
one per way of reaching it: vLLM's `VLLMWeightSyncClient` calls and what the plugin adds,
the draft's start (vLLM's own clients cannot start a draft update), the abort of a load
that failed on another rank, the end of a session a dead trainer left open and, for a
trainer's swap, the engine's own swap folder (where it writes the files it names) and the
prefix-cache reset after it.

- `LLMClient`: an `LLM` in this process;
- `HTTPClient`: a `vllm serve` with vLLM's RL routes (`VLLM_SERVER_DEV_MODE=1`);
- `RPCClient`: any engine reached only through `collective_rpc`, as verl reaches its
  server's;
- `AsyncEngineClient`: an `AsyncLLM` on an event loop in another thread, as the served
  route (`endpoint`) reaches its engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from vllm_plugin.weights.lifecycle import merged_session_ends
from vllm_plugin.weights.swap_folder import agreed_folder


class LLMClient:
    """A `VLLMWeightSyncClient` (and more) for an `LLM` in this process."""

    def __init__(self, llm):
        self.llm = llm
        self._swap_folder: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def abort_weight_update(self) -> None:
        self.llm.collective_rpc("grpo_abort_weight_update")

    def end_stale_weight_update(self) -> dict:
        return merged_session_ends(self.llm.collective_rpc("grpo_end_stale_weight_update"))

    def swap_folder(self) -> str:
        # Asked once: the folder is named by the engine's id, and an `LLM` keeps its engine
        # for life (the other clients' servers may restart, as another engine, at one URL).
        if self._swap_folder is None:
            self._swap_folder = agreed_folder(self.llm.collective_rpc("grpo_swap_folder"))
        return self._swap_folder

    @property
    def known_swap_folder(self) -> str | None:
        """The swap folder the engine named, if it was asked (None otherwise)."""
        return self._swap_folder

    def reset_prefix_cache(self) -> None:
        check_cache_reset(self.llm.reset_prefix_cache(reset_running_requests=True))


CACHE_NOT_RESET = (
    "the weights are loaded, but the engine could not reset its prefix cache, which holds KV "
    "of the old weights"
)


def check_cache_reset(success) -> None:
    """vLLM answers a cache reset with whether it happened (`LLM`/`AsyncLLM` return it, the
    server's route says `{"success": false}` with status 200): a failed one is an error."""
    if success is False or (isinstance(success, list) and False in success):
        raise RuntimeError(CACHE_NOT_RESET)


class HTTPClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP client with the draft's start, the plugin's abort and the cache reset
    (through vLLM's dev routes `/collective_rpc` and `/reset_prefix_cache`, mounted with
    its RL routes)."""

    def start_draft_weight_update(self) -> None:
        self._post("start_draft_weight_update")

    def abort_weight_update(self) -> None:
        self._post("collective_rpc", {"method": "grpo_abort_weight_update"})

    def _rpc(self, method: str) -> list:
        import requests

        response = requests.post(
            f"{self.base_url}/collective_rpc", json={"method": method}, timeout=self.timeout
        )
        response.raise_for_status()
        return response.json()["results"]

    def end_stale_weight_update(self) -> dict:
        return merged_session_ends(self._rpc("grpo_end_stale_weight_update"))

    def swap_folder(self) -> str:
        return agreed_folder(self._rpc("grpo_swap_folder"))

    def reset_prefix_cache(self) -> None:
        import requests

        response = requests.post(
            f"{self.base_url}/reset_prefix_cache?reset_running_requests=true",
            timeout=self.timeout,
        )
        response.raise_for_status()
        check_cache_reset(response.json().get("success"))


class RPCClient:
    """A `VLLMWeightSyncClient` (and more) for an engine reached only through its
    `collective_rpc`, as verl's trainer reaches its rollout server (`server_handle.
    collective_rpc.remote(method, kwargs=...)`): it calls on every worker the methods that
    `AsyncLLM`'s own weight-update API fans out to them, and the stack's own prefix-cache
    reset (verl's `clear_kv_cache`). The engine-level weight version is not a worker's, so
    `finish_weight_update` cannot set it; the plugin's per-role versions are set by the
    workers' load."""

    def __init__(
        self, rpc: Callable[[str, dict[str, Any] | None], Any], reset_prefix_cache: Callable
    ):
        self.rpc, self.reset_cache = rpc, reset_prefix_cache

    def reset_prefix_cache(self) -> None:
        """The stack's reset; one that returns False (vLLM's, verl's `clear_kv_cache` while
        requests run) is an error, not a swap done."""
        check_cache_reset(self.reset_cache())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.rpc("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.rpc("start_weight_update", None)

    def start_draft_weight_update(self) -> None:
        self.rpc("start_draft_weight_update", None)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.rpc("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.rpc("finish_weight_update", None)

    def abort_weight_update(self) -> None:
        self.rpc("grpo_abort_weight_update", None)

    def end_stale_weight_update(self) -> dict:
        return merged_session_ends(self.rpc("grpo_end_stale_weight_update", None))

    def swap_folder(self) -> str:
        return agreed_folder(self.rpc("grpo_swap_folder", None))


class AsyncEngineClient:
    """The lifecycle's client for an `AsyncLLM` whose event loop runs in another thread: the
    served route runs `run_update` in a worker thread, each call a coroutine on that loop."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop

    def _wait(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def start_weight_update(self) -> None:
        self._wait(self.engine.start_weight_update())

    def start_draft_weight_update(self) -> None:
        self._wait(self.engine.start_draft_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=update_info)
        self._wait(self.engine.update_weights(request))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._wait(self.engine.finish_weight_update(weight_version))

    def abort_weight_update(self) -> None:
        self._wait(self.engine.collective_rpc("grpo_abort_weight_update"))

    def end_stale_weight_update(self) -> dict:
        return merged_session_ends(
            self._wait(self.engine.collective_rpc("grpo_end_stale_weight_update"))
        )
