"""The GRPO job's configuration: one pydantic model, loaded from YAML, validated at start."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpo_specdec.config import DraftSampling, StrictModel, with_off
from grpo_specdec.draft.trainer import DraftTrainConfig
from grpo_specdec.grpo.core import Aggregation
from grpo_specdec.job.sharding import Sharding
from grpo_specdec.modelcheck import default_kv_cache_gib
from grpo_specdec.tasks.rewards import RewardKind
from vllm_plugin.settings import ControllerSettings


class ModelSettings(StrictModel):
    policy: str = Field(description="HF folder, or 'smollm2' / 'tiny' for the project's assets")
    draft: str | None = Field(
        None, description="EAGLE head folder or 'smollm2-arith'; none = a new head"
    )
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    train_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the learners' weights (and AdamW state); see policy.autocast"
    )


class DataSettings(StrictModel):
    source: Literal["arithmetic", "jsonl", "parquet", "datasets"] = Field(
        "arithmetic",
        description="the procedural arithmetic task, or problems from data.path: a JSONL file, "
        "a parquet file, or a Hugging Face datasets folder (save_to_disk)",
    )
    path: str | None = Field(None, description="the data file or folder, with a file source")
    question_field: str | None = Field(
        None,
        description="the row's prompt, dotted for nesting: a string or chat turns; default: "
        "'question' (jsonl, datasets), 'prompt' (parquet, verl's layout)",
    )
    answer_field: str | None = Field(
        None,
        description="the row's ground truth (GSM8K's '... #### N' is cut to N); default: "
        "'answer' (jsonl, datasets), 'reward_model.ground_truth' (parquet, verl's layout)",
    )
    system_prompt: str | None = Field(
        None, description="a system turn before every prompt (a row's own system turn wins)"
    )
    instruction: str | None = Field(
        None,
        description="appended to every prompt's (last) user turn, e.g. "
        "' Put the final answer in \\boxed{}.'",
    )
    levels: list[int] = Field([1, 2], min_length=1)
    seed: int = 0
    eval_path: str | None = Field(
        None,
        description="held-out problems for the job's evaluation, in data.source's format and "
        "fields; default: the arithmetic task's held-out split (grpo_specdec/evaluate.py)",
    )

    @model_validator(mode="after")
    def _path_for_files(self) -> DataSettings:
        if self.source != "arithmetic" and not self.path:
            raise ValueError(f"data.path is required when data.source is {self.source}")
        if any(not 1 <= lvl <= 4 for lvl in self.levels):
            raise ValueError(f"data.levels must lie in 1..4, got {self.levels}")
        return self


class LengthBudget(StrictModel):
    """Each sample its own seeded log-normal max_tokens (at least 16, at most
    rollout.max_tokens): the tail shape's stand-in for a policy that has learnt to stop
    (`tasks/length_budgets.py`), so that few requests are left in flight for much of a rollout."""

    median: int = Field(ge=16)
    sigma: float = Field(0.7, ge=0)


# DAPO's recipes allow 10 further batches; a policy whose groups never vary would roll out
# every one of them each iteration, so the bound is what one iteration may cost at most.
MAX_GEN_BATCHES = 16


class RolloutSettings(StrictModel):
    prompts_per_iteration: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(128, ge=1)
    speculation: with_off(Literal["off", "fixed", "concurrency_aware"]) = "concurrency_aware"
    k: int = Field(4, ge=1, le=16, description="draft tokens (the most, when concurrency-aware)")
    draft_sampling: DraftSampling = Field(
        "greedy",
        description="the draft proposes its argmax, or samples from its distribution q "
        "(accepted with probability sum(min(p, q)) instead of p(argmax q))",
    )
    controller: ControllerSettings = ControllerSettings()
    max_model_len: int | None = Field(None, ge=64, description="default: from the model")
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        validate_default=True,
        description="per engine; default: 1 GiB on CPU, vLLM's own on a GPU",
    )

    @field_validator("kv_cache_gib")
    @classmethod
    def _platform_kv_cache(cls, gib: float | None) -> float | None:
        return default_kv_cache_gib() if gib is None else gib

    enforce_eager: bool = False
    seeded: bool = Field(
        False,
        description="seed each prompt's sampling from (seed, its example's index): its samples "
        "then do not depend on which engine serves it, or beside what",
    )
    length_budget: LengthBudget | None = Field(
        None, description="per-sample length budgets (a benchmark shape); none: max_tokens each"
    )
    max_gen_batches: int = Field(
        1,
        ge=1,
        le=MAX_GEN_BATCHES,
        description="DAPO's dynamic sampling when > 1: roll out further batches of prompts "
        "(up to this many batches in all) until prompts_per_iteration groups have reward "
        "variance; the policy learns from the first that many, the draft from every rollout "
        "(verl: algorithm.filter_groups.max_num_gen_batches)",
    )

    @model_validator(mode="after")
    def _budget_under_cap(self) -> RolloutSettings:
        if self.length_budget and self.length_budget.median > self.max_tokens:
            raise ValueError(
                f"rollout.length_budget.median ({self.length_budget.median}) exceeds "
                f"rollout.max_tokens ({self.max_tokens}), the budgets' cap"
            )
        return self


class PolicySettings(StrictModel):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0, lt=1)
    kl_coef: float = Field(0.0, ge=0)
    aggregation: Aggregation = "token_mean"
    micro_batch: int = Field(4, ge=1)
    epochs: int = Field(1, ge=1)
    autocast: with_off(Literal["auto", "off", "bfloat16"]) = Field(
        "auto",
        description="run the learner's forward and backward under bfloat16 autocast (weights "
        "and optimiser stay in model.train_dtype); auto: on for CUDA and for CPUs with bfloat16 "
        "instructions (a SmolLM2 learner step measured 2.46x faster here), off otherwise",
    )
    sharding: Sharding = Field(
        "none",
        description="over ray.policy_workers ranks: fsdp shards the parameters, gradients "
        "and AdamW state (torch FSDP2; 2 ranks hold 0.5x of one rank's); none keeps them "
        "whole on every rank. Default: fsdp with several ranks, none with one",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in the backward pass"
    )


class EvalSettings(StrictModel):
    """Validation on held-out problems (`data.eval_path`, or the arithmetic task's held-out
    split at `data.levels`): greedy accuracy with a 95% interval, before training, every
    `every` iterations and after the last."""

    every: int = Field(5, ge=0, description="iterations between evaluations; 0: none at all")
    examples: int = Field(200, ge=1, description="held-out problems (at most the file's)")
    max_tokens: int | None = Field(None, ge=1, description="default: rollout.max_tokens")
    samples: int = Field(0, ge=0, description="also mean@G over this many samples at T = 1")


class OverlongPenalty(StrictModel):
    """DAPO's soft overlong punishment (`tasks/rewards.py` overlong_penalty): 0 up to
    rollout.max_tokens - buffer tokens, then down to -penalty at rollout.max_tokens."""

    buffer: int = Field(ge=1, description="tokens before rollout.max_tokens where it starts")
    penalty: float = Field(1.0, ge=0)


class RewardSettings(StrictModel):
    """The rule reward: 1 for the right final answer, plus `format_bonus` for stating it as
    "The answer is N" or \\boxed{N}, plus the overlong penalty when set."""

    kind: RewardKind = Field(
        "math_verify",
        description="math_verify: Hugging Face's math-verify (LaTeX, \\boxed{}, fractions, sets, "
        "units); number: the final number against a numeric ground truth",
    )
    format_bonus: float = Field(
        0.0,
        ge=0,
        description="0 by default: with group-normalised advantages a group that is all wrong "
        "still learns the bonus at full strength, and a run at 0.1 learnt the format while "
        "its held-out accuracy fell 0.15 -> 0.02 (docs/benchmarks/learning_run.md)",
    )
    overlong: OverlongPenalty | None = None


class DraftSettings(StrictModel):
    online: bool = Field(True, description="keep training the draft on each rollout")
    new_head: Literal["eagle", "eagle3"] = Field(
        "eagle",
        description="the head made when model.draft is null: EAGLE (the target's last layer) "
        "or EAGLE-3 (three of its layers fused, trained unrolled), both over the full "
        "vocabulary",
    )
    train: DraftTrainConfig = DraftTrainConfig()


PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RaySettings(StrictModel):
    address: str | None = Field(
        None, description="join this cluster; default: RAY_ADDRESS, else a local one"
    )
    rollout_workers: int = Field(
        1, ge=1, description="vLLM engines; each iteration's prompt groups are split across them"
    )
    policy_workers: int = Field(
        1, ge=1, description="data-parallel policy learner ranks (gloo on CPU, NCCL on CUDA)"
    )
    rollout_gpus: float = Field(0, ge=0, description="GPUs (or a share) per engine")
    policy_gpus: float = Field(0, ge=0, description="GPUs (or a share) per policy rank")
    draft_gpus: float = Field(0, ge=0)
    rollout_cpus: float = Field(0, ge=0, description="CPUs reserved per engine")
    policy_cpus: float = Field(0, ge=0, description="CPUs reserved per policy rank")
    draft_cpus: float = Field(0, ge=0)
    call_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="deadline of each remote call the job waits on (a rollout, a policy "
        "update, a weight load, a checkpoint save, a draft round); past it its actors are "
        "taken as hung and every role restarts from the newest checkpoint (`restarts`)",
    )
    placement: PlacementStrategy = Field(
        "PACK",
        description="Ray placement-group strategy of each role's actors (SPREAD: one node each "
        "where it can; STRICT_*: or fail)",
    )


class CompareSettings(StrictModel):
    """The end-of-job comparison (`compare_at_end`): which rollout, and which rows."""

    shape: Literal["batch", "tail"] = Field(
        "batch",
        description="batch: the next batch as an iteration rolls it out; tail: the next "
        "batch's prompts x rollout.group_size samples, each its own request with its own "
        "seeded log-normal length budget under `cap` (a stand-in for a policy that has learnt "
        "to stop, so that few requests are left in flight for much of the rollout)",
    )
    cap: int | None = Field(
        None, ge=16, description="tail: the global cap; default rollout.max_tokens"
    )
    budget_median: int | None = Field(
        None, ge=16, description="tail: the budgets' median; default a quarter of the cap"
    )
    budget_sigma: float = Field(0.7, ge=0, description="tail: the budgets' log-normal spread")
    fixed_k: list[int] = Field(
        [], description="also roll it out with the job's engine at each of these fixed k"
    )
    repeats: int = Field(
        3,
        ge=1,
        description="timed rounds after one warm-up per configuration, each in a new shuffled "
        "order; ratios are their median with a 95% interval (grpo_specdec/bench/measure.py)",
    )
    natural_repeats: int = Field(
        0,
        ge=0,
        description="tail: also this many rounds in which each configuration makes its own "
        "answers (natural EOS, the same budgets, no per-request seeds); the equal-token rounds "
        "make text past EOS that a real rollout never makes, where drafts are accepted less",
    )
    start_timeout_s: float = Field(
        900.0,
        gt=0,
        allow_inf_nan=False,
        description="how long the engine without speculation may take to be placed and start",
    )

    def cap_and_median(self, max_tokens: int) -> tuple[int, int]:
        """tail: the global cap and the budgets' median, defaults filled from the rollout's."""
        cap = self.cap or max_tokens
        return cap, self.budget_median or cap // 4


class RestartSettings(StrictModel):
    """When an actor dies, every role restarts from the newest checkpoint; a fault that comes
    back each time would loop for ever, so restarts are counted."""

    per_checkpoint: int = Field(3, ge=0, description="restarts from one checkpoint, then stop")
    total: int = Field(10, ge=0, description="restarts in one run of the job, then stop")


class TrainConfig(StrictModel):
    model: ModelSettings
    data: DataSettings = DataSettings()
    rollout: RolloutSettings = RolloutSettings()
    policy: PolicySettings = PolicySettings()
    reward: RewardSettings = RewardSettings()
    draft: DraftSettings = DraftSettings()
    eval: EvalSettings = EvalSettings()
    ray: RaySettings = RaySettings()
    iterations: int = Field(20, ge=1)
    checkpoint_every: int = Field(5, ge=1)
    compare_at_end: bool = Field(
        False,
        description="after the last iteration, roll out the next batch with the job's engine "
        "and with one without speculation serving the same policy, and print both",
    )
    compare: CompareSettings = CompareSettings()
    out: str = "runs/grpo"
    seed: int = 0
    restarts: RestartSettings = RestartSettings()

    @model_validator(mode="after")
    def _comparable(self) -> TrainConfig:
        c, r = self.compare, self.rollout
        if not self.compare_at_end:  # e.g. the demo's config run without speculation
            return self
        cap, _ = c.cap_and_median(r.max_tokens)
        if c.budget_median is not None and c.budget_median > cap:
            raise ValueError(f"compare.budget_median={c.budget_median} exceeds the cap {cap}")
        if r.max_model_len is not None and cap >= r.max_model_len:
            raise ValueError(
                f"compare.cap={cap} leaves no room for a prompt within rollout.max_model_len="
                f"{r.max_model_len}"
            )
        if c.natural_repeats and c.shape != "tail":
            raise ValueError("compare.natural_repeats: natural EOS rounds need compare.shape=tail")
        for k in c.fixed_k:
            if not 1 <= k <= r.k or r.speculation == "off":
                raise ValueError(
                    f"compare.fixed_k: {k} is not a k the job's engine can draft (1..rollout.k="
                    f"{r.k}, with rollout.speculation on)"
                )
        return self

    @model_validator(mode="after")
    def _a_group_for_every_engine(self) -> TrainConfig:
        if self.ray.rollout_workers > self.rollout.prompts_per_iteration:
            raise ValueError(
                f"ray.rollout_workers={self.ray.rollout_workers} exceeds "
                f"rollout.prompts_per_iteration={self.rollout.prompts_per_iteration}: "
                "a prompt's group is never split, so some engines would have nothing to do"
            )
        return self

    @model_validator(mode="after")
    def _sharding_needs_ranks(self) -> TrainConfig:
        workers = self.ray.policy_workers
        if "sharding" not in self.policy.model_fields_set:
            self.policy.sharding = "fsdp" if workers > 1 else "none"
        elif self.policy.sharding == "fsdp" and workers == 1:
            raise ValueError(
                "policy.sharding=fsdp shards over ray.policy_workers ranks, and "
                "ray.policy_workers=1: set ray.policy_workers to 2 or more, or policy.sharding=none"
            )
        return self

    @model_validator(mode="after")
    def _one_gpu_per_nccl_rank(self) -> TrainConfig:
        ray_cfg = self.ray
        if self.model.device == "cuda" and ray_cfg.policy_workers > 1 and ray_cfg.policy_gpus != 1:
            raise ValueError(
                f"ray.policy_gpus={ray_cfg.policy_gpus} with ray.policy_workers="
                f"{ray_cfg.policy_workers} on cuda: NCCL needs one whole GPU per rank; "
                "set ray.policy_gpus=1"
            )
        return self

    @model_validator(mode="after")
    def _overlong_within_the_cap(self) -> TrainConfig:
        overlong, cap = self.reward.overlong, self.rollout.max_tokens
        if overlong and overlong.buffer > cap:
            raise ValueError(
                f"reward.overlong.buffer={overlong.buffer} exceeds rollout.max_tokens={cap}"
            )
        return self

    @model_validator(mode="after")
    def _draft_trains_for_the_rollout_temperature(self) -> TrainConfig:
        train = self.draft.train
        if "temperature" not in train.model_fields_set:
            train.temperature = self.rollout.temperature
        return self
