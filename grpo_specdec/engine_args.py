"""An EngineConfig as the arguments of vLLM's `LLM(...)`: the settings vLLM needs on this
project's paths, made in one place so that every engine (the job's, the benchmarks', the
CLI's) starts the same way.

Beside the model and its limits: the worker extension that weights are swapped through
(vllm_plugin/weight_swap.py), per-request speculative metrics (the Engine's per-call
counts are read from them), the speculative config, and, for concurrency-aware
speculation, the plugin's scheduler with the table of every k the controller may choose.
"""

from __future__ import annotations

import vllm_plugin
from grpo_specdec.engine_config import EngineConfig
from grpo_specdec.modelcheck import draft_method
from vllm_plugin.k_table import every_k_table
from vllm_plugin.patches import runner_name
from vllm_plugin.patches.features import group_drafts_v0_32
from vllm_plugin.settings import engine_dtype
from vllm_plugin.weights.trainer import LLMWeights

WORKER_EXTENSION = "vllm_plugin.weight_swap.WeightSwapExtension"
SCHEDULER = "vllm_plugin.scheduler.ConcurrencyAwareScheduler"


def engine_args(cfg: EngineConfig, extra: dict) -> dict:
    """`LLM(...)`'s keyword arguments for `cfg`; `extra` (the caller's own, e.g. a test's)
    override them, but for `additional_config`, which is merged with the controller's."""
    kwargs = dict(
        model=cfg.model,
        dtype=engine_dtype(cfg.model, cfg.dtype),
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        enforce_eager=cfg.enforce_eager,
        disable_log_stats=False,
        worker_extension_cls=WORKER_EXTENSION,
        weight_transfer_config=LLMWeights.TRANSFER_CONFIG,
    )
    if cfg.kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * (1 << 30))
    spec = cfg.speculative
    if spec is not None:
        kwargs["per_request_spec_decode_metrics"] = "detailed"
        kwargs["speculative_config"] = (
            {"method": draft_method(spec.draft), "model": spec.draft}
            if spec.draft
            # No draft model: vLLM's model-free `ngram` proposer hosts the group drafts.
            else {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 1}
        )
        kwargs["speculative_config"]["num_speculative_tokens"] = spec.k
        kwargs["speculative_config"]["draft_sample_method"] = spec.draft_sampling
        table = spec.batch_size_table
        # The controller and the group drafter live in the engine core's process
        # (this one or a child); their settings travel in the engine's config.
        kwargs["additional_config"] = spec.controller.as_additional_config()
        if spec.controller.group.enabled:
            if not vllm_plugin.applied(group_drafts_v0_32):
                raise ValueError(
                    "speculative.controller.group.enabled: group drafts are a patch of "
                    "vLLM 0.32's Model Runner V1, not applied in this process (Model "
                    f"Runner {runner_name()}: VLLM_USE_V2_MODEL_RUNNER=0 runs V1, with "
                    "PIECEWISE CUDA graphs; GRPO_SPECDEC_NO_PATCHES=1 turns the patches "
                    "off)"
                )
            # vLLM's default for EAGLE on GPU, async scheduling, feeds the drafter's own
            # drafts to the next step and never reads the group's (the patch refuses it).
            kwargs["async_scheduling"] = False
        if spec.concurrency_aware:
            kwargs["scheduler_cls"] = SCHEDULER
            # Which k a step may run; the controller chooses among them (k_table.py).
            table = every_k_table(spec.k, cfg.max_num_seqs)
        if table:
            kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] = table
    extra = dict(extra)
    kwargs["additional_config"] = {
        **kwargs.get("additional_config", {}),
        **extra.pop("additional_config", {}),
    }
    return kwargs | extra
