"""A vLLM engine started from one validated config, generating G samples per prompt.

The wrapper is thin on purpose: it owns the settings vLLM needs on this project's
paths (speculative config, worker extension, scheduler), tokenises prompts the same
way for every caller, and turns vLLM's cumulative speculative counters into per-call
metrics.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from grpo_specdec.config import StrictModel
from grpo_specdec.modelcheck import check_draft_matches_target, check_model_dir


class SpeculativeSettings(StrictModel):
    draft: str = Field(description="folder of an EAGLE draft head in vLLM's checkpoint format")
    k: int = Field(3, ge=1, le=16, description="draft tokens per step (the most, when adaptive)")


class EngineConfig(StrictModel):
    model: str
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(1024, ge=16)
    max_num_seqs: int = Field(256, ge=1)
    kv_cache_gib: float = Field(1.0, gt=0)
    seed: int = 0
    enforce_eager: bool = False
    engine_process: Literal["in_process", "separate"] = "in_process"
    speculative: SpeculativeSettings | None = None

    @model_validator(mode="after")
    def _paths_exist(self) -> EngineConfig:
        check_model_dir(self.model, "model")
        if self.speculative is not None:
            check_draft_matches_target(self.speculative.draft, self.model)
        return self


class SamplingSettings(StrictModel):
    n: int = Field(1, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(64, ge=1)
    seed: int | None = None

    @model_validator(mode="after")
    def _greedy_means_one_sample(self) -> SamplingSettings:
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"n={self.n} samples per prompt need temperature > 0 (greedy gives one answer)"
            )
        return self


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters at one moment."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_pos), len(earlier.accepted_per_pos))
        pad = lambda xs: list(xs) + [0] * (width - len(xs))  # noqa: E731
        return SpecCounters(
            drafts=self.drafts - earlier.drafts,
            draft_tokens=self.draft_tokens - earlier.draft_tokens,
            accepted_tokens=self.accepted_tokens - earlier.accepted_tokens,
            accepted_per_pos=[
                a - b
                for a, b in zip(
                    pad(self.accepted_per_pos), pad(earlier.accepted_per_pos), strict=True
                )
            ],
        )

    def metrics(self) -> dict:
        drafts = max(self.drafts, 1)
        return {
            **asdict(self),
            "acceptance_rate": self.accepted_tokens / self.draft_tokens
            if self.draft_tokens
            else 0.0,
            "mean_acceptance_length": self.accepted_tokens / drafts + 1.0 if self.drafts else 1.0,
            "per_position_acceptance": [a / drafts for a in self.accepted_per_pos],
        }


@dataclass
class GenerationResult:
    prompt_token_ids: list[list[int]]
    outputs: list[list[Sample]]  # [prompt][sample]
    spec: dict
    wall_s: float

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(s.token_ids) for group in self.outputs for s in group)

    def to_json(self) -> dict:
        return {
            "outputs": [[asdict(s) for s in group] for group in self.outputs],
            "spec": self.spec,
            "wall_s": self.wall_s,
        }


_COUNTER_NAMES = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


class Engine:
    """A running vLLM engine. Construct once; generate many times."""

    WORKER_EXTENSION = "vllm_plugin.weight_swap.WeightSwapExtension"

    def __init__(self, cfg: EngineConfig, **extra_llm_kwargs):
        self.cfg = cfg
        # The engine-core process mode is read from the environment when the engine
        # starts; vLLM caches env reads once an engine runs, so drop that cache first.
        import vllm.envs as envs

        envs.disable_envs_cache()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
            "0" if cfg.engine_process == "in_process" else "1"
        )
        from vllm import LLM

        kwargs = dict(
            model=cfg.model,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            kv_cache_memory_bytes=int(cfg.kv_cache_gib * (1 << 30)),
            seed=cfg.seed,
            enforce_eager=cfg.enforce_eager,
            disable_log_stats=False,
            worker_extension_cls=self.WORKER_EXTENSION,
        )
        if cfg.speculative is not None:
            kwargs["speculative_config"] = {
                "method": "eagle",
                "model": cfg.speculative.draft,
                "num_speculative_tokens": cfg.speculative.k,
            }
        kwargs.update(extra_llm_kwargs)
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._swap_files: dict[str, Path] = {}

    # ---- prompts -------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of a user prompt: through the chat template when the model has one."""
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(prompt)

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling: SamplingSettings,
        chat: bool = True,
        use_tqdm: bool = False,
    ) -> GenerationResult:
        from vllm import SamplingParams

        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        ids = [p if isinstance(p, list) else self.encode(p, chat) for p in prompts]
        for i, p in enumerate(ids):
            if len(p) + 1 > self.cfg.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens, which leaves no room to generate within "
                    f"max_model_len={self.cfg.max_model_len}"
                )
        params = SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
        )
        before = self.spec_counters()
        start = time.perf_counter()
        raw = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=use_tqdm)
        wall = time.perf_counter() - start
        outputs = [
            [
                Sample(o.text, list(o.token_ids), o.finish_reason)
                for o in sorted(r.outputs, key=lambda o: o.index)
            ]
            for r in raw
        ]
        return GenerationResult(ids, outputs, (self.spec_counters() - before).metrics(), wall)

    def spec_counters(self) -> SpecCounters:
        counters = SpecCounters()
        for m in self.llm.get_metrics():
            if m.name in _COUNTER_NAMES:
                setattr(counters, _COUNTER_NAMES[m.name], int(m.value))
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                counters.accepted_per_pos = [int(v) for v in m.values]
        return counters

    # ---- weight swaps ----------------------------------------------------------------------
    def swap_weights(self, role: str, weights: dict, version: int) -> dict:
        """Load new `role` ("draft" or "policy") weights into the running engine.

        The weights go through a safetensors file in shared memory. The file of the last
        good swap is kept until the next one succeeds: the engine reloads it if a swap
        fails halfway. A rejected swap raises and leaves the engine on its old weights.
        """
        from safetensors.torch import save_file

        start = time.perf_counter()
        path = _swap_dir() / f"{role}-v{version}-{uuid.uuid4().hex[:8]}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path))
        written = time.perf_counter()
        try:
            report = self.llm.collective_rpc("grpo_swap_weights", args=(role, str(path), version))[
                0
            ]
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        previous = self._swap_files.get(role)
        self._swap_files[role] = path
        if previous is not None:
            previous.unlink(missing_ok=True)
        # Cached prefixes hold KV computed with the old weights.
        self.llm.reset_prefix_cache()
        return {**report, "write_s": written - start, "total_s": time.perf_counter() - start}

    def weight_versions(self) -> dict[str, int]:
        return self.llm.collective_rpc("grpo_weight_versions")[0]

    def shutdown(self) -> None:
        for path in self._swap_files.values():
            path.unlink(missing_ok=True)
        self._swap_files.clear()
        engine = getattr(self, "llm", None)
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
            del self.llm


def _swap_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = base / "grpo-specdec"
    path.mkdir(exist_ok=True)
    return path


def read_prompts_file(path: str | Path) -> list[str]:
    """One prompt per line; blank lines are skipped. An empty file is an error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts = [line.rstrip("\n") for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts (it is empty or only blank lines)")
    return prompts
