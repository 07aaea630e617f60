"""Patches of vLLM, one module each, naming the vLLM version it targets and applying only
there: `fixes/` for vLLM's bugs this project cannot work around otherwise, `features/` for
what it adds where vLLM has no extension point (a free k = 0 step, sampled drafts in a
head's own vocabulary on CPU, group drafts).

Most of them change the V1 model runner of vLLM 0.32 and 0.33
(`vllm.v1.worker.gpu_model_runner`, which the CPU runner subclasses), its drafter or its
rejection sampler. Both also ship Model
Runner V2 (`vllm/v1/worker/gpu/`, its own drafters and sampler), which calls none of them,
and makes it the default wherever Triton runs (CUDA, ROCm). The plugin leaves that choice
to vLLM and the user: V2 is where vLLM captures FULL CUDA graphs for every k a
concurrency-aware engine may run (`vllm_plugin/k_table.py`), V1 turns such an engine
PIECEWISE. A V1 patch applies only where V1 runs; where V2 runs the plugin says once what
that leaves out (`say_runner`).
"""

from __future__ import annotations

import logging

from vllm_plugin import compat

# under vLLM's "vllm" logger, whose handler vLLM configures: a logger of our own has none,
# and Python drops its INFO records
logger = logging.getLogger(f"vllm.{__name__}")

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# What the patches of V1 give, lost where V2 runs.
LOST_ON_V2 = (
    "steps with k = 0 still run the draft pass, group drafts are refused, and on CPU "
    "sampled speculative decoding runs as vLLM ships it"
)


def vllm_is(versions: tuple[str, ...]) -> bool:
    """Whether this process runs one of vLLM `versions`, a local build included: CUDA wheels
    carry a local label ("0.33.0+cu130"), which changes none of the code a patch targets."""
    import vllm
    from packaging.version import InvalidVersion, Version

    try:
        return Version(vllm.__version__).public in versions
    except InvalidVersion:
        return False


def running_on_cpu(versions: tuple[str, ...]) -> bool:
    """Whether this process runs one of vLLM `versions` on CPU."""
    from vllm.platforms import current_platform

    return vllm_is(versions) and current_platform.is_cpu()


def runs_v1_model_runner() -> bool:
    """Whether engines started in this process run vLLM's V1 model runner, as vLLM 0.32 and
    0.33 decide (`VllmConfig.use_v2_model_runner`): VLLM_USE_V2_MODEL_RUNNER where set, else V2
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
    import pkgutil

    from vllm_plugin.patches import features

    feature_names = {m.name for m in pkgutil.iter_modules(features.__path__)}

    def needs_v1(name: str) -> bool:
        kind = "features" if name in feature_names else "fixes"
        return importlib.import_module(f"{__name__}.{kind}.{name}").NEEDS_V1_RUNNER

    return [name for name in patched if runner == "V1" or not needs_v1(name)]


def say_runner() -> None:
    """Where engines run Model Runner V2, say once what the V1 patches would have given and
    how to get them. vLLM loads general plugins in every process it starts, before it builds
    an engine's config (`EngineArgs.__post_init__`), so this runs once per process."""
    if not vllm_is(compat.SUPPORTED_VERSIONS) or runs_v1_model_runner():
        return
    logger.info(
        "grpo-specdec: engines here run Model Runner V2 (full CUDA graphs for every k of a "
        "concurrency-aware engine); the plugin's patches of V1 do not act there, so %s. Set "
        "%s=0 for V1, whose graphs are then PIECEWISE under a per-step k",
        LOST_ON_V2,
        RUNNER_ENV,
    )
