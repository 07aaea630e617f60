"""The weight-swap worker extension for verl's vLLM engines.

verl (0.9) builds its rollout engines with its own worker extension,
`vLLMColocateWorkerExtension`, whose methods it calls (`monkey_patch_model` after start,
`update_weights_from_ipc` to sync weights); one named in
`actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls` must subclass it.
This class adds the plugin's methods (`grpo_weight_versions`, `grpo_abort_weight_update`,
group drafts) to verl's; the engine also needs `weight_transfer_config: {backend: grpo_shm}`
for draft updates through vLLM's weight-update API (docs/USAGE.md). Importable only where verl is installed.
"""

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from vllm_plugin.weight_swap import WeightSwapExtension


class VerlWeightSwapExtension(WeightSwapExtension, vLLMColocateWorkerExtension):
    pass
