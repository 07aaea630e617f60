"""vLLM scheduler that chooses the number of draft tokens every step from live concurrency.

Enable with `scheduler_cls="vllm_plugin.scheduler.ConcurrencyAwareScheduler"` (or
`--scheduler-cls ...` for `vllm serve`) on an engine with EAGLE speculation; its
`num_speculative_tokens` becomes k_max. Targets vLLM 0.32.

It uses the scheduler's own dynamic-speculation hook: vLLM reads
`dynamic_sd_lookup[batch_size]` once per step to get k (0 turns drafting off), so the
lookup is replaced by the controller. Acceptance feeds back through
`make_spec_decoding_stats`, which vLLM calls once per request that had drafts verified;
what a step cost, through the time from its scheduling to its output
(`update_from_output`). The controller's pooled evidence restarts when the prefix cache is
reset (every weight swap of this project's lifecycle resets it) and when a new wave of
requests outnumbers those running.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import Counter, deque

from vllm.platforms import current_platform
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

import vllm_plugin
from vllm_plugin import patches
from vllm_plugin.acceptance import AcceptanceEstimator
from vllm_plugin.compat import dense_k_table, is_registered
from vllm_plugin.controller import FixedPolicy, PaperPolicy, Policy
from vllm_plugin.goodput_controller import GoodputController
from vllm_plugin.group.drafter import MODEL
from vllm_plugin.k_check import KHonouredCheck
from vllm_plugin.settings import ControllerSettings, find_latency, load_latency
from vllm_plugin.unpaid_draft import UnpaidDraftCheck, k0_steps_draft

logger = logging.getLogger(__name__)

K_METRIC = "vllm:grpo_specdec_num_spec_tokens_per_step"
_K_HISTOGRAM = None


def k_histogram():
    """Prometheus histogram of k per step, one per process, in vLLM's `vllm:` namespace so
    `LLM.get_metrics()` and `/metrics` include it."""
    global _K_HISTOGRAM
    if _K_HISTOGRAM is None:
        import prometheus_client

        _K_HISTOGRAM = prometheus_client.Histogram(
            K_METRIC,
            "Draft tokens chosen per engine step by the concurrency-aware scheduler.",
            labelnames=["model_name"],
            buckets=list(range(17)),
            registry=None,
        )
    return _K_HISTOGRAM


def _ensure_registered(collector) -> None:
    # vLLM drops every `vllm:` collector from the registry whenever an engine's stat
    # loggers start (after this scheduler is built), so registration is checked per step.
    import prometheus_client

    if not is_registered(collector):
        prometheus_client.REGISTRY.register(collector)


def build_policy(
    settings: ControllerSettings, estimator: AcceptanceEstimator, vllm_config
) -> Policy:
    k_max = estimator.k_max
    if settings.policy == "fixed":
        return FixedPolicy(k_max if settings.fixed_k is None else min(settings.fixed_k, k_max))
    if settings.policy == "paper":
        return PaperPolicy(load_latency(settings, vllm_config).c_peak, k_max, alpha=settings.alpha)
    latency, missing = find_latency(settings, vllm_config)
    if latency is None:
        logger.warning(
            "concurrency-aware speculation: %s. Starting without one: k = 0 until the "
            "engine's own timed steps show a k that pays",
            missing,
        )
    return GoodputController(
        latency,
        estimator,
        vllm_config.scheduler_config.max_num_seqs,
        explore_share=settings.explore_share,
        learn_costs=settings.learn_costs,
    )


class _PolicyLookup:
    """Stands in for vLLM's dense batch-size -> k table; the policy also sees the running
    requests' mean context and ids (read as vLLM reads the table: once per step, after
    scheduling)."""

    def __init__(self, policy: Policy, scheduler):
        self.policy, self.scheduler = policy, scheduler

    def __getitem__(self, batch_size: int) -> int:
        running = self.scheduler.running  # vLLM rebinds the list as requests finish
        context = statistics.fmean(r.num_tokens for r in running) if running else None
        k = self.policy.choose(batch_size, context, [r.request_id for r in running])
        if (
            k
            and self.scheduler.sampling_fix_missing
            and any(
                r.sampling_params is not None and r.sampling_params.temperature > 0 for r in running
            )
        ):
            k = 0  # drafts at T > 0 would be sampled wrongly here: none while such run
            vllm_plugin.say_once(SAMPLING_FIX_MISSING)
        self.scheduler.chosen = (batch_size, k, context)
        return k


SAMPLING_FIX_MISSING = (
    "grpo-specdec: this CPU engine samples at T > 0, and the fix that sampling with drafts "
    "needs on CPU (cpu_expand_kernel_v0_32) is not applied (GRPO_SPECDEC_NO_PATCHES=1, or a "
    "vLLM it does not target): steps with such requests draft nothing (k = 0), so their "
    "tokens keep the target's distribution"
)


def sampling_fix_missing(is_cpu: bool, patched: list[str]) -> bool:
    """Whether drafts sampled at T > 0 would be sampled wrongly in this process: on CPU,
    vLLM's rejection sampler needs `cpu_expand_kernel_v0_32`."""
    return is_cpu and "cpu_expand_kernel_v0_32" not in patched


