"""The rollout role as a plain class: RolloutWorker owns the vLLM engine and turns its
generations into a Rollout; `actors.py` wraps it for Ray."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

from grpo_specdec.draft_watch import Rollback
from grpo_specdec.engine import Engine, EngineConfig, SamplingSettings, SpecCounters
from vllm_plugin.controller import FixedPolicy


def batch_range(batch: int) -> str:
    """The power-of-two range of running requests a step falls in: "1", "2-3", "4-7", ..."""
    low = 1 << (max(batch, 1).bit_length() - 1)
    return str(low) if low == 1 else f"{low}-{2 * low - 1}"


def k_by_batch(trace) -> dict[str, dict[str, int]]:
    """Steps per k in each range of running requests, from scheduler trace records."""
    counts: dict[str, Counter] = {}
    for _, batch, k, _ in trace:
        counts.setdefault(batch_range(batch), Counter())[str(k)] += 1
    return {b: dict(sorted(c.items())) for b, c in counts.items()}


@dataclass
class Rollout:
    prompt_ids: list[list[int]]  # [prompt]
    responses: list[list[list[int]]]  # [prompt][sample] token ids
    texts: list[list[str]]
    spec: dict
    wall_s: float
    k_steps: dict[int, int]  # steps per k chosen during this rollout
    # With group drafts: draft and accepted tokens per source ("model", "group") in this
    # rollout, and the history the drafter holds after it.
    sources: dict | None = None
    finished_s: list[float] | None = None  # per request, its last token's time into the rollout
    # The engine's returns to a replaced draft head after this rollout's drafts showed the
    # head just swapped in had collapsed (draft_watch.py).
    draft_rollbacks: list[Rollback] = field(default_factory=list)
    # Steps per k in each range of running requests ("4-7": {"0": 3, "2": 11}).
    k_by_batch: dict[str, dict[str, int]] = field(default_factory=dict)

    @staticmethod
    def gather(parts: list[Rollout]) -> Rollout:
        """Several engines' rollouts of consecutive prompt groups, in order, as one: the
        engines ran side by side, so the wall time is the slowest one's."""
        finished = [x for p in parts for x in p.finished_s or ()]
        return _joined(parts, max(p.wall_s for p in parts), finished)

    @staticmethod
    def chain(parts: list[Rollout]) -> Rollout:
        """One engine's rollouts made one after another (dynamic sampling's batches), as
        one: their wall times add, and each request's finish counts from the first's start."""
        finished, start = [], 0.0
        for part in parts:
            finished += [start + t for t in part.finished_s or ()]
            start += part.wall_s
        joined = _joined(parts, start, finished)
        if joined.sources is not None:  # the group history's size is a state, not a count
            joined.sources |= {
                k: v for k, v in parts[-1].sources.items() if k.startswith("group_history")
            }
        return joined

    def summary(self) -> dict:
        """This rollout's figures for the metrics (one engine's, in a multi-engine job)."""
        tokens = sum(len(s) for group in self.responses for s in group)
        return {
            "prompts": len(self.prompt_ids),
            "tokens": tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": tokens / self.wall_s,
            "mean_acceptance_length": self.spec["mean_acceptance_length"],
            "k_steps": {str(k): n for k, n in sorted(self.k_steps.items())},
            "k_by_batch": self.k_by_batch,
        }


def _joined(parts: list[Rollout], wall_s: float, finished_s: list[float]) -> Rollout:
    """Rollouts as one, in order: their counts added, with the wall and finish times the
    caller worked out for how they ran."""
    sources = None
    if parts[0].sources is not None:
        sources = {k: sum(p.sources[k] for p in parts) for k in parts[0].sources}
    k_steps: dict[int, int] = {}
    by_batch: dict[str, Counter] = {}
    for part in parts:
        for k, n in part.k_steps.items():
            k_steps[k] = k_steps.get(k, 0) + n
        for b, ks in part.k_by_batch.items():
            by_batch.setdefault(b, Counter()).update(ks)
    return Rollout(
        [x for p in parts for x in p.prompt_ids],
        [x for p in parts for x in p.responses],
        [x for p in parts for x in p.texts],
        SpecCounters.combined([p.spec for p in parts]),
        wall_s,
        k_steps,
        sources,
        finished_s,
        [x for p in parts for x in p.draft_rollbacks],
        {b: dict(sorted(c.items())) for b, c in by_batch.items()},
    )


