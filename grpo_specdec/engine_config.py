"""The settings an engine is started and sampled with, validated once at the edge: the
models and their fit (`check_model_dir`, `check_draft_matches_target`), the context
length, speculation (draft, k, how k is chosen) and per-call sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpo_specdec.config import DraftSampling, StrictModel
from grpo_specdec.modelcheck import (
    check_draft_matches_target,
    check_model_dir,
    default_kv_cache_gib,
    resolve_max_model_len,
)
from vllm_plugin.settings import ControllerSettings


class SpeculativeSettings(StrictModel):
    draft: str | None = Field(
        description="folder of an EAGLE draft head in vLLM's checkpoint format; null: no "
        "draft model, only drafts from the group's text (controller.group.enabled)"
    )
    k: int = Field(3, ge=1, le=16, description="draft tokens per step (the most, when adaptive)")
    draft_sampling: DraftSampling = Field(
        "greedy",
        description="greedy: the draft proposes its argmax, accepted with probability p(argmax); "
        "probabilistic: it samples from its distribution q at the request's temperature and "
        "hands q to verification, accepted with probability sum(min(p, q))",
    )
    concurrency_aware: bool = Field(False, description="choose k each step with the controller")
    draft_watch: bool = Field(
        True,
        description="after each draft swap, go back to the replaced head if the new one's "
        "acceptance collapses (grpo_specdec/draft_watch.py)",
    )
    controller: ControllerSettings = ControllerSettings()
    batch_size_table: list[tuple[int, int, int]] | None = Field(
        None,
        description="vLLM's static (min_batch, max_batch, k) table; not with concurrency_aware",
    )

    @model_validator(mode="after")
    def _one_k_source(self) -> SpeculativeSettings:
        if self.concurrency_aware and self.batch_size_table:
            raise ValueError("concurrency_aware and batch_size_table both choose k; use one")
        if self.draft is None and not self.controller.group.enabled:
            raise ValueError(
                "speculative.draft is null, so drafts can only come from the group's text: "
                "set speculative.controller.group.enabled=true (or name a draft)"
            )
        if self.draft is None and self.draft_sampling != "greedy":
            raise ValueError("speculative.draft_sampling=probabilistic needs a draft model")
        if self.draft is None and self.concurrency_aware:
            raise ValueError(
                "concurrency_aware chooses the draft model's k; with speculative.draft null the "
                "group drafter sizes every draft itself"
            )
        return self


Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class EngineConfig(StrictModel):
    model: str
    dtype: Dtype = "auto"
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="context length; default: the model's position limit, capped to what "
        "the KV cache holds (resolved on validation)",
    )
    max_num_seqs: int = Field(256, ge=1)
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        validate_default=True,
        description="KV cache size; default: 1 GiB on CPU, vLLM's own (a share of the "
        "device's memory) on a GPU",
    )

    @field_validator("kv_cache_gib")
    @classmethod
    def _platform_kv_cache(cls, gib: float | None) -> float | None:
        return default_kv_cache_gib() if gib is None else gib

    seed: int = 0
    enforce_eager: bool = False
    engine_process: Literal["in_process", "separate"] = "in_process"
    speculative: SpeculativeSettings | None = None

    @model_validator(mode="after")
    def _check_models(self) -> EngineConfig:
        check_model_dir(self.model, "model")
        draft = self.speculative and self.speculative.draft
        if draft:
            check_draft_matches_target(draft, self.model)
        self.max_model_len = resolve_max_model_len(
            self.max_model_len, self.model, self.kv_cache_gib, self.dtype, draft
        )
        return self


class SamplingSettings(StrictModel):
    n: int = Field(1, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(64, ge=1)
    seed: int | None = None
    ignore_eos: bool = Field(False, description="generate exactly max_tokens (benchmarks)")

    @model_validator(mode="after")
    def _greedy_means_one_sample(self) -> SamplingSettings:
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"n={self.n} samples per prompt need temperature > 0 (greedy gives one answer)"
            )
        return self
