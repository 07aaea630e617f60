"""The weight-swap worker extension for verl's vLLM engines.

verl (0.9) builds its rollout engines with its own worker extension,
`vLLMColocateWorkerExtension`, whose methods it calls (`monkey_patch_model` after start,
`update_weights_from_ipc` to sync weights); one named in
`actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls` must subclass it.
This class adds the plugin's methods (`grpo_swap_weights`, `grpo_weight_versions`, group
drafts) to verl's. Importable only where verl is installed.
"""

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from vllm_plugin.weight_swap import WeightSwapExtension


class VerlWeightSwapExtension(WeightSwapExtension, vLLMColocateWorkerExtension):
    pass
