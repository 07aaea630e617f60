"""The plugin's `grpo_shm` weight-transfer backend with loads that can be made to fail or
hang, for a served engine (whose workers a test cannot reach): while the file named by
GRPO_TEST_FAIL_LOADS holds a count above zero, each load (of a swap, or the restore after
it) raises and lowers the count; the next load sleeps for the seconds the file named by
GRPO_TEST_SLOW_LOADS holds (and empties it). Naming this module's extension as the worker extension
registers the backend `grpo_shm_faulty` in the worker process, before vLLM builds the
engine's transfer backend; start the server with that backend."""

from __future__ import annotations

import os
import time
from pathlib import Path

from vllm_plugin.weight_swap import WeightSwapExtension
from vllm_plugin.weights.rank_weights import WeightSwaps
from vllm_plugin.weights.shm_transfer import ShmWeightTransferEngine

BACKEND = "grpo_shm_faulty"


class FaultySwaps(WeightSwaps):
    def _load(self, model, model_config, weights) -> None:
        slow = Path(os.environ["GRPO_TEST_SLOW_LOADS"])
        if slow.exists() and slow.read_text():
            seconds = float(slow.read_text())
            slow.write_text("")
            time.sleep(seconds)
        counter = Path(os.environ["GRPO_TEST_FAIL_LOADS"])
        left = int(counter.read_text()) if counter.exists() else 0
        if left > 0:
            counter.write_text(str(left - 1))
            raise RuntimeError("simulated load failure")
        super()._load(model, model_config, weights)


class FaultyShmEngine(ShmWeightTransferEngine):
    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.swaps = FaultySwaps(vllm_config)


class FaultyLoadsExtension(WeightSwapExtension):
    pass


def _register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, FaultyShmEngine)
    except ValueError:  # registered already in this process
        pass


_register()
