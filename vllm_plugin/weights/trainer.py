"""The trainer's side of the `grpo_shm` weight transfer (the engine's is `shm_transfer`), in
vLLM's trainer API (0.32 and 0.33): a `TrainerWeightTransferEngine` registered as `grpo_shm`
with `WeightTransferTrainerFactory`, driven through any `VLLMWeightSyncClient` (`clients`).

    engine = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, draft=True), client=LLMClient(llm), source=weights)
    engine.send_weights(version=7)

`send_weights` writes the source's tensors to the engine's private swap folder and drives one
update through vLLM's lifecycle (`lifecycle`: a failed load is undone on every rank, a
session a dead trainer left open is ended first); then the prefix cache is reset with the
running requests recomputed, so that none computes with KV of the old weights (vLLM's
update does not do it).

`LLMWeights` does that for an `LLM` in this process, a trainer engine per role, and reads
what its ranks serve: the project's `Engine` publishes through it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from vllm_plugin.compat import full_weights
from vllm_plugin.weights.clients import LLMClient
from vllm_plugin.weights.lifecycle import run_update
from vllm_plugin.weights.manifest import MixedWeightsError
from vllm_plugin.weights.rank_weights import ROLES, agreed_versions, merged_mixed, mixed_reasons
from vllm_plugin.weights.shm_transfer import BACKEND
from vllm_plugin.weights.swap_folder import remove_engine_folder, swap_file


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
        folder = self.client.swap_folder()
        with swap_file(role, weights, version, self.metadata, folder) as path:
            written = time.perf_counter() - start
            run_update(self.client, role, {"path": str(path), "version": version}, version)
        self.client.reset_prefix_cache()
        return written


class LLMWeights:
    """The weights of an `LLM` in this process, which must run the plugin's worker extension
    (`vllm_plugin.weight_swap.WeightSwapExtension`) and this transfer backend
    (`weight_transfer_config=TRANSFER_CONFIG`): published per role, each through its own
    trainer engine (initialised once), and read back from every rank."""

    TRANSFER_CONFIG = {"backend": BACKEND}

    def __init__(self, llm):
        self.llm = llm
        self._client = LLMClient(llm)  # one for both roles: it keeps the engine's swap folder
        self._senders: dict[str, ShmTrainerEngine] = {}  # role -> its trainer engine

    def publish(self, role: str, weights: dict, version: int, metadata: dict | None = None) -> dict:
        """Load new `role` ("draft" or "policy") weights into the running engine; what the
        swap took (the ranks' validation and load, the file's writing, in all).

        The weights go through a safetensors file in the private swap folder; each rank
        keeps the last good one open, to reload it if a later swap fails halfway. A
        rejected swap raises and leaves every rank on its old weights (a rank that had
        loaded the new ones goes back). `metadata` declares config facts the weights were
        built for (e.g. vocab_size); the engine rejects them if its model differs.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        start = time.perf_counter()
        sender = self._senders.get(role)
        if sender is None:
            sender = self._senders[role] = ShmTrainerEngine.trainer_init(
                ShmTrainerInitInfo(rank=0, draft=role == "draft"), client=self._client
            )
        sender.source, sender.metadata = StateDictSource(weights), metadata
        write_s = sender.send_weights(version)
        report = self.llm.collective_rpc("grpo_last_swap_report")
        return {
            "version": version,
            **report[0],
            "write_s": write_s,
            "total_s": time.perf_counter() - start,
        }

    def versions(self) -> dict[str, int]:
        """The versions of the weights every rank serves (they must agree)."""
        return agreed_versions(self.llm.collective_rpc("grpo_weight_versions"))

    def declare(self, versions: dict[str, int]) -> None:
        """Number the weights the engine started from (e.g. a checkpoint's); `versions`
        reports them until each role's next swap."""
        self.llm.collective_rpc("grpo_declare_weight_versions", args=(versions,))

    def refuse_if_mixed(self) -> None:
        """Raise `MixedWeightsError` if any rank's weights of a role may be a mix (a swap
        whose restore failed too): nothing may be generated on them."""
        mixed = merged_mixed(self.llm.collective_rpc("grpo_mixed_weights"))
        if mixed:
            raise MixedWeightsError("refusing to generate: " + "; ".join(mixed_reasons(mixed)))

    def engine_stopped(self) -> None:
        """Remove the stopped engine's swap folder if it is still there: each rank removes
        it as it ends (`ShmWeightTransferEngine.shutdown`), but vLLM kills a worker that takes
        over VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s) to end, which a busy machine makes
        happen, and the folder would then stay in shared memory until the machine restarts."""
        folder = self._client.known_swap_folder
        if folder is not None:
            remove_engine_folder(Path(folder))


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, ShmTrainerEngine)
    except ValueError:  # registered already in this process
        pass


register()
