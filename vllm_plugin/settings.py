"""Settings of the concurrency-aware scheduler, and where it finds its latency profile.

The scheduler runs wherever vLLM runs its engine core (this process or a child), so its
settings travel in the engine's own config: `additional_config={"grpo_specdec": {...}}`
(`vllm serve --additional-config '{"grpo_specdec": {...}}'`), vLLM's place for a plugin's
settings. Without them, defaults apply and the profile is looked up in the profile store
under the served model, dtype and hardware, as `grpo-specdec profile` saved it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

CONFIG_KEY = "grpo_specdec"  # the settings' key in vLLM's additional_config
# An environment variable that once held the settings: set, it is refused with the way to
# move them, rather than ignored while the engine runs on defaults.
_OLD_ENV = "GRPO_SPECDEC_CONTROLLER"


class GroupDraftSettings(BaseModel):
    """Drafts from the text of a GRPO group (see vllm_plugin/group/drafter.py).
    Experimental: no GRPO rollout measured yet gains from them (docs/USAGE.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    max_match: int = Field(4, ge=1, le=16, description="longest context suffix matched, tokens")
    history_positions: int = Field(
        300_000,
        ge=0,
        description="tokens indexed over all prompts, finished rollouts included (~0.7 KB "
        "each at max_match 4)",
    )
    history_versions: int = Field(
        1,
        ge=0,
        description="rollouts of the policies before this many swaps stay (0: current only)",
    )
    min_confidence: float = Field(0.05, ge=0, le=1, description="no group token below this")


class ControllerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    policy: Literal["goodput", "paper", "fixed"] = "goodput"
    profile: str | None = Field(None, description="PROFILE.json; default: the profile store")
    fixed_k: int | None = Field(None, ge=0, description="k for the fixed policy (default: k_max)")
    alpha: float = Field(0.75, gt=0, description="paper policy: draft-quality constant")
    acceptance_prior: float = Field(0.6, gt=0, lt=1)
    acceptance_memory: float = Field(
        512.0, gt=1, description="verified drafts the pooled acceptance estimate rests on"
    )
    acceptance_restart_weight: float = Field(
        32.0,
        ge=0,
        description="drafts' weight the pooled evidence keeps after a weight swap or at a "
        "new wave of requests",
    )
    explore_share: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="share of modelled step time the controller may spend probing a "
        "deeper k than the one it predicts best",
    )
    learn_costs: bool = Field(
        True,
        description="time the engine's own steps and correct the profile's prices with "
        "them; false: price every step as the profile says",
    )
    acceptance_optimism: float = Field(
        1.0,
        ge=0,
        description="standard errors above the first draft position's acceptance estimate "
        "k is chosen on (deeper positions: their estimates)",
    )
    trace_steps: int = Field(100_000, ge=0, description="per-step (time, B, k) records kept")
    group: GroupDraftSettings = GroupDraftSettings()

    @classmethod
    def of_engine(cls, vllm_config) -> ControllerSettings:
        """The settings an engine was started with, validated by field."""
        if raw := os.environ.get(_OLD_ENV):
            example = f'{{"{CONFIG_KEY}": {raw}}}'
            raise ValueError(
                f"{_OLD_ENV} is not read: pass the controller settings in the engine's config, "
                f"additional_config={example} (vllm serve --additional-config '{example}'), "
                f"and unset {_OLD_ENV}"
            )
        extra = vllm_config.additional_config
        given = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
        try:
            return cls.model_validate(given or {})
        except ValueError as err:
            raise ValueError(
                f"additional_config[{CONFIG_KEY!r}] is not valid controller settings: {err}"
            ) from None

    def as_additional_config(self) -> dict:
        return {CONFIG_KEY: self.model_dump(exclude_none=True)}


def hardware_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return platform.processor() or platform.machine()


# Bumped when what a profile measures or how it is fitted changes: 2 = steps with k = 0
# skip the draft pass (patches/features/free_k0_v0_32.py) and the fit prices speculating at all;
# 3 = the fit is in relative error; 4 = steps at a long context time the attention term;
# 5 = prefill and T = 1 sampling are timed for the simulator.
PROFILE_FORMAT = 5


