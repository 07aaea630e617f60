"""A vLLM engine started from one validated config (grpo_specdec/engine_config.py),
generating G samples per prompt.

The wrapper is thin on purpose: it starts vLLM with the settings this project's paths need
(engine_args.py: speculative config, worker extension, scheduler), tokenises prompts the
same way for every caller, and turns vLLM's cumulative speculative counters into per-call
metrics.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import vllm_plugin
from grpo_specdec.draft_watch import DraftWatch, Head, Rollback, starting_head
from grpo_specdec.engine_args import engine_args
from grpo_specdec.engine_config import EngineConfig, SamplingSettings
from grpo_specdec.tasks.datasets import ChatPrompt
from grpo_specdec.vllm_compat import in_process_scheduler, reread_environment, stop_engine
from vllm_plugin import patches
from vllm_plugin.patches.fixes import cpu_seed_rewind_v0_32
from vllm_plugin.weights.trainer import LLMWeights

logger = logging.getLogger(__name__)
SEED_REWIND = vllm_plugin.patch_name(cpu_seed_rewind_v0_32)

# In-process engines alive in this process (they share vLLM's distributed state).
_LIVE_IN_PROCESS: weakref.WeakSet = weakref.WeakSet()


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class SpecCounters:
    """Speculative-decoding counts over a set of sequences, from vLLM's per-sequence,
    per-step records (so they belong to this engine and this call, whatever else runs)."""

    drafts: int = 0  # verify steps that had draft tokens
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_length_hist: dict[int, int] = field(default_factory=dict)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        width = max(drafted, len(self.drafted_per_pos))
        for xs in (self.drafted_per_pos, self.accepted_per_pos):
            xs.extend([0] * (width - len(xs)))
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.draft_length_hist[drafted] = self.draft_length_hist.get(drafted, 0) + 1
        for i in range(drafted):
            self.drafted_per_pos[i] += 1
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @classmethod
    def combined(cls, metrics: list[dict]) -> dict:
        """The `metrics()` of several calls (e.g. of several engines) as one call's."""
        total = cls()
        for m in metrics:
            total.drafts += m["drafts"]
            total.draft_tokens += m["draft_tokens"]
            total.accepted_tokens += m["accepted_tokens"]
            for length, n in m["draft_length_hist"].items():
                total.draft_length_hist[int(length)] = (
                    total.draft_length_hist.get(int(length), 0) + n
                )
            width = max(len(total.drafted_per_pos), len(m["drafted_per_pos"]))
            for mine, theirs in (
                (total.drafted_per_pos, m["drafted_per_pos"]),
                (total.accepted_per_pos, m["accepted_per_pos"]),
            ):
                mine.extend([0] * (width - len(mine)))
                for i, n in enumerate(theirs):
                    mine[i] += n
        return total.metrics()

    def observe_sequence(self, seq_metrics) -> None:
        if seq_metrics is not None:
            for drafted, accepted in zip(
                seq_metrics.per_step_drafted, seq_metrics.per_step_accepted, strict=True
            ):
                self.observe(drafted, accepted)

    def metrics(self) -> dict:
        return {
            **asdict(self),
            "acceptance_rate": self.accepted_tokens / self.draft_tokens
            if self.draft_tokens
            else 0.0,
            "mean_acceptance_length": self.accepted_tokens / self.drafts + 1.0
            if self.drafts
            else 1.0,
            # P(position i accepted | a draft reached position i); k varies per step.
            "per_position_acceptance": [
                a / d for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=True)
            ],
        }


@dataclass
class GenerationResult:
    prompt_token_ids: list[list[int]]
    outputs: list[list[Sample]]  # [prompt][sample]
    spec: dict
    wall_s: float
    # Per vLLM request (a prompt, or a sample given its own budget), seconds since the call's
    # first scheduling: when it was first scheduled and its last token came (vLLM's stamps).
    scheduled_s: list[float] = field(default_factory=list)
    finished_s: list[float] = field(default_factory=list)
    # Set when this call's drafts showed the draft head just swapped in had collapsed and
    # the engine went back to the one it replaced (draft_watch.py).
    draft_rollback: Rollback | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(s.token_ids) for group in self.outputs for s in group)

    def to_json(self) -> dict:
        return {
            "outputs": [[asdict(s) for s in group] for group in self.outputs],
            "spec": self.spec,
            "wall_s": self.wall_s,
        }