def past_first_eos(request) -> bool:
    """Has this request already made an EOS (or a stop token of the model's generation
    config) that it was told to ignore (`ignore_eos`, as benchmarks equalising lengths
    set)? Drafts verified past it are on text a real rollout never makes. A request that
    stops at EOS is never past it."""
    params = request.sampling_params
    return (
        params is not None
        and params.ignore_eos
        and not params.all_stop_token_ids.isdisjoint(request.output_token_ids)
    )


def recent(trace: deque, n: int) -> list:
    """The last n records of trace (all it holds if n exceeds that)."""
    return list(itertools.islice(trace, max(0, len(trace) - n), None)) if n > 0 else []


def check_engine(vllm_config, k_max: int) -> None:
    """Refuse an engine whose ranks must run one k together; say which k get no full CUDA
    graph. Data-parallel ranks of a mixture-of-experts model step together (their expert
    collectives run every forward, and the drafter's count depends on k), so a k chosen per
    rank from its own batch diverges and deadlocks; vLLM turns its own per-batch-size k off
    there (`VllmConfig._maybe_disable_dynamic_sd_for_data_parallel`). Dense data-parallel
    ranks are independent engines, each with its own scheduler."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
    if parallel.data_parallel_size > 1 and model.is_moe:
        raise ValueError(
            f"ConcurrencyAwareScheduler: data_parallel_size={parallel.data_parallel_size} on a "
            "mixture-of-experts model, whose data-parallel ranks step together: a k chosen "
            "per rank from its own batch would diverge across them and deadlock. Run the "
            "engine without data parallelism, or with a fixed k (no scheduler_cls)"
        )
    if not vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs():
        return
    table = vllm_config.speculative_config.num_speculative_tokens_per_batch_size
    listed = set(table_ks(table, vllm_config.scheduler_config.max_num_seqs, k_max))
    missing = sorted(set(range(k_max + 1)) - listed)
    if missing:
        logger.warning(
            "concurrency-aware speculation: num_speculative_tokens_per_batch_size %s lists "
            "no k in %s, so vLLM prepares no full CUDA graph for steps at those k; pass "
            "vllm_plugin.k_table.every_k_table(%d, max_num_seqs)",
            table,
            missing,
            k_max,
        )


def table_ks(table, max_num_seqs: int, k_max: int) -> list[int]:
    """The k of each batch size in vLLM's dense lookup of `table` (none without one)."""
    if not table:
        return []
    return dense_k_table(table, max_num_seqs, k_max)[1:]