def profile_key(
    model: str,
    dtype,
    draft: str | None,
    draft_sampling: str = "greedy",
    tensor_parallel_size: int = 1,
) -> dict:
    """What a latency profile is stored under. `dtype` may be as asked ("auto" too) or
    as vLLM chose it: the key holds the dtype the engine runs in, either way. Sampled
    drafting costs differently (its steps are timed sampling at T = 1), so it is named, as
    is the tensor-parallel size. What vLLM decides as the engine starts (runner, async
    scheduling, graph mode) is kept in the profile itself (`engine_shape`) and checked when
    it is loaded."""
    key = {
        "format": PROFILE_FORMAT,
        "model": str(Path(model).resolve()) if Path(model).exists() else model,
        "dtype": engine_dtype(model, dtype),
        "draft_arch": _draft_arch(draft),
        "hardware": hardware_name(),
        "tensor_parallel_size": tensor_parallel_size,
    }
    if draft_sampling != "greedy":
        key["draft_sampling"] = draft_sampling
    return key


def engine_shape(vllm_config) -> dict:
    """What vLLM decided for an engine as it started that changes what its steps cost: the
    model runner, async scheduling and the CUDA graph mode (NONE on CPU). (Its k_max need
    not match: the latency model prices a step by its tokens, B (k + 1).)"""
    from vllm_plugin.patches import engine_runner

    return {
        "runner": engine_runner(vllm_config),
        "async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
        "cudagraph_mode": vllm_config.compilation_config.cudagraph_mode.name,
    }


def check_engine_shape(profile: dict, path: Path, vllm_config) -> None:
    """Refuse a profile timed on an engine whose steps cost differently from this one's."""
    timed, running = profile.get("engine"), engine_shape(vllm_config)
    if not timed:
        return  # timed before profiles recorded it
    differ = {f: (timed[f], running[f]) for f in running if timed[f] != running[f]}
    if differ:
        said = "; ".join(f"{f}: profiled {a}, this engine {b}" for f, (a, b) in differ.items())
        raise ValueError(
            f"latency profile {path} was timed on another kind of engine ({said}): run "
            "`grpo-specdec profile` again on an engine started as this one is"
        )


