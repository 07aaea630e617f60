"""`grpo_shm`: a vLLM weight-transfer engine for trainers on the engine's own machine.

vLLM 0.32's RL weight updates (`LLM.start_weight_update` / `start_draft_weight_update`,
`update_weights`, `finish_weight_update`, the same on `AsyncLLM` and as `vllm serve`'s RL
routes) carry weights with an engine registered in `WeightTransferEngineFactory`. vLLM's
own (nccl, ipc, ...) need CUDA; this one takes a safetensors file that the trainer wrote
to the private swap folder (`swap_folder`), which works on CPU, in-process or across
processes, and on every tensor-parallel rank at once. Start the engine with
`weight_transfer_config={"backend": "grpo_shm"}` (`--weight-transfer-config
'{"backend": "grpo_shm"}'`); one update is

    start_weight_update()        # or start_draft_weight_update() for the draft head
    update_weights({"path": "/dev/shm/grpo-specdec-UID/....safetensors", "version": 7})
    finish_weight_update()

What a bare transfer would not do, this engine does (`rank_weights.WeightSwaps`): the file's
names, shapes and config facts are checked against the model's checkpoint before anything
loads; a load that fails partway reloads the last good weights; each role (policy, draft)
keeps its own version. `update_weights` loads but does not commit: until
`finish_weight_update`, the rank can go back to the weights it had
(`WeightSwapExtension.grpo_abort_weight_update`), so that a failure on any rank can undo
the update on all of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm_plugin.group.drafter import stamp_policy_version
from vllm_plugin.weights.rank_weights import WeightSwaps
from vllm_plugin.weights.swap_folder import process_alive, writer_pid

# An update session that was opened and sent no weights for this long is taken for one
# whose trainer died before its first file (a live trainer writes its file before it
# opens the session, so it sends within seconds).
EMPTY_SESSION_STALE_S = 300.0

BACKEND = "grpo_shm"


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the trainer and the engine share a machine and a user."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a safetensors file in the swap folder
    version: int


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.swaps = WeightSwaps(vllm_config)
        self._role: str | None = None
        self._opened_at = 0.0
        self.sender: int | None = None  # pid of the trainer that sent this session's file

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        # vLLM points `model` at the draft for start_draft_weight_update.
        self._role = "policy" if self.model is self._default_model else "draft"
        self._opened_at, self.sender = time.monotonic(), None

    def update_weights(self, update_info: dict) -> None:
        # The base class would synchronise an accelerator after receiving; a load from a
        # file is complete when it returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        if not isinstance(update_info.version, int) or update_info.version < 0:
            raise ValueError(
                f"update_info.version must be an int >= 0, got {update_info.version!r}"
            )
        self.sender = writer_pid(update_info.path)
        self.swaps.load(
            self._role, self.model, self.model_config, update_info.path, update_info.version
        )

    def finish_weight_update(self) -> None:
        # vLLM's worker stays in its update session for good if this raises: nothing here can.
        committed = self.swaps.commit(self._role)
        if committed is not None and self._role == "policy":
            stamp_policy_version(self._default_model, committed)
        self._role = None

    def describe_session(self) -> str:
        idle = time.monotonic() - self._opened_at
        if self.sender is not None:
            return (
                f"the {self._role} update session opened {idle:.0f} s ago is held: its "
                f"trainer (pid {self.sender}) is alive"
            )
        return (
            f"the {self._role} update session opened {idle:.0f} s ago has sent nothing yet "
            f"(one that sends nothing for {EMPTY_SESSION_STALE_S:.0f} s is ended)"
        )

    def stale_session(self) -> str | None:
        """Why the open update session has no live trainer behind it (its sender died,
        or it sent nothing for EMPTY_SESSION_STALE_S); None for no session or a live one."""
        if self._role is None:
            return None
        if self.sender is not None:
            if process_alive(self.sender):
                return None
            loaded = self._role in self.swaps.pending
            return (
                f"the trainer (pid {self.sender}) that sent a {self._role} update died before "
                + ("committing it" if loaded else "its load finished")
            )
        idle = time.monotonic() - self._opened_at
        if idle < EMPTY_SESSION_STALE_S:
            return None
        return f"a {self._role} update session was opened {idle:.0f} s ago and sent nothing"

    def abort(self) -> None:
        """Back to the weights this rank had before the update began (see rank_weights)."""
        if self._role is not None:
            self.swaps.roll_back(self._role, self.model, self.model_config)
        self._role = None

    def shutdown(self) -> None:
        """The engine's swap folder goes unless a live trainer's file is in it (the files a
        dead trainer left go with it); nothing else is released: vLLM calls this both when
        the worker ends and when a trainer lets go of an engine that goes on serving, and in
        the second case the open files of the last good weights are what a later abort
        restores (unlinked, they need no folder), and the next swap makes the folder again.
        The files close with the worker, which frees their shared memory."""
        self.swaps.release_folder()


def register() -> None:
    """Make `grpo_shm` a backend vLLM can build (in every process that builds engines:
    vllm_plugin.register runs there as a general plugin)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "vllm_plugin.weights.shm_transfer", "ShmWeightTransferEngine"
        )
    except ValueError:  # registered already (plugins load once per engine)
        pass
