"""vLLM 0.32.0 and 0.33.0: a step that drafts nothing (k = 0) costs what a step without
speculation costs.

As shipped, when the scheduler picks k = 0 for a step (dynamic speculation), two things
still run that a plain engine does not:
- the EAGLE proposer builds its inputs and attention metadata and runs the draft's
  first pass over every scheduled token, only to keep the draft's KV cache in step with
  the target's (`SpecDecodeBaseProposer.propose`: "The prefill forward pass above
  already ran to keep the drafter KV cache in sync");
- the next step, with nothing to verify, still samples through the rejection sampler
  (the runner builds speculative metadata on every step of a speculative engine).

Sampling: a step with no draft tokens in it samples with the plain sampler, which is
what the rejection sampler computes then (its one "bonus" token per request).

Drafting: the pass becomes lazy. On a decode-only step with k = 0, the draft inputs of
every position (target token, position, hidden state, KV slot) are kept and the draft
does not run; if the step verified drafts (the previous step's, or drafts from the
group's text, `group_drafts_v0_32`), only the accepted positions are kept. On the next
step that does run the draft (k > 0, or a step with prefill), each request's kept
positions are put in front of its scheduled tokens, as vLLM's first pass already does
for prefill, so the draft writes the KV of the skipped positions before it drafts: its
cache and its drafts are the same as if no step had been skipped. Requests that finish
while k = 0 never pay.

Kept inputs are bounded (`MAX_KEPT_BYTES`); beyond that, and where a request's
positions stop being contiguous (preemption), the oldest are dropped: the draft then
attends to stale KV there, which lowers acceptance but never changes outputs (every
draft is verified by the target). Applies to EAGLE / EAGLE-3 chain drafting with one
data-parallel and one pipeline rank, scheduled synchronously, on vLLM's V1 model runner (V2
never calls these classes; see `patches/__init__.py`); anything else keeps vLLM's behaviour.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from dataclasses import dataclass

import torch

from vllm_plugin.patches import runs_v1_model_runner, vllm_is

logger = logging.getLogger(f"vllm.{__name__}")

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = True  # acts only in engines on Model Runner V1
# Under async scheduling the runner hands the next step the drafter's output on the device
# before this step's results are read, a path the lazy pass was never built or tested on:
# there the patch stands aside (vLLM turns async scheduling on by default for EAGLE on CUDA).
ASYNC_OFF = (
    "grpo-specdec: the free k = 0 step is off in this engine, which schedules asynchronously "
    "(vLLM's default for EAGLE on GPU): a step the controller gives k = 0 still runs the "
    "draft pass and the rejection sampler, as vLLM ships it; start the engine with "
    "async_scheduling=False (`vllm serve --no-async-scheduling`) to have it"
)
ENABLED = True  # tests and benchmarks compare with vLLM's always-run path in one process
MAX_KEPT_BYTES = 256 << 20  # per engine: ~32k positions of a 4096-wide bf16 model


@dataclass
class SkippedStep:
    """Draft inputs of one step whose draft pass did not run, one row per request."""

    req_ids: list[str]
    token_ids: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor
    slots: torch.Tensor

    FIELDS = ("token_ids", "positions", "hidden", "slots")

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f).nbytes for f in self.FIELDS)


class KeptDraftInputs:
    """The skipped steps' draft inputs, until the next draft pass catches them up."""

    def __init__(self, max_bytes: int = MAX_KEPT_BYTES):
        self.steps: deque[SkippedStep] = deque()
        self.nbytes = 0
        self.max_bytes = max_bytes
        self.skipped_passes = 0  # for tests and logs
        self.caught_up_positions = 0
        self.dropped_steps = 0

    def keep(self, step: SkippedStep) -> None:
        self.steps.append(step)
        self.nbytes += step.nbytes
        self.skipped_passes += 1
        while self.nbytes > self.max_bytes:
            self.nbytes -= self.steps.popleft().nbytes
            self.dropped_steps += 1

    def clear(self) -> None:
        self.steps.clear()
        self.nbytes = 0

    def prepend(self, req_ids, token_ids, positions, hidden, attn_metadata, capacity: int):
        """This step's draft inputs with each request's kept positions in front of its
        scheduled tokens: (token_ids, positions, hidden, attention metadata, positions put
        in front of each request), or None if nothing is kept for these requests. At most
        `capacity` tokens in all."""
        scheduled = set(req_ids)
        if not any(r in scheduled for s in self.steps for r in s.req_ids):
            return None
        n = int(attn_metadata.num_actual_tokens)
        current = dict(
            token_ids=token_ids[:n],
            positions=positions[:n],
            hidden=hidden[:n],
            slots=attn_metadata.slot_mapping[:n],
        )

        def pooled(field: str) -> torch.Tensor:  # kept rows, then this step's
            return torch.cat([*(getattr(s, field) for s in self.steps), current[field]])

        pool = {"positions": pooled("positions")}
        pool_positions = pool["positions"].tolist()  # the one device sync
        kept_rows: dict[str, list[int]] = {}
        row = 0
        for s in self.steps:
            for r in s.req_ids:
                kept_rows.setdefault(r, []).append(row)
                row += 1
        starts = attn_metadata.query_start_loc_cpu.tolist()
        rows_in_front = []  # per request: its kept rows that end where its tokens start
        for i, r in enumerate(req_ids):
            expect = pool_positions[row + starts[i]] - 1
            contiguous = []
            for j in reversed(kept_rows.get(r, ())):
                if pool_positions[j] != expect:
                    break
                contiguous.append(j)
                expect -= 1
            rows_in_front.append(contiguous[::-1])
        total = sum(map(len, rows_in_front))
        if total == 0:
            return None
        if n + total > capacity:
            cap = max(0, (capacity - n) // sum(1 for p in rows_in_front if p))
            rows_in_front = [p[len(p) - min(len(p), cap) :] for p in rows_in_front]
        index, query_start = [], [0]
        for i, in_front in enumerate(rows_in_front):
            index += in_front + list(range(row + starts[i], row + starts[i + 1]))
            query_start.append(len(index))
        self.caught_up_positions += len(index) - n
        index_t = torch.tensor(index, device=hidden.device)
        ids_, pos_, hid_, slot_ = (
            (pool[f] if f in pool else pooled(f))[index_t] for f in SkippedStep.FIELDS
        )
        qsl_cpu = torch.tensor(query_start, dtype=attn_metadata.query_start_loc_cpu.dtype)
        query_lens = [end - start for start, end in zip(query_start, query_start[1:])]
        new_metadata = attn_metadata.replace(
            query_start_loc=qsl_cpu.to(attn_metadata.query_start_loc.device),
            query_start_loc_cpu=qsl_cpu,
            num_actual_tokens=len(index),
            max_query_len=max(query_lens),
            slot_mapping=slot_,
            positions=None if attn_metadata.positions is None else pos_,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return ids_, pos_, hid_, new_metadata, [len(p) for p in rows_in_front]


def _eligible(proposer) -> bool:
    from vllm.v1.spec_decode.eagle import EagleProposer

    parallel = proposer.vllm_config.parallel_config
    eligible = (
        isinstance(proposer, EagleProposer)
        and proposer.method in ("eagle", "eagle3")
        and not proposer.needs_extra_input_slots
        and not proposer.parallel_drafting
        and not proposer.uses_mrope
        and not proposer.supports_mm_inputs
        and parallel.data_parallel_size == 1
        and parallel.pipeline_parallel_size == 1
    )
    if eligible and proposer.vllm_config.scheduler_config.async_scheduling:
        logger.warning(ASYNC_OFF)
        return False
    return eligible


def kept_inputs(proposer) -> KeptDraftInputs | None:
    if not hasattr(proposer, "_grpo_kept"):
        proposer._grpo_kept = KeptDraftInputs() if _eligible(proposer) else None
    return proposer._grpo_kept


def _named_arguments(original):
    """A function that maps a call's arguments to `original`'s parameter names (the
    positional ones in order, then the keywords): `inspect.Signature.bind` costs more than
    the rest of a step's bookkeeping here, and these signatures take no *args."""
    names = list(inspect.signature(original).parameters)

    def named(*args, **kwargs) -> dict:
        return {**dict(zip(names, args)), **kwargs}

    return named


def _wrap_propose(original):
    named = _named_arguments(original)

    def propose(self, *args, **kwargs):
        step, self._grpo_step = getattr(self, "_grpo_step", None), None
        kept = kept_inputs(self)
        if kept is None or step is None or not ENABLED:
            return original(self, *args, **kwargs)
        req_ids, num_draft_tokens = step
        call_args = named(self, *args, **kwargs)
        attn_metadata = call_args["common_attn_metadata"]
        n = int(attn_metadata.num_actual_tokens)
        query_lens = torch.diff(attn_metadata.query_start_loc_cpu).tolist()
        # Decode-only: every request's tokens are its last sampled one and its drafts.
        decode_only = all(q == 1 + d for q, d in zip(query_lens, num_draft_tokens))
        if call_args["num_speculative_tokens"] == 0 and decode_only:
            rows = slice(0, n)
            row_req_ids = list(req_ids)
            if any(num_draft_tokens):
                # Drafts were verified: keep what was accepted (rejected positions are
                # written again when their real tokens come).
                rejected = call_args.get("num_rejected_tokens_gpu")
                if rejected is None:
                    kept.clear()
                    return original(self, *args, **kwargs)
                valid = [q - r for q, r in zip(query_lens, rejected.tolist())]
                starts = attn_metadata.query_start_loc_cpu.tolist()
                index = [j for s, v in zip(starts, valid) for j in range(s, s + v)]
                rows = torch.tensor(index, device=attn_metadata.seq_lens.device)
                row_req_ids = [r for r, v in zip(req_ids, valid) for _ in range(v)]
            kept.keep(
                SkippedStep(
                    row_req_ids,
                    call_args["target_token_ids"][rows].clone(),
                    call_args["target_positions"][rows].clone(),
                    call_args["target_hidden_states"][rows].clone(),
                    attn_metadata.slot_mapping[rows].clone(),
                )
            )
            # vLLM's propose forgets the last step's draft probabilities first thing; the
            # runner would otherwise file them under this step's requests.
            self._last_draft_probs = None
            return torch.empty(
                attn_metadata.batch_size(),
                0,
                dtype=torch.int64,
                device=attn_metadata.seq_lens.device,
            )
        caught_up = kept.prepend(
            req_ids,
            call_args["target_token_ids"],
            call_args["target_positions"],
            call_args["target_hidden_states"],
            attn_metadata,
            self.max_num_tokens,
        )
        kept.clear()
        if caught_up is not None:
            (
                call_args["target_token_ids"],
                call_args["target_positions"],
                call_args["target_hidden_states"],
                call_args["common_attn_metadata"],
                added,
            ) = caught_up
            sample = call_args["token_indices_to_sample"]
            if sample is not None:
                # Each request's sampled row moves down by the rows put in front of it
                # and of the requests before it.
                shift = torch.tensor(added, device=sample.device).cumsum(0).to(sample.dtype)
                call_args["token_indices_to_sample"] = sample + shift
        del call_args["self"]
        return original(self, **call_args)

    propose._grpo_original = original
    return propose


def _wrap_runner(original):
    named = _named_arguments(original)

    def propose_draft_token_ids(self, *args, **kwargs):
        spec = named(self, *args, **kwargs)["spec_decode_metadata"]
        # vLLM 0.32 builds this metadata on every step of a speculative engine, with a
        # zero per request when nothing was drafted.
        num_reqs = self.input_batch.num_reqs
        self.drafter._grpo_step = (
            self.input_batch.req_ids[:num_reqs],
            list(spec.num_draft_tokens) if spec is not None else [0] * num_reqs,
        )
        return original(self, *args, **kwargs)

    propose_draft_token_ids._grpo_original = original
    return propose_draft_token_ids


def _wrap_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        if (
            ENABLED
            and not self.use_async_scheduling
            and spec_decode_metadata is not None
            and spec_decode_metadata.max_spec_len == 0
        ):
            spec_decode_metadata = None
        return original(self, logits, spec_decode_metadata)

    _sample._grpo_original = original
    return _sample


def applies() -> bool:

    return vllm_is(TARGET_VERSIONS) and runs_v1_model_runner()


def apply() -> bool:
    if not applies():
        return False
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not hasattr(SpecDecodeBaseProposer.propose, "_grpo_original"):
        SpecDecodeBaseProposer.propose = _wrap_propose(SpecDecodeBaseProposer.propose)
    if not hasattr(GPUModelRunner.propose_draft_token_ids, "_grpo_original"):
        GPUModelRunner.propose_draft_token_ids = _wrap_runner(
            GPUModelRunner.propose_draft_token_ids
        )
    if not hasattr(GPUModelRunner._sample, "_grpo_original"):
        GPUModelRunner._sample = _wrap_sample(GPUModelRunner._sample)
    return True