class Engine:
    """A running vLLM engine. Construct once; generate many times."""

    def __init__(self, cfg: EngineConfig, **extra_llm_kwargs):
        self.cfg = cfg
        # The engine-core process mode is read from the environment when the engine
        # starts; vLLM caches env reads once an engine runs, so drop that cache first.
        reread_environment()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
            "0" if cfg.engine_process == "in_process" else "1"
        )
        from vllm import LLM

        self.llm = LLM(**engine_args(cfg, extra_llm_kwargs))
        self._weights = LLMWeights(self.llm)  # what its weights are published and read through
        if cfg.engine_process == "in_process":
            _LIVE_IN_PROCESS.add(self)
        self.tokenizer = self.llm.get_tokenizer()
        vllm_config = self.llm.llm_engine.vllm_config
        self._device = vllm_config.device_config.device_type
        self._warned_seed = False
        # Which runner vLLM gave this engine, and so which of the process's patches act in it.
        self.runner = patches.engine_runner(vllm_config)
        self.patches = patches.acting(vllm_plugin.PATCHED, self.runner)
        spec = cfg.speculative
        if spec is not None:
            self._check_runner(spec)
        self.draft_watch = (
            DraftWatch(starting_head(spec.draft))
            if spec is not None and spec.draft and spec.draft_watch
            else None
        )
        self.draft_rollbacks: list[Rollback] = []  # every return to a replaced head

    def _check_runner(self, spec) -> None:
        """Refuse a feature that cannot act on the runner this engine got; say what is lost."""
        if spec.controller.group.enabled and "group_drafts_v0_32" not in self.patches:
            self.shutdown()
            raise ValueError(
                "speculative.controller.group.enabled: group drafts are a patch of vLLM 0.32's "
                f"Model Runner V1, and this engine runs Model Runner {self.runner} (vLLM forces "
                "V2 for watermarking and HiSparse attention, whatever VLLM_USE_V2_MODEL_RUNNER "
                "says): no group draft would ever be proposed"
            )
        if spec.concurrency_aware and "free_k0_v0_32" not in self.patches:
            logger.warning(
                "Model Runner %s: the free k = 0 patch does not act in this engine, so a step "
                "the controller turns drafting off for still runs the draft pass",
                self.runner,
            )

    # ---- prompts -------------------------------------------------------------------------
    def encode(self, prompt: str | ChatPrompt, chat: bool = True) -> list[int]:
        """Token ids of a prompt (a user turn, or chat turns): through the chat template when
        the model has one, else its turns' text."""
        tok = self.tokenizer
        if chat and getattr(tok, "chat_template", None):
            messages = (
                prompt.messages()
                if isinstance(prompt, ChatPrompt)
                else [{"role": "user", "content": prompt}]
            )
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(str(prompt))

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str | ChatPrompt] | list[list[int]],
        sampling: SamplingSettings,
        chat: bool = True,
        use_tqdm: bool = False,
        seeds: list[int] | None = None,
        max_tokens: list[int] | list[list[int]] | None = None,
    ) -> GenerationResult:
        """`seeds`: one per prompt, instead of `sampling.seed` for all (a prompt's samples
        then follow its own seed, whatever else the engine serves). `max_tokens`: one per
        prompt, instead of `sampling.max_tokens` for all; or one list of `sampling.n` per
        prompt, a budget per sample: each sample is then its own vLLM request (sample j
        seeded seed + j), and `scheduled_s`/`finished_s` are per sample."""
        from vllm import SamplingParams

        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        self._weights.refuse_if_mixed()
        ids = [p if isinstance(p, list) else self.encode(p, chat) for p in prompts]
        for i, p in enumerate(ids):
            if len(p) + 1 > self.cfg.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens, which leaves no room to generate within "
                    f"max_model_len={self.cfg.max_model_len}"
                )
        for name, per_prompt in (("seeds", seeds), ("max_tokens", max_tokens)):
            if per_prompt is not None and len(per_prompt) != len(ids):
                raise ValueError(f"{len(per_prompt)} {name} for {len(ids)} prompts")
        per_sample = max_tokens is not None and isinstance(max_tokens[0], list)
        if per_sample:
            for i, budgets in enumerate(max_tokens):
                if len(budgets) != sampling.n:
                    raise ValueError(
                        f"max_tokens of prompt {i}: {len(budgets)} budgets for n={sampling.n}"
                    )
        # Each vLLM request: (its prompt, its sample; None: all n samples of the prompt).
        requests = [
            (i, j) for i in range(len(ids)) for j in (range(sampling.n) if per_sample else [None])
        ]
        budgets = [
            sampling.max_tokens
            if max_tokens is None
            else max_tokens[i]
            if j is None
            else max_tokens[i][j]
            for i, j in requests
        ]
        if min(budgets) < 1:
            raise ValueError(f"max_tokens must be at least 1 per request, got {min(budgets)}")
        params = [
            SamplingParams(
                n=1 if per_sample else sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=budget,
                seed=self._request_seed(sampling.seed if seeds is None else seeds[i] + (j or 0)),
                ignore_eos=sampling.ignore_eos,
            )
            for (i, j), budget in zip(requests, budgets, strict=True)
        ]
        start = time.perf_counter()
        raw = self.llm.generate(
            [{"prompt_token_ids": ids[i]} for i, _ in requests], params, use_tqdm=use_tqdm
        )
        wall = time.perf_counter() - start
        counters = SpecCounters()
        outputs: list[list[Sample]] = [[] for _ in ids]
        for (i, _), r in zip(requests, raw, strict=True):
            group = sorted(r.outputs, key=lambda o: o.index)
            outputs[i] += [Sample(o.text, list(o.token_ids), o.finish_reason) for o in group]
            for o in group:
                counters.observe_sequence(o.spec_decode_metrics)
        t0 = min(r.metrics.scheduled_ts for r in raw)
        return GenerationResult(
            ids,
            outputs,
            counters.metrics(),
            wall,
            [r.metrics.scheduled_ts - t0 for r in raw],
            [r.metrics.last_token_ts - t0 for r in raw],
            # Text past an EOS the policy would have stopped at is not what a head drafts
            # in a rollout, and it accepts far less there: not evidence of a collapse.
            None if sampling.ignore_eos else self._watch_draft(counters),
        )

    def _watch_draft(self, counters: SpecCounters) -> Rollback | None:
        """Count this call's drafts for the serving head; go back to the head it replaced
        if it collapsed (draft_watch.py). The rollback, if one happened."""
        if self.draft_watch is None:
            return None
        rollback = self.draft_watch.observe(counters.draft_tokens, counters.accepted_tokens)
        if rollback is None:
            return None
        head = self.draft_watch.fallback
        self._weights.publish("draft", head.state_dict(), head.version, head.metadata)
        self.draft_watch.rolled_back()
        logger.warning(rollback.describe())
        self.draft_rollbacks.append(rollback)
        return rollback

    def _request_seed(self, seed: int | None) -> int | None:
        # On CPU vLLM rewinds a seeded request's generator in a way only CUDA generators
        # allow, which ends the engine (patches/fixes/cpu_seed_rewind_v0_32.py fixes it);
        # where that fix does not act, sampling follows the engine-wide seed instead.
        if seed is None or self._device != "cpu" or SEED_REWIND in self.patches:
            return seed
        if not self._warned_seed:
            logger.warning(
                "per-request seeds are ignored on this CPU engine (the plugin's %s fix "
                "does not act in it); the engine seed (%d) governs sampling",
                SEED_REWIND,
                self.cfg.seed,
            )
            self._warned_seed = True
        return None

    # ---- weight swaps ----------------------------------------------------------------------
    def swap_weights(
        self, role: str, weights: dict, version: int, metadata: dict | None = None
    ) -> dict:
        """Load new `role` ("draft" or "policy") weights into the running engine
        (`LLMWeights.publish`, vllm_plugin/weights/trainer.py); what the swap took. A
        rejected swap raises and leaves every rank on its old weights."""
        report = self._weights.publish(role, weights, version, metadata)
        if role == "draft" and self.draft_watch is not None:
            self.draft_watch.swapped(Head(weights, version, metadata))
        return report

    def weight_versions(self) -> dict[str, int]:
        """The versions of the weights every rank serves (they must agree)."""
        return self._weights.versions()

    def declare_weight_versions(self, versions: dict[str, int]) -> None:
        """Number the weights the engine started from (e.g. a checkpoint's policy and draft
        versions); `weight_versions` reports them until each role's next swap."""
        self._weights.declare(versions)
        if "draft" in versions and self.draft_watch is not None:
            self.draft_watch.serving.version = versions["draft"]

    # ---- the scheduler and the group drafter ----------------------------------------------
    def scheduler(self):
        """The engine-core scheduler object (in-process engines only)."""
        if self.cfg.engine_process != "in_process":
            raise RuntimeError("the scheduler lives in another process; use an in_process engine")
        return in_process_scheduler(self.llm)

    def group_draft_stats(self) -> dict | None:
        """The group drafter's counts since the engine started: drafts and accepted tokens
        per source ("model", "group"), history size; None when group drafts are off."""
        return self.llm.collective_rpc("grpo_group_draft_stats")[0]

    def group_draft_reset(self) -> None:
        """Empty the group drafter's history and calibration (group drafts must be on)."""
        self.llm.collective_rpc("grpo_group_draft_reset")

    def group_draft_add_history(self, result: GenerationResult) -> None:
        """Give the group drafter the answers of a generation made elsewhere (another
        engine, an earlier run) as finished rollouts of their prompts."""
        outputs = [[s.token_ids for s in group] for group in result.outputs]
        self.llm.collective_rpc(
            "grpo_group_draft_add_history", args=(result.prompt_token_ids, outputs)
        )

    def shutdown(self) -> None:
        engine = getattr(self, "llm", None)
        if engine is None:
            return
        _LIVE_IN_PROCESS.discard(self)
        stop_engine(engine, others_alive=bool(_LIVE_IN_PROCESS))
        self._weights.engine_stopped()
        del self.llm


def read_prompts_file(path: str | Path) -> list[str]:
    """One prompt per line; blank lines are skipped. An empty file is an error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts = [line.rstrip("\n") for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts (it is empty or only blank lines)")
    return prompts
