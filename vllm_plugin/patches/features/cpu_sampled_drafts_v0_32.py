"""vLLM 0.32.0 and 0.33.0, CPU only: draft tokens drawn in the head's own vocabulary, so sampled
drafting (`draft_sample_method: "probabilistic"`) does not cost more than the acceptance
it buys, and greedy drafting from a reduced vocabulary costs less.

Per draft position vLLM scatters a reduced-vocabulary (EAGLE-3) head's logits into a
full-vocabulary tensor of -inf, then runs the temperature, a float32 softmax and an
exponential draw over the whole vocabulary, and keeps q as [batch, k, vocab], copied
twice on its way to the rejection sampler. For SmolLM2 (49152 tokens, a 4096-token head)
that is 50 ms per draft position at 64 sequences, 6 ms at 8 (greedy drafting: 1.2 and
0.15 ms).

Here a head with a reduced vocabulary keeps q in its own vocabulary (softmax over its
tokens, one float64 uniform per row by inverse CDF, the token mapped to the target's
ids); q travels as [batch, k, draft vocabulary], and the runner hands the rejection
sampler the head's token ids with it (`hand_on`, a `DraftLayout`), which
`cpu_rejection_sample_v0_32` reads. A full-vocabulary head samples by inverse CDF too (no
exponential draw). A greedy draft from a reduced vocabulary is the argmax of the head's
own logits (the same token, without the scatter). Each draft token is a sample of exactly
the q handed on, so verification keeps the target's distribution. Like vLLM's own draft
sampling, per-request seeds do not reach the draft (it is verified either way). Batches
that mix greedy and sampled requests take vLLM's path unchanged.
"""

from __future__ import annotations

import torch

from vllm_plugin.patches import running_on_cpu, runs_v1_model_runner
from vllm_plugin.patches.features.group_drafts_v0_32 import ONE_HOT_REQS_ATTR
from vllm_plugin.patches.fixes.cpu_rejection_sample_v0_32 import (
    DraftLayout,
    hand_on,
    inverse_cdf,
)

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = True  # acts only in engines on Model Runner V1


def head_vocab_ids(model) -> torch.Tensor | None:
    """The target ids of an EAGLE-3 head's reduced vocabulary (None: the full one)."""
    d2t = getattr(model, "draft_id_to_target_id", None)
    if d2t is None:
        return None
    return torch.arange(len(d2t), device=d2t.device) + d2t


def sample_draft(
    logits: torch.Tensor, temperature: torch.Tensor, vocab_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target token ids, q): one token per row from softmax(logits / temperature), q in
    the logits' own vocabulary."""
    q = (logits.float() / temperature.view(-1, 1).float()).softmax(dim=-1)
    u = torch.rand(len(q), dtype=torch.float64, device=q.device)
    ids = inverse_cdf(q, u)
    return (ids if vocab_ids is None else vocab_ids[ids]), q


def _sample_draft_tokens(self, hidden_states, sampling_metadata):
    original = _sample_draft_tokens._grpo_original
    if self.use_local_argmax_reduction or self.use_heterogeneous_vocab:
        return original(self, hidden_states, sampling_metadata)
    vocab_ids = head_vocab_ids(self.model)
    temperature = sampling_metadata.temperature
    if not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy:
        if vocab_ids is None:
            return original(self, hidden_states, sampling_metadata)
        # The argmax of the head's own logits, not of them scattered into the target's
        # vocabulary among -inf (0.08 vs 1.2 ms per draft position at 64 sequences).
        return vocab_ids[
            self.model.logits_processor(self.model.lm_head, hidden_states).argmax(dim=-1)
        ], None
    if (
        not sampling_metadata.all_random
        or temperature is None
        or temperature.shape[0] != hidden_states.shape[0]
    ):
        return original(self, hidden_states, sampling_metadata)
    logits = (
        self.model.compute_logits(hidden_states)
        if vocab_ids is None
        else self.model.logits_processor(self.model.lm_head, hidden_states)
    )
    return sample_draft(logits, temperature, vocab_ids)


def _get_spec_decode_draft_probs(self, spec_decode_metadata):
    q = _get_spec_decode_draft_probs._grpo_original(self, spec_decode_metadata)
    if q is None:
        return q
    vocab_ids = head_vocab_ids(self.drafter.model)
    if vocab_ids is not None and q.shape[-1] != len(vocab_ids):
        vocab_ids = None
    one_hot, one_hot_reqs = None, getattr(self, ONE_HOT_REQS_ATTR, ())
    if one_hot_reqs:
        # The group's drafts among them: one flag per draft token, in q's row order.
        flags = [
            req_id in one_hot_reqs
            for req_id, n in zip(self.input_batch.req_ids, spec_decode_metadata.num_draft_tokens)
            for _ in range(n)
        ]
        one_hot = torch.tensor(flags, dtype=torch.bool, device=q.device)
    hand_on(q, DraftLayout(vocab_ids, one_hot))
    return q


def applies() -> bool:
    return running_on_cpu(TARGET_VERSIONS) and runs_v1_model_runner()


def apply() -> bool:
    if not applies():
        return False
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for cls, fn in (
        (SpecDecodeBaseProposer, _sample_draft_tokens),
        (GPUModelRunner, _get_spec_decode_draft_probs),
    ):
        current = getattr(cls, fn.__name__)
        if not hasattr(current, "_grpo_original"):
            fn._grpo_original = current
            setattr(cls, fn.__name__, fn)
    return True