_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (Linux reports it in /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return any(flag in line.split() for flag in _BF16_CPU_FLAGS)
    return False


def bf16_emulated() -> bool:
    """Whether vLLM would emulate bfloat16 in this process: on a CPU without its instructions."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and not cpu_has_bf16()


def engine_dtype(model: str, dtype) -> str:
    """The dtype an engine runs `model` in when asked for `dtype` (a name or a torch dtype).
    For "auto" vLLM weighs the checkpoint's dtype against the platform's (x86 CPUs run
    even float32 checkpoints in bfloat16), so it is asked; except on a CPU without bfloat16
    instructions, where vLLM 0.32 still picks bfloat16 and emulates it (a SmolLM2 decode
    step at 32 sequences took ~0.8 s instead of ~45 ms): there "auto" is float32."""
    if str(dtype) == "auto":
        import torch
        from vllm.config import ModelConfig

        dtype = ModelConfig(model=model, dtype="auto").dtype
        if bf16_emulated() and dtype != torch.float32:
            dtype = torch.float32
    return str(dtype).removeprefix("torch.")


def _draft_arch(draft: str | None) -> str | None:
    cfg = Path(draft or "") / "config.json"
    if not draft or not cfg.is_file():
        return None
    arch = json.loads(cfg.read_text()).get("architectures") or [None]
    return arch[0]


def cache_dir() -> Path:
    """This project's folder in the user's cache (XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grpo-specdec"


def profile_store() -> Path:
    return cache_dir() / "profiles"


def store_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return profile_store() / f"{digest}.json"


def load_latency(settings: ControllerSettings, vllm_config):
    """The latency model of the profile the settings name, or of the one stored for this
    engine's model, dtype, draft and hardware; an error naming the command that makes one
    where there is none."""
    latency, missing = find_latency(settings, vllm_config)
    if latency is None:
        raise FileNotFoundError(missing)
    return latency


def find_latency(settings: ControllerSettings, vllm_config):
    """(the latency model, None) as `load_latency`, or (None, why) where no profile is
    stored for this engine: a profile named in the settings must exist."""
    from vllm_plugin.controller import profile_latency

    spec = vllm_config.speculative_config
    key = profile_key(
        vllm_config.model_config.model,
        vllm_config.model_config.dtype,
        spec.model if spec else None,
        spec.draft_sample_method if spec else "greedy",
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
    )
    path = Path(settings.profile) if settings.profile else store_path(key)
    if not path.is_file():
        missing = (
            f"no latency profile at {path} for {key}; run `grpo-specdec profile --model "
            f"{vllm_config.model_config.model} --draft {spec.model if spec else 'DRAFT'}"
            f"{' --draft-sampling ' + spec.draft_sample_method if key.get('draft_sampling') else ''}"
            " --out profile.json` first (it also stores it there), "
            f'or name a profile in additional_config["{CONFIG_KEY}"]["profile"]'
        )
        if settings.profile:
            raise FileNotFoundError(missing)
        return None, missing
    profile = read_profile(path)
    check_engine_shape(profile, path, vllm_config)
    if settings.profile:
        check_profile_key(profile, path, key)
    return profile_latency(profile), None


# A checkpoint of the profiled model costs what the model did; the rest changes the costs.
_SAME_COSTS_ANY_MODEL = ("model", "format")
_UNNAMED = {"draft_sampling": "greedy"}  # what a key that does not name a field means


def check_profile_key(profile: dict, path: Path, key: dict) -> None:
    """Refuse a profile named for an engine other than the one it was timed for (its dtype,
    draft, hardware, tensor-parallel size or draft sampling differ: each difference is
    named). Another model path is said and let pass: a run's checkpoints, and the
    folders a trainer saves, are priced as the model they came from."""
    timed = profile.get("key")
    if not timed:
        return  # written by hand: nothing to compare
    # What the profile's key names (older formats name less), and the draft sampling, which
    # a key names only where it is not greedy.
    fields = sorted((set(timed) | {"draft_sampling"}) - set(_SAME_COSTS_ANY_MODEL))
    said = {f: (timed.get(f, _UNNAMED.get(f)), key.get(f, _UNNAMED.get(f))) for f in fields}
    differ = {f: pair for f, pair in said.items() if pair[0] != pair[1]}
    if differ:
        said = "; ".join(f"{f}: profiled {a}, this engine {b}" for f, (a, b) in differ.items())
        raise ValueError(
            f"latency profile {path} was timed for another engine ({said}): run "
            "`grpo-specdec profile` for this one, or name none (the controller then learns "
            "its prices from the engine's own steps)"
        )
    if timed.get("model") != key["model"]:
        logger.info(
            "latency profile %s was timed on %s; this engine serves %s, priced alike",
            path,
            timed.get("model"),
            key["model"],
        )


def read_profile(path: Path) -> dict:
    """The latency profile at `path`, or an error naming the file and what is wrong."""
    from vllm_plugin.controller import profile_latency

    try:
        profile = json.loads(path.read_text())
        profile_latency(profile)  # every part the controller reads is there
    except json.JSONDecodeError as err:
        raise ValueError(
            f"latency profile {path}: not valid JSON (line {err.lineno}: {err.msg}); run "
            "`grpo-specdec profile` again or name another"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(
            f"latency profile {path}: not a profile `grpo-specdec profile` writes "
            f"({type(err).__name__}: {err})"
        ) from None
    return profile


DEADLINE_ENV = "GRPO_SPECDEC_SWAP_DEADLINE_S"


def swap_deadline_s() -> float:
    """How long a weight update may take before the served route answers 503 and the engine
    stops waiting on it (GRPO_SPECDEC_SWAP_DEADLINE_S, 600 s by default)."""
    text = os.environ.get(DEADLINE_ENV, "600")
    try:
        deadline = float(text)
    except ValueError:
        deadline = float("nan")
    if not 0 < deadline < float("inf"):
        raise RuntimeError(f"{DEADLINE_ENV}={text!r}: a swap's deadline must be seconds above 0")
    return deadline
