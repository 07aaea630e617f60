"""vLLM 0.32.0 and 0.33.0: drafts from a GRPO group's text, next to the engine's own drafter.

vLLM 0.32 hosts one proposer per engine, and none of its model-free ones sees request
ids or groups (`ngram` reads a request's own tokens, `custom_class` token rows, `suffix`
needs Arctic Inference and a fixed draft length). So the plugin hooks the one place
where every step's drafts pass on their way to the scheduler, `take_draft_token_ids`,
called after the step's bookkeeping: there each request's prompt and output are
current, and the drafts the engine's drafter made (EAGLE's k per request, or none) can
be replaced per request by `GroupDrafter`'s choice. Drafts of any length up to
`num_speculative_tokens` per request are what vLLM's ngram path already produces; the
scheduler, the runner and the rejection sampler take them as they are. Every draft is
verified by the target, so outputs keep its distribution. A group draft is chosen
outright, so its q is one-hot: next to sampled model drafts (`draft_sample_method:
probabilistic`), the runner's cached q is rebuilt per request, the model's rows kept and
the group's made one-hot (over the target's vocabulary), or, for a head with a reduced
vocabulary, which cannot hold every group token, zero and named in `ONE_HOT_REQS_ATTR`
for `cpu_sampled_drafts_v0_32` to flag to the rejection sampler.

The returned `DraftTokenIds` carries `grpo_sources` and `grpo_model_discarded` (one per
request) so the concurrency-aware scheduler learns the model draft's acceptance from its
own drafts only, counting a draft a group draft replaced as made and not accepted.

Active when the controller settings (`additional_config["grpo_specdec"]`) have
`group.enabled`, on vLLM's V1 model runner (V2
never calls this hook; see `patches/__init__.py`); needs synchronous scheduling
(with async scheduling the runner feeds the model draft's device tensor to the next step
and never reads these lists), which is vLLM's setting on CPU and for the `ngram` host.
"""

from __future__ import annotations

import logging

from vllm_plugin.patches import runs_v1_model_runner, vllm_is

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = True  # acts only in engines on Model Runner V1
DRAFTER_ATTR = "_grpo_group"  # where the patched runner holds its GroupDrafter
# Where it names the requests whose cached q (reduced vocabulary) stands for a one-hot draft.
ONE_HOT_REQS_ATTR = "_grpo_one_hot_reqs"

logger = logging.getLogger(__name__)


def group_drafter(runner):
    """The GroupDrafter of vLLM 0.32/0.33 model runner `runner` (a `GPUModelRunner`, which the
    CPU runner subclasses; a worker holds it as `worker.model_runner`), which this patch
    builds when the runner starts; None when group drafts are off or the patch is not on."""
    return getattr(runner, DRAFTER_ATTR, None)


def _build(runner):
    from vllm_plugin.acceptance import AcceptanceEstimator
    from vllm_plugin.group.drafter import GroupDrafter
    from vllm_plugin.settings import ControllerSettings, load_latency

    spec = runner.speculative_config
    if spec is None:
        return None
    settings = ControllerSettings.of_engine(runner.vllm_config)
    if not settings.group.enabled:
        return None
    if runner.use_async_scheduling:
        raise ValueError(
            "group drafts need synchronous scheduling: start the engine with "
            "async_scheduling=False (`vllm serve --no-async-scheduling`; vLLM turns it on by "
            "default for EAGLE on GPU)"
        )
    g = settings.group
    k_max = runner.num_spec_tokens
    drafter = GroupDrafter(
        load_latency(settings, runner.vllm_config),
        k_max,
        max_match=g.max_match,
        history_positions=g.history_positions,
        history_versions=g.history_versions,
        min_confidence=g.min_confidence,
        model_acceptance=AcceptanceEstimator(
            k_max,
            prior=settings.acceptance_prior,
            memory=settings.acceptance_memory,
        ),
    )
    logger.info("group drafts on: k_max %d, %s", k_max, g)
    return drafter


def _wrap_take(original):
    def take_draft_token_ids(self):
        drafts = original(self)
        drafter = group_drafter(self)
        if drafter is None:
            return drafts
        from vllm.v1.outputs import DraftTokenIds

        from vllm_plugin.group.drafter import policy_version

        drafter.follow_policy(policy_version(self.get_model()))

        model = dict(zip(drafts.req_ids, drafts.draft_token_ids)) if drafts else {}
        has_model_draft = self.speculative_config.use_eagle()  # not ngram, the model-free host
        rows = []
        for req_id in self.input_batch.req_ids:
            state = self.requests.get(req_id)
            if state is not None and state.prompt_token_ids is not None:
                rows.append((req_id, state.prompt_token_ids, state.output_token_ids))
        drafter.forget(set(self.requests))
        if not rows:
            return drafts
        proposal = drafter.propose(
            rows, [list(model.get(r[0], ())) if has_model_draft else [] for r in rows]
        )
        _one_hot_group_rows(self, [r[0] for r in rows], proposal)
        out = DraftTokenIds([r[0] for r in rows], proposal.drafts)
        out.grpo_sources = proposal.sources
        out.grpo_model_discarded = proposal.model_discarded
        return out

    take_draft_token_ids._grpo_original = original
    return take_draft_token_ids


def _one_hot_group_rows(runner, req_ids: list[str], proposal) -> None:
    """The runner's cached q (`_draft_probs`, [request, k, vocab], of sampled model drafts)
    as the next verification must read it: the model's rows where its draft is kept, one-hot
    (or, in a reduced vocabulary, zero and named) where the group's replaced it."""
    from vllm_plugin.group.drafter import GROUP

    setattr(runner, ONE_HOT_REQS_ATTR, frozenset())
    q = getattr(runner, "_draft_probs", None)
    if q is None or GROUP not in proposal.sources:
        return
    row_of = {r: i for i, r in enumerate(runner._draft_prob_req_ids)}
    width = max(q.shape[1], *(len(d) for d in proposal.drafts))
    rebuilt = q.new_zeros(len(req_ids), width, q.shape[2])
    full_vocab = q.shape[2] == runner.model_config.get_vocab_size()
    for i, (req_id, draft, source) in enumerate(
        zip(req_ids, proposal.drafts, proposal.sources, strict=True)
    ):
        if source != GROUP:
            if req_id in row_of:
                rebuilt[i, : q.shape[1]] = q[row_of[req_id]]
        elif full_vocab:
            rebuilt[i, range(len(draft)), draft] = 1.0
    runner._draft_probs, runner._draft_prob_req_ids = rebuilt, list(req_ids)
    if not full_vocab:
        group = {r for r, s in zip(req_ids, proposal.sources, strict=True) if s == GROUP}
        setattr(runner, ONE_HOT_REQS_ATTR, frozenset(group))


def _wrap_init(original):
    # Built when the engine starts, from that engine's own settings (its additional_config).
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        setattr(self, DRAFTER_ATTR, _build(self))

    __init__._grpo_original = original
    return __init__


def applies() -> bool:

    return vllm_is(TARGET_VERSIONS) and runs_v1_model_runner()


def apply() -> bool:
    if not applies():
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not hasattr(GPUModelRunner.__init__, "_grpo_original"):
        GPUModelRunner.__init__ = _wrap_init(GPUModelRunner.__init__)
    if not hasattr(GPUModelRunner.take_draft_token_ids, "_grpo_original"):
        GPUModelRunner.take_draft_token_ids = _wrap_take(GPUModelRunner.take_draft_token_ids)
    return True
