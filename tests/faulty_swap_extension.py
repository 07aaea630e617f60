"""The plugin's weight-swap extension with loads that can be made to fail, for a served
engine (whose workers a test cannot reach): while the file named by GRPO_TEST_FAIL_LOADS
holds a count above zero, each load (of a swap, or the restore after it) raises and
lowers the count."""

from __future__ import annotations

import os
from pathlib import Path

from vllm_plugin.weight_swap import WeightSwapExtension


class FaultyLoadsExtension(WeightSwapExtension):
    def _grpo_load(self, role, weights) -> None:
        counter = Path(os.environ["GRPO_TEST_FAIL_LOADS"])
        left = int(counter.read_text()) if counter.exists() else 0
        if left > 0:
            counter.write_text(str(left - 1))
            raise RuntimeError(f"simulated {role} load failure")
        super()._grpo_load(role, weights)