class RolloutWorker:
    def __init__(self, engine_cfg: EngineConfig, weight_versions: dict[str, int]):
        """`engine_cfg`: validated by the driver (`Roles`), which reads the same model
        folders; `weight_versions`: the learners' versions of the weights the engine starts
        from (a checkpoint's, after a resume), so later swaps and lags count on from them."""
        self.engine = Engine(engine_cfg)
        self.engine.declare_weight_versions(weight_versions)
        self._saved = None  # the policy `save_controller` kept

    def rollout(
        self,
        prompts: list[str],
        sampling: dict,
        seeds: list[int] | None = None,
        max_tokens: list[int] | list[list[int]] | None = None,
        fixed_k: int | None = None,
        saved_controller: bool = False,
    ) -> Rollout:
        """`max_tokens`: one budget per prompt, or per sample (`Engine.generate`); `fixed_k`:
        draft exactly k tokens every step of this rollout; `saved_controller`: run it with
        a copy of the controller as `save_controller` kept it (the scheduler's own policy
        is put back after either)."""
        scheduler = self._aware_scheduler()
        mark = scheduler.steps_scheduled if scheduler is not None else 0
        before = self.engine.group_draft_stats() if self.engine.cfg.speculative else None
        sampling = SamplingSettings.model_validate(sampling)
        if fixed_k is None and not saved_controller:
            res = self.engine.generate(prompts, sampling, seeds=seeds, max_tokens=max_tokens)
        else:
            if scheduler is None or (fixed_k is None and self._saved is None):
                raise ValueError(
                    "fixed_k needs a concurrency-aware engine in this process, and "
                    "saved_controller one whose save_controller ran"
                )
            policy = scheduler.policy
            scheduler.set_policy(
                FixedPolicy(fixed_k) if fixed_k is not None else copy.deepcopy(self._saved)
            )
            try:
                res = self.engine.generate(prompts, sampling, seeds=seeds, max_tokens=max_tokens)
            finally:
                scheduler.set_policy(policy)
        trace = scheduler.steps_since(mark) if scheduler is not None else []
        k_steps: dict[int, int] = {}
        for _, _, k, _ in trace:
            k_steps[k] = k_steps.get(k, 0) + 1
        return Rollout(
            res.prompt_token_ids,
            [[s.token_ids for s in g] for g in res.outputs],
            [[s.text for s in g] for g in res.outputs],
            res.spec,
            res.wall_s,
            k_steps,
            before and _source_counts(before, self.engine.group_draft_stats()),
            res.finished_s,
            [res.draft_rollback] if res.draft_rollback else [],
            k_by_batch(trace),
        )

    def save_controller(self) -> bool:
        """Keep a copy of the scheduler's policy as it is now (what it has learnt), for
        rollouts that must each start from it (`saved_controller`); False where this engine
        has no concurrency-aware scheduler in this process (nothing kept)."""
        scheduler = self._aware_scheduler()
        if scheduler is not None:
            self._saved = copy.deepcopy(scheduler.policy)
        return scheduler is not None

    def forget_caches(self) -> None:
        """Empty the prefix cache and the group drafter's history, so that the next rollout
        starts from nothing another made (the end-of-job comparison)."""
        self.engine.llm.reset_prefix_cache()
        if self.engine.group_draft_stats() is not None:
            self.engine.group_draft_reset()

    def _aware_scheduler(self):
        spec = self.engine.cfg.speculative
        if (
            spec is None
            or not spec.concurrency_aware
            or self.engine.cfg.engine_process != "in_process"
        ):
            return None
        return self.engine.scheduler()

    def load_weights(
        self, role: str, weights: dict, version: int, metadata: dict | None = None
    ) -> dict:
        return self.engine.swap_weights(role, weights, version, metadata)

    def versions(self) -> dict[str, int]:
        return self.engine.weight_versions()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _source_counts(before: dict, after: dict) -> dict:
    """Flat counts for the metrics: {source}_draft_tokens / _accepted_tokens over one
    rollout, and the group history's size after it."""
    counts = {
        f"{source}_{what}": after["sources"][source][what] - before["sources"][source][what]
        for source in after["sources"]
        for what in ("draft_tokens", "accepted_tokens")
    }
    counts["group_history_positions"] = after["history_positions"]
    counts["group_history_mib"] = after["history_bytes"] / 2**20
    return counts