class ConcurrencyAwareMixin:
    def _init_controller(self) -> None:
        if self.num_spec_tokens <= 0:
            raise ValueError(
                "ConcurrencyAwareScheduler needs speculative decoding: set a speculative_config "
                "whose num_speculative_tokens is the largest k to draft"
            )
        check_engine(self.vllm_config, self.num_spec_tokens)
        self.controller_settings = ControllerSettings.of_engine(self.vllm_config)
        # Which drafter made each request's pending drafts (patches/features/group_drafts_v0_32.py
        # says; without it every draft is the model's), so k is priced on the model's.
        self.draft_sources: dict[str, str] = {}
        self.verified_by_source: Counter = Counter()  # request-steps with drafts verified
        # "drafts" (request-steps with drafts verified) and their "accepted" tokens, on text
        # before each request's first EOS: vLLM's counts less those past an ignored EOS.
        self.verified_before_eos: Counter = Counter()
        self.set_policy(self.new_policy())
        # (monotonic time, running requests, k, decode-only step), one per step.
        self.step_trace: deque = deque(maxlen=self.controller_settings.trace_steps)
        self.steps_scheduled = 0  # keeps counting once the trace drops its oldest records
        # (request id, output tokens before the draft, drafted, accepted, past first EOS) of
        # every verified draft of the model, for the regime suite's traces.
        self.draft_events: deque = deque(maxlen=self.controller_settings.trace_steps)
        self.chosen: tuple | None = None  # (B, k, context) as the policy last chose
        # Each scheduled step's (start, B, k, context, timed?) until its output comes.
        self._pending_steps: dict[int, tuple] = {}
        self._last_output_at = 0.0
        self._untimed_steps = 0  # steps not to time (the first after a cache reset)
        self.k_check = KHonouredCheck()
        runner = patches.engine_runner(self.vllm_config)
        self.unpaid_check = UnpaidDraftCheck(
            k0_steps_draft(
                patches.acting(vllm_plugin.PATCHED, runner),
                self.vllm_config.scheduler_config.async_scheduling,
            )
        )
        self.sampling_fix_missing = sampling_fix_missing(
            current_platform.is_cpu(), vllm_plugin.PATCHED
        )
        self._k_last_scheduled: int | None = None  # sizes the drafts the next step verifies
        self._k_metric = k_histogram().labels(
            model_name=self.vllm_config.model_config.served_model_name
        )
        logger.info(
            "concurrency-aware speculation: policy %s, k_max %d",
            self.controller_settings.policy,
            self.num_spec_tokens,
        )

    def steps_since(self, mark: int) -> list[tuple]:
        """The trace records of the steps scheduled after `steps_scheduled` was `mark`
        (the newest ones the trace still holds, if more steps ran than it keeps)."""
        return recent(self.step_trace, self.steps_scheduled - mark)

    def new_acceptance(self) -> AcceptanceEstimator:
        """An acceptance estimator at the configured prior, with no evidence yet."""
        settings = self.controller_settings
        return AcceptanceEstimator(
            self.num_spec_tokens,
            prior=settings.acceptance_prior,
            optimism=settings.acceptance_optimism,
            memory=settings.acceptance_memory,
            restart_weight=settings.acceptance_restart_weight,
        )

    def new_policy(self) -> Policy:
        """The configured policy in its starting state (a goodput controller with no
        evidence and its profile uncorrected)."""
        return build_policy(self.controller_settings, self.new_acceptance(), self.vllm_config)

    def set_policy(self, policy: Policy | list[int]) -> None:
        """Change where k comes from, at run time: a policy, or a dense batch-size -> k
        list exactly as vLLM builds from `num_speculative_tokens_per_batch_size`. Only a
        goodput controller learns from the steps; each keeps its own state, so policies
        compared on one engine share nothing they learnt."""
        self.policy = policy
        self.controller = policy if isinstance(policy, GoodputController) else None
        self.dynamic_sd_lookup = policy if isinstance(policy, list) else _PolicyLookup(policy, self)

    @property
    def acceptance(self) -> AcceptanceEstimator | None:
        """The acceptance estimate of the goodput controller in use (None without one)."""
        return self.controller.acceptance if self.controller is not None else None

    def _restart(self) -> None:
        if self.controller is not None:
            self.controller.restart()
            self.controller.forget([r.request_id for r in self.running])
        self._untimed_steps = 1

    def reset_prefix_cache(self, *args, **kwargs):
        # Every weight swap of this project's lifecycle resets the cache (its KV was
        # computed by the old weights): what the draft's acceptance was is now a prior.
        self._restart()
        return super().reset_prefix_cache(*args, **kwargs)

    def schedule(self, *args, **kwargs):
        running_before, start = len(self.running), time.monotonic()
        self.chosen = None
        out = super().schedule(*args, **kwargs)
        if out.num_scheduled_tokens:
            batch = len(out.num_scheduled_tokens)
            if out.scheduled_new_reqs and len(out.scheduled_new_reqs) >= running_before:
                self._restart()  # a new wave: the requests before it do not speak for it
            k = out.num_spec_tokens_to_schedule
            decode_only = not out.scheduled_new_reqs and all(
                n == 1 + len(out.scheduled_spec_decode_tokens.get(req, ()))
                for req, n in out.num_scheduled_tokens.items()
            )
            context = self.chosen[2] if self.chosen and self.chosen[0] == batch else None
            # vLLM 0.33's Model Runner V2 drafts nothing after a step whose every request
            # ends in it (`skip_drafts`), whatever k says: such a step is not priced at k.
            skipped = getattr(out, "skip_drafts", False)
            sized_by = self._k_last_scheduled if decode_only else None
            # A step verifies the drafts the step before it proposed (sized by that step's
            # k) and proposes this step's k: it costs what the latency model prices at k
            # only where the two agree. A step of B that verifies 4 drafts each and proposes
            # none is no k = 0 step, and one that verifies none and proposes 4 no k = 4 step
            # (priced so, such steps made k = 4 look cheap at B = 64).
            timed = decode_only and not skipped and self._untimed_steps == 0 and sized_by == k
            self._untimed_steps = max(self._untimed_steps - 1, 0)
            if len(self._pending_steps) > 8:  # outputs that never came (an engine reset)
                self._pending_steps.clear()
            self._k_last_scheduled = k
            self._pending_steps[id(out)] = (start, batch, k, context, timed, sized_by)
            self.step_trace.append((time.monotonic(), batch, k, decode_only))
            if decode_only and (message := self.unpaid_check.decode_step(k)):
                vllm_plugin.say_once(message)
            if self.controller is not None and len(self.controller.acceptance.requests) > 2 * (
                self.max_num_running_reqs
            ):
                self.controller.forget([r.request_id for r in self.running])
            self.steps_scheduled += 1
            _ensure_registered(k_histogram())
            self._k_metric.observe(k)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        now = time.monotonic()
        step = self._pending_steps.pop(id(scheduler_output), None)
        if step is not None:
            self._check_k_honoured(scheduler_output, step[5])
        if step is not None and self.controller is not None:
            start, batch, k, context, timed, _ = step
            if timed:
                # From the later of its scheduling and the previous output (async
                # scheduling schedules a step while the one before it runs) to its output.
                ms = 1000.0 * (now - max(start, self._last_output_at))
                self.controller.step_timed(batch, k, context, ms)
        self._last_output_at = now
        return super().update_from_output(scheduler_output, model_runner_output)

    def _check_k_honoured(self, out, sized_by: int | None) -> None:
        """Compare the k that sized this step's drafts with the most vLLM verified for one
        request that neither its max_tokens, the model's length nor a grammar (structured
        output drops drafts it rejects) could have clipped. Group drafts run up to k_max
        whatever k says: with them on, k sizes no draft."""
        if self.controller_settings.group.enabled:
            return
        limit = self.num_spec_tokens + 1
        invalid = out.num_invalid_spec_tokens or {}
        verified = [
            len(out.scheduled_spec_decode_tokens.get(req_id, ())) - invalid.get(req_id, 0)
            for req_id in out.num_scheduled_tokens
            if (r := self.requests.get(req_id)) is not None
            and r.num_tokens + limit <= self.max_model_len
            and (r.max_tokens is None or r.num_output_tokens + limit <= r.max_tokens)
            and not r.use_structured_output
        ]
        message = self.k_check.step_verified(sized_by, max(verified, default=None))
        if message is not None:
            vllm_plugin.say_once(message)

    def update_draft_token_ids(self, draft_token_ids) -> None:
        sources = getattr(draft_token_ids, "grpo_sources", None)
        if sources is not None:
            self.draft_sources = dict(zip(draft_token_ids.req_ids, sources))
        # The model drafted these and a group draft was verified instead: for pricing k
        # the model's tokens were made and not used.
        for discarded in getattr(draft_token_ids, "grpo_model_discarded", None) or ():
            if discarded and self.controller is not None:
                self.controller.drafts_verified(None, discarded, 0)
        super().update_draft_token_ids(draft_token_ids)

    def make_spec_decoding_stats(
        self,
        spec_decoding_stats,
        num_draft_tokens,
        num_accepted_tokens,
        num_invalid_spec_tokens,
        request_id,
    ):
        invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)
        source = self.draft_sources.get(request_id, MODEL)
        drafted = num_draft_tokens - invalid
        if drafted > 0:
            self.verified_by_source[source] += 1
            request = self.requests.get(request_id)
            before_eos = request is None or not past_first_eos(request)
            if before_eos:
                self.verified_before_eos["drafts"] += 1
                self.verified_before_eos["accepted"] += num_accepted_tokens
            if source == MODEL:
                if self.controller is not None:
                    self.controller.drafts_verified(
                        request_id, drafted, num_accepted_tokens, before_eos
                    )
                position = len(request.output_token_ids) if request is not None else -1
                self.draft_events.append(
                    (request_id, position, drafted, num_accepted_tokens, not before_eos)
                )
        return super().make_spec_decoding_stats(
            spec_decoding_stats,
            num_draft_tokens,
            num_accepted_tokens,
            num_invalid_spec_tokens,
            request_id,
        )


class ConcurrencyAwareScheduler(ConcurrencyAwareMixin, Scheduler):
    """The one class users name. vLLM turns async scheduling on by default for EAGLE,
    and then needs an AsyncScheduler; construction picks the matching variant."""

    def __new__(cls, vllm_config, *args, **kwargs):
        if cls is ConcurrencyAwareScheduler and vllm_config.scheduler_config.async_scheduling:
            return AsyncConcurrencyAwareScheduler(vllm_config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_controller()


class AsyncConcurrencyAwareScheduler(ConcurrencyAwareMixin, AsyncScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_controller()
