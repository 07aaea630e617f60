"""The trainer's side of the `grpo_shm` weight transfer (vllm_plugin/weights/shm_transfer.py), in
vLLM's trainer API (0.32 and 0.33): a `TrainerWeightTransferEngine` registered as `grpo_shm` with
`WeightTransferTrainerFactory`, driven through any `VLLMWeightSyncClient`.

    engine = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, draft=True), client=LLMClient(llm), source=weights)
    engine.send_weights(version=7)

`send_weights` writes the source's tensors to the private swap folder and drives one
update through vLLM's lifecycle (vllm_plugin/weights/lifecycle.py: a failed load is undone on
every rank, a session a dead trainer left open is ended first); then the prefix cache is
reset with the running requests recomputed, so that none computes with KV of the old
weights (vLLM's update does not do it). Clients: `LLMClient` (an `LLM` in this
process), `HTTPClient` (a `vllm serve` with vLLM's RL routes, `VLLM_SERVER_DEV_MODE=1`) and
`RPCClient` (any engine reached only through `collective_rpc`, as verl reaches its server's);
vLLM's own clients cannot start a draft update, which these add.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from vllm_plugin.compat import full_weights
from vllm_plugin.weights.lifecycle import merged_session_ends, run_update
from vllm_plugin.weights.shm_transfer import BACKEND
from vllm_plugin.weights.swap_folder import swap_file


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    draft: bool = False  # the update targets the engine's draft model
    metadata: dict[str, str] | None = None  # config facts the weights were built for


class StateDictSource(WeightSource):
    """A `WeightSource` over a name -> tensor dict under the checkpoint's names, in both
    trainer APIs: vLLM 0.33 reads `metadata` as a cached property and iterates
    `iter_full()`; vLLM 0.32 iterates the source itself (its `metadata()` method is read
    only by the NCCL backend, never on this one's path)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.weights.items())

    __iter__ = iter_full


class ShmTrainerEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    init_info_cls = ShmTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ShmTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.draft, engine.metadata = init_info.draft, init_info.metadata
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self, version: int) -> float:
        """One update to weights version `version`; the seconds spent writing the file.
        Every rank iterates the source (its gathers are collectives); rank 0 sends."""
        weights = dict(full_weights(self.source))
        if not self.is_sender:
            return 0.0
        start = time.perf_counter()
        role = "draft" if self.draft else "policy"
        with swap_file(role, weights, version, self.metadata) as path:
            written = time.perf_counter() - start
            run_update(self.client, role, {"path": str(path), "version": version}, version)
        self.client.reset_prefix_cache()
        return written


class LLMClient:
    """A `VLLMWeightSyncClient` (and more) for an `LLM` in this process."""

    def __init__(self, llm):
        self.llm = llm

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

    def end_stale_weight_update(self) -> dict:
        import requests

        response = requests.post(
            f"{self.base_url}/collective_rpc",
            json={"method": "grpo_end_stale_weight_update"},
            timeout=self.timeout,
        )
        response.raise_for_status()
        return merged_session_ends(response.json()["results"])

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


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, ShmTrainerEngine)
    except ValueError:  # registered already in this process
        pass


register()
