"""Fixes for vLLM bugs this project cannot work around otherwise; one module per fix,
each naming the vLLM version it targets and applying only there.

Most of them change vLLM 0.32's V1 model runner (`vllm.v1.worker.gpu_model_runner`, which
the CPU runner subclasses), its drafter or its rejection sampler. vLLM 0.32 also ships Model
Runner V2 (`vllm/v1/worker/gpu/`, its own drafters and sampler), which calls none of them,
and makes it the default wherever Triton runs (CUDA, ROCm). So the plugin chooses V1 there
(`choose_model_runner`) unless the user chose, and a V1 patch applies only where V1 runs.
"""

from __future__ import annotations

import logging
import os

from vllm_plugin import compat

# under vLLM's "vllm" logger, whose handler vLLM configures: a logger of our own has none,
# and Python drops its INFO records
logger = logging.getLogger(f"vllm.{__name__}")

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# What the patches of V1 give, lost where V2 runs.
LOST_ON_V2 = (
    "steps with k = 0 still run the draft pass, group drafts never draft, and on CPU "
    "sampled speculative decoding runs as vLLM ships it"
)


def running_on_cpu(version: str) -> bool:
    """Whether this process runs vLLM `version` on CPU."""
    import vllm
    from vllm.platforms import current_platform

    return vllm.__version__ == version and current_platform.is_cpu()


def runs_v1_model_runner() -> bool:
    """Whether engines started in this process run vLLM's V1 model runner, as vLLM 0.32
    decides (`VllmConfig.use_v2_model_runner`): VLLM_USE_V2_MODEL_RUNNER where set, else V2
    wherever Triton runs. (vLLM also forces V2 for watermarking and HiSparse attention,
    whatever the variable says; the V1 patches are inert in such an engine.)"""
    chosen = compat.v2_model_runner_setting()
    return not (compat.has_triton() if chosen is None else chosen)


def runner_name() -> str:
    return "V1" if runs_v1_model_runner() else "V2"


def engine_runner(vllm_config) -> str:
    """The model runner an engine of `vllm_config` runs, as vLLM decides it for that engine:
    besides VLLM_USE_V2_MODEL_RUNNER and Triton, watermarking and HiSparse attention force
    V2 whatever the variable says."""
    return "V2" if vllm_config.use_v2_model_runner else "V1"


def acting(patched: list[str], runner: str) -> list[str]:
    """Of the patches applied in this process, those that act in an engine on `runner`: on
    V2, none of those that change the V1 runner (V2 never calls what they change)."""
    import importlib

    def needs_v1(name: str) -> bool:
        return importlib.import_module(f"{__name__}.{name}").NEEDS_V1_RUNNER

    return [name for name in patched if runner == "V1" or not needs_v1(name)]


def choose_model_runner() -> None:
    """Run engines on V1 where vLLM would pick V2 and the user did not choose, and say so
    once; say what is lost where the user chose V2. vLLM loads general plugins before it
    builds an engine's config, in every process (`EngineArgs.__post_init__`, so in `LLM(...)`
    and the project's `Engine`; `vllm serve`'s argument parser; each engine-core and worker
    process), and child processes inherit the variable."""
    import vllm

    if vllm.__version__ != compat.TARGET_VERSION:
        return  # no patch applies
    chosen = compat.v2_model_runner_setting()
    if chosen is None and compat.has_triton():
        os.environ[RUNNER_ENV] = "0"
        logger.info(
            "grpo-specdec: engines run Model Runner V1 (%s=0 set): vLLM's default here, V2, "
            "never calls the V1 classes the plugin patches, where %s; set %s=1 to run V2 "
            "without the patches",
            RUNNER_ENV,
            LOST_ON_V2,
            RUNNER_ENV,
        )
    elif chosen:
        logger.warning(
            "grpo-specdec: Model Runner V2 (%s=1): the plugin's patches of the V1 runner are "
            "not applied, as V2 never calls what they change, so %s; unset %s to run V1",
            RUNNER_ENV,
            LOST_ON_V2,
            RUNNER_ENV,
        )
