"""What the job's engines start with: the engine config made from the job's, its context
length checked up front, and the latency profile concurrency-aware rollouts need."""

from __future__ import annotations

import random
from pathlib import Path

from grpo_specdec.job.config import TrainConfig
from grpo_specdec.modelcheck import resolve_max_model_len
from vllm_plugin.settings import bf16_emulated, profile_key, read_profile, store_path
from vllm_plugin.weights.manifest import read_manifest


def check_context_length(cfg: TrainConfig, policy: str, draft: str | None) -> None:
    """The engine checks its context length against the model too, but only inside its
    actor, once Ray and both learners have started: say it here, by the config's name."""
    r = cfg.rollout
    try:
        resolve_max_model_len(
            r.max_model_len, policy, r.kv_cache_gib, cfg.model.engine_dtype, draft or None
        )
    except ValueError as err:
        raise ValueError(f"rollout.max_model_len: {err}") from None


def max_num_seqs(cfg: TrainConfig) -> int:
    """What each engine of the job holds at once: a whole iteration's samples."""
    return max(cfg.rollout.prompts_per_iteration * cfg.rollout.group_size, 8)


def profiled_batch_sizes(max_seqs: int) -> list[int]:
    """The profile's batch sizes (powers of two) below `max_seqs`, and `max_seqs`."""
    from grpo_specdec.profile import ProfileConfig

    default = ProfileConfig.model_fields["batch_sizes"].default
    return [b for b in default if b < max_seqs] + [max_seqs]


def latency_profile(
    cfg: TrainConfig, policy: str, draft: str | None, log, measure: bool = True
) -> str | None:
    """The profile the controller reads: the configured one, or where a concurrency-aware
    rollout needs one, this model's on this hardware from the profile store; a missing one
    is measured first where `measure` says so, else left out. Named explicitly even then:
    after a resume the engine serves a checkpoint folder, not the base model the store knows
    it by. Timed in the dtype the job's engines serve (`serving_dtype`), which the engines
    check the profile against."""
    r = cfg.rollout
    if r.speculation != "concurrency_aware" or r.controller.policy == "fixed":
        return r.controller.profile
    if r.controller.profile:
        read_profile(Path(r.controller.profile))  # a bad one named here, not in an engine actor
        return r.controller.profile
    from grpo_specdec.profile import ProfileConfig, run_profile

    dtype = serving_dtype(cfg, policy)
    path = store_path(profile_key(policy, dtype, draft, r.draft_sampling))
    if not path.is_file() and not measure:
        log(
            f"no latency profile for {policy} on this hardware: the controller starts at k = 0 "
            "and learns what drafting costs from the engine's own steps (`grpo-specdec profile "
            f"--model {policy} --draft {draft} --dtype {dtype} --draft-sampling "
            f"{r.draft_sampling} --out profile.json` stores one to start from)"
        )
        return None
    if not path.is_file():
        log(f"no latency profile for {policy} on this hardware yet: profiling it first")
        run_profile(
            ProfileConfig(
                model=policy,
                draft=draft,
                draft_sampling=r.draft_sampling,
                dtype=dtype,
                k_max=r.k,
                # B up to what the job's engine holds: a larger B is priced from the fit.
                batch_sizes=profiled_batch_sizes(max_num_seqs(cfg)),
                enforce_eager=r.enforce_eager,
            ),
            path,
            log=log,
        )
    read_profile(path)
    return str(path)


def stored_dtype(model_dir: str) -> str:
    """The dtype `model_dir`'s weights are stored in, which an engine started from it
    checks every update against: the learners publish in it."""
    return str(next(iter(read_manifest(model_dir).values()))[1]).removeprefix("torch.")


def engine_start_folder(base_policy: str, dtype: str, out: Path) -> str:
    """The folder a fresh run's engines start from: the base policy's, or where they serve
    float32 from a base stored narrower (a bfloat16 base on a CPU without bfloat16), a float32
    copy of it in the run's folder, written once. An engine checks every update against its
    start folder's dtypes, so the learners publish in them: from the bfloat16 folder the
    float32 engine served the learners' weights rounded to bfloat16, a policy behind theirs
    (at the end of `make demo` it answered 47% longer than its own checkpoint served in
    float32, which the end-of-run comparison's engine without speculation serves)."""
    if dtype != "float32" or stored_dtype(base_policy) == "float32":
        return base_policy
    import shutil

    from safetensors.torch import load_file, save_file

    folder = out / "engine_policy"
    if folder.is_dir():
        return str(folder)
    tmp = out / ".engine_policy.tmp"  # renamed whole: a crash leaves no half-written folder
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in Path(base_policy).iterdir():
        if f.suffix == ".safetensors":
            wide = {n: t.float() if t.is_floating_point() else t for n, t in load_file(f).items()}
            save_file(wide, tmp / f.name, metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy2(f, tmp / f.name)
    tmp.rename(folder)
    return str(folder)


def serving_dtype(cfg: TrainConfig, base_policy: str) -> str:
    """The dtype the job's engines serve: `model.engine_dtype`, where it says auto the base
    policy's stored dtype, whatever folder an engine starts from (a checkpoint stores
    float32, the optimiser's: an engine started from one would otherwise serve what the
    run's first engine did not); but float32 for a bfloat16 base on a CPU without bfloat16
    instructions, where vLLM would emulate bfloat16 at many times a step's cost. The
    learners publish in the folder's stored dtype either way; an engine converts an update
    to its own as it loads it."""
    if cfg.model.engine_dtype != "auto":
        return cfg.model.engine_dtype
    stored = stored_dtype(base_policy)
    if stored == "bfloat16" and bf16_emulated():
        return "float32"
    return stored


def engine_config(
    cfg: TrainConfig, policy_dir: str, draft_dir: str | None, profile: str | None, dtype: str
) -> dict:
    """The EngineConfig fields of an engine serving `policy_dir` (with `draft_dir`) in
    `dtype` (`serving_dtype`). `Roles` validates them once, on the driver, and hands each
    engine actor the EngineConfig itself."""
    r = cfg.rollout
    spec = None
    if r.speculation != "off":
        spec = {
            "draft": draft_dir,
            "k": r.k,
            "draft_sampling": r.draft_sampling,
            "concurrency_aware": r.speculation == "concurrency_aware",
            "controller": {**r.controller.model_dump(), "profile": profile},
            # Each engine would judge and roll back its draft alone, and engines that
            # disagree on the draft's version stop the job: with several, the engines' watch
            # is off and the driver judges their drafts together (job/draft_guard.py).
            "draft_watch": cfg.ray.rollout_workers == 1,
        }
    return {
        "model": policy_dir,
        "dtype": dtype,
        "max_model_len": r.max_model_len,
        "max_num_seqs": max_num_seqs(cfg),
        "kv_cache_gib": r.kv_cache_gib,
        "seed": cfg.seed,
        "enforce_eager": r.enforce_eager,
        "speculative": spec,
    }


def engine_seed(job_seed: int, engine: int, policy_version: int, start: int) -> int:
    """The sampling seed of rollout engine `engine` at the job's `start`-th start of its
    roles (0: the first; each restart after an actor died counts one), at `policy_version`:
    each engine its own stream (one seed for all drew the same random numbers in every
    engine), and a new one whenever the roles start again (a restart from the same
    checkpoint would otherwise replay the batch that crashed it, and a resume at another
    policy version the streams of the first start). Requests seeded per prompt
    (`rollout.seeded`) do not depend on it."""
    key = f"engine:{job_seed}:{engine}:{policy_version}:{start}"
    return random.Random(key).randrange(1 << 31)
