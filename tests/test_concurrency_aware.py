"""The concurrency-aware scheduler inside a real vLLM engine (tiny models)."""

from __future__ import annotations

import json
from collections import Counter, deque

import pytest

from grpo_specdec.engine import Engine, SamplingSettings
from tests.conftest import bare_scheduler, tiny_engine_config
from vllm_plugin.controller import (
    FixedPolicy,
    HingeLatency,
    LatencyModel,
    LinearCost,
)
from vllm_plugin.goodput_controller import GoodputController
from vllm_plugin.scheduler import K_METRIC, k_histogram, recent

# A roofline whose knee sits at 8 tokens: deep drafts pay at B=1, none at B>=16.
LATENCY = LatencyModel(
    HingeLatency(flat=40.0, slope=4.0, knee=8.0), LinearCost(base=0.2, per_seq=0.01)
)
K_MAX = 4


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_text(json.dumps({"latency": LATENCY.to_dict()}))
    return str(path)


def _aware_config(tiny_target, tiny_draft, profile_path, **overrides):
    return tiny_engine_config(
        tiny_target,
        speculative={
            "draft": tiny_draft,
            "k": K_MAX,
            "concurrency_aware": True,
            # These tests are of how k follows concurrency on a roofline they set; the tiny
            # model's real steps, nearly free to draft on, would reprice it.
            "controller": {"profile": profile_path, "learn_costs": False},
        },
        **overrides,
    )


@pytest.fixture(scope="module")
def aware_engine(tiny_target, tiny_draft, profile_path):
    engine = Engine(_aware_config(tiny_target, tiny_draft, profile_path))
    yield engine
    engine.shutdown()


def _fixed_length(n_prompts, questions, tokens=24):
    return (questions * 4)[:n_prompts], SamplingSettings(max_tokens=tokens, ignore_eos=True)


def test_no_drafts_at_high_concurrency_and_deep_drafts_alone(aware_engine, questions):
    prompts, sampling = _fixed_length(32, questions)
    crowded = aware_engine.generate(prompts, sampling).spec
    assert crowded["draft_tokens"] == 0  # k = 0 at B = 32: vLLM's own counters agree
    alone = aware_engine.generate(prompts[:1], sampling).spec
    assert alone["drafts"] > 0 and alone["draft_tokens"] >= 3 * alone["drafts"]


def test_k_follows_concurrency_as_requests_finish(aware_engine, plain_engine, questions):
    scheduler = aware_engine.scheduler()
    started_with = scheduler.policy
    # Its own controller, as each benchmark configuration starts: what earlier tests' drafts
    # taught the engine's (the tiny head alone on a prompt is accepted far more often on
    # some machines than on others) does not decide the first crowded steps.
    max_batch = aware_engine.cfg.max_num_seqs
    fresh = GoodputController(LATENCY, scheduler.new_acceptance(), max_batch, learn_costs=False)
    scheduler.set_policy(fresh)
    mark = scheduler.steps_scheduled
    hist_before = _k_counts()
    prompts = (questions * 2)[:24]
    # Requests of very different lengths, so concurrency decays within one batch.
    try:
        out = aware_engine.llm.generate(
            [{"prompt_token_ids": aware_engine.encode(p)} for p in prompts],
            [_sampling(4 + 3 * i) for i in range(len(prompts))],
            use_tqdm=False,
        )
    finally:
        scheduler.set_policy(started_with)
    trace = scheduler.steps_since(mark)
    by_batch = {}
    for _, b, k, _ in trace:
        by_batch.setdefault(b, set()).add(k)
    assert max(by_batch) >= 16 and min(by_batch) <= 2  # the last two may end in one step
    # At B >= 16 a draft pays on this roofline only at acceptance near 1: the controller
    # drafts there at most to probe, k = 1 for a step or two while its evidence is thin (it
    # plans on an upper confidence bound), and learns from them to stop.
    crowded = [k for _, b, k, _ in trace if b >= 16]
    assert max(crowded) <= 1 and sum(k > 0 for k in crowded) <= len(crowded) // 4
    assert min(by_batch[min(by_batch)]) >= 2
    ks = [k for _, _, k, _ in trace]
    assert ks[-1] >= ks[0]  # deeper drafts as the batch drains
    hist_after = _k_counts()
    assert Counter({k: hist_after[k] - hist_before.get(k, 0) for k in hist_after}) == Counter(ks)
    assert K_METRIC in {m.name for m in aware_engine.llm.get_metrics()}
    # Lossless: greedy outputs equal plain decoding, request by request.
    plain = plain_engine.llm.generate(
        [{"prompt_token_ids": aware_engine.encode(p)} for p in prompts],
        [_sampling(4 + 3 * i) for i in range(len(prompts))],
        use_tqdm=False,
    )
    assert [list(o.outputs[0].token_ids) for o in out] == [
        list(o.outputs[0].token_ids) for o in plain
    ]


def test_controllers_compared_on_one_engine_learn_only_while_in_use(aware_engine, questions):
    scheduler = aware_engine.scheduler()
    started_with = scheduler.policy
    first, second = (
        GoodputController(LATENCY, scheduler.new_acceptance(), 8, explore_share=0.0)
        for _ in range(2)
    )
    prompts, sampling = _fixed_length(2, questions, tokens=16)
    try:
        scheduler.set_policy(first)
        aware_engine.generate(prompts, sampling)
        learnt, timed = first.acceptance.tried.copy(), first.costs.weights.copy()
        scheduler.set_policy(FixedPolicy(2))
        aware_engine.generate(prompts, sampling)
        scheduler.set_policy(second)
        aware_engine.generate(prompts, sampling)
    finally:
        scheduler.set_policy(started_with)
    assert learnt.any() and timed.any()  # drafts verified, steps timed
    # not fed by the fixed policy's run nor the second controller's
    assert (first.acceptance.tried == learnt).all() and (first.costs.weights == timed).all()
    assert second.acceptance.tried.any() and second.costs.weights.any()


def test_verifications_before_each_request_s_first_eos_are_counted_in_the_real_engine(
    aware_engine, questions
):
    """vLLM's counts, less the verifications past an EOS the request ignores."""
    scheduler = aware_engine.scheduler()
    started_with = scheduler.policy
    prompts, sampling = _fixed_length(4, questions, tokens=40)
    before = Counter(scheduler.verified_before_eos)
    try:
        scheduler.set_policy(FixedPolicy(2))
        res = aware_engine.generate(prompts, sampling)
    finally:
        scheduler.set_policy(started_with)
    counted = scheduler.verified_before_eos - before
    eos = aware_engine.tokenizer.eos_token_id
    if any(eos in s.token_ids[:-1] for group in res.outputs for s in group):
        assert 0 < counted["drafts"] < res.spec["drafts"]
    else:
        assert counted == {"drafts": res.spec["drafts"], "accepted": res.spec["accepted_tokens"]}
    assert res.spec["drafts"] > 0


def test_verifications_past_an_ignored_eos_are_left_out_of_the_before_eos_counts():
    from types import SimpleNamespace

    from vllm_plugin.group.drafter import MODEL

    def request(output_token_ids, ignore_eos=True):
        params = SimpleNamespace(ignore_eos=ignore_eos, all_stop_token_ids={2, 7})
        return SimpleNamespace(sampling_params=params, output_token_ids=output_token_ids)

    scheduler = bare_scheduler(
        {
            "before": request([5, 6]),
            "past": request([5, 7, 6]),  # 7: a stop token of the generation config
            "stopping": request([5, 6], ignore_eos=False),
        }
    )
    pool = scheduler.controller.acceptance
    scheduler.make_spec_decoding_stats(None, 3, 2, None, "before")
    learnt = pool.tried.copy(), pool.accepted.copy()
    scheduler.make_spec_decoding_stats(None, 3, 1, None, "past")
    # A draft past an ignored EOS leaves the controller's estimate as it was; it is that
    # request's own evidence only.
    assert (pool.tried == learnt[0]).all() and (pool.accepted == learnt[1]).all()
    assert pool.requests["past"][0].tolist() == [1, 1, 0, 0]
    scheduler.make_spec_decoding_stats(None, 3, 3, None, "stopping")
    scheduler.make_spec_decoding_stats(None, 3, 0, {"gone": 3}, "gone")  # all invalid
    assert scheduler.verified_before_eos == {"drafts": 2, "accepted": 5}
    assert scheduler.verified_by_source == {MODEL: 3}  # every verification, as before
    assert pool.tried[0] > learnt[0][0]  # the request that stops at EOS taught it


class _Seen:
    """A policy that drafts nothing and keeps what the scheduler asked it."""

    def __init__(self):
        self.asked = []

    def choose(self, batch_size, context=None, requests=()):
        self.asked.append((batch_size, context))
        return 0


def test_the_policy_sees_the_running_requests_mean_context(aware_engine, questions):
    """The context the attention term prices (LatencyModel.step_ms) is what vLLM's running
    requests hold: their prompt and output tokens, averaged, each step."""
    scheduler = aware_engine.scheduler()
    started_with = scheduler.policy
    prompts = [aware_engine.encode(q) for q in questions[:2]]
    seen = _Seen()
    try:
        scheduler.set_policy(seen)
        aware_engine.generate(prompts, SamplingSettings(max_tokens=6, ignore_eos=True))
    finally:
        scheduler.set_policy(started_with)
    prompt_mean = sum(map(len, prompts)) / 2
    # Step i (i = 0: prefill) schedules both requests, each holding its prompt and i tokens
    # then (vLLM reads the table once the step's tokens are scheduled).
    assert [b for b, _ in seen.asked] == [2] * 6
    assert [c - prompt_mean for _, c in seen.asked] == pytest.approx(range(6), abs=1)
    assert all(b > a for (_, a), (_, b) in zip(seen.asked, seen.asked[1:]))


def test_steps_since_a_mark_stay_right_once_the_trace_is_full():
    # The trace keeps the newest records only; a window taken by length would come back
    # empty once it is full, so windows are counted from the total of steps scheduled.
    trace = deque(maxlen=3)
    for step in range(5):
        trace.append(step)
    assert recent(trace, 2) == [3, 4]
    assert recent(trace, 7) == [2, 3, 4]
    assert recent(trace, 0) == []


def _k_counts() -> Counter:
    """Steps per k recorded in the scheduler's histogram metric."""
    counts = Counter()
    for sample in k_histogram().collect()[0].samples:
        if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
            counts[int(float(sample.labels["le"]))] += sample.value
    # buckets are cumulative: turn them into counts per k
    return Counter({k: counts[k] - counts.get(k - 1, 0) for k in counts})


def _sampling(max_tokens):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_greedy_outputs_equal_plain_decoding(aware_engine, plain_engine, questions):
    sampling = SamplingSettings(max_tokens=40)
    for batch in (1, 5, 18):
        got = aware_engine.generate(questions[:batch], sampling)
        want = plain_engine.generate(questions[:batch], sampling)
        assert [g[0].token_ids for g in got.outputs] == [g[0].token_ids for g in want.outputs]


def test_plugin_loaded_but_disabled_engine_keeps_vllm_behaviour(eagle_engine, questions):
    from vllm.v1.core.sched.scheduler import Scheduler

    import vllm_plugin

    assert vllm_plugin.LOADED  # the general plugin ran in this (engine) process
    scheduler = eagle_engine.scheduler()
    assert type(scheduler).__module__.startswith("vllm.")
    assert isinstance(scheduler, Scheduler) and scheduler.dynamic_sd_lookup is None
    prompts, sampling = _fixed_length(32, questions)
    spec = eagle_engine.generate(prompts, sampling).spec
    assert spec["draft_tokens"] == 3 * spec["drafts"] > 0  # fixed k at any concurrency


def _queued_before_the_first_step(engine, prompts, tokens) -> dict:
    """vLLM's spec counts of a generation whose requests all reach the engine process
    before it schedules any (vLLM's recipe: sleep(level=0), enqueue, wake_up)."""
    from grpo_specdec.engine import SpecCounters

    engine.llm.sleep(level=0)
    engine.llm.enqueue(
        [{"prompt_token_ids": engine.encode(p)} for p in prompts], _sampling(tokens), use_tqdm=False
    )
    engine.llm.wake_up(tags=["scheduling"])
    counters = SpecCounters()
    for request in engine.llm.wait_for_completion(use_tqdm=False):
        for sample in request.outputs:
            counters.observe_sequence(sample.spec_decode_metrics)
    return counters.metrics()


def test_concurrency_aware_engine_in_its_own_process(
    tiny_target, tiny_draft, profile_path, questions
):
    engine = Engine(_aware_config(tiny_target, tiny_draft, profile_path, engine_process="separate"))
    try:
        prompts, sampling = _fixed_length(32, questions)
        # Sent by generate(), requests reach a separate engine process one by one, and how
        # many steps run with a handful of them (and draft) depends on this machine's
        # speed; queued before the first step, all 32 run from the start: k = 0 throughout.
        crowded = _queued_before_the_first_step(engine, prompts, sampling.max_tokens)
        assert crowded["draft_tokens"] == 0
        alone = engine.generate(prompts[:1], sampling).spec
        assert alone["draft_tokens"] >= 3 * alone["drafts"] > 0
    finally:
        engine.shutdown()


def test_missing_profile_is_a_clear_error(tiny_target, tiny_draft, tmp_path):
    with pytest.raises(Exception, match="no latency profile at .*nope.json"):
        Engine(_aware_config(tiny_target, tiny_draft, str(tmp_path / "nope.json")))


def test_generate_cli_concurrency_aware(tiny_target, tiny_draft, profile_path, questions, tmp_path):
    import json

    from tests.conftest import run_cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(questions[:3]) + "\n")
    out = tmp_path / "out.json"
    run_cli(
        "generate",
        "--model",
        tiny_target,
        "--draft",
        tiny_draft,
        "--k",
        "4",
        "--concurrency-aware",
        "--profile",
        profile_path,
        "--prompts",
        str(prompts),
        "--max-tokens",
        "24",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-gib",
        "0.25",
        "--eager",
        "--json",
        str(out),
    )
    spec = json.loads(out.read_text())["spec"]
    # three requests: deep drafts, all at most k_max = 4 tokens
    assert spec["drafts"] > 0 and max(int(k) for k in spec["draft_length_hist"]) <= 4


class _Alternating(GoodputController):
    """Proposes 3 drafts, then none, then 3, ...: every step verifies another k than it
    proposes."""

    def choose(self, batch_size, context=None, requests=()):
        self.steps += 1
        return 3 * (self.steps % 2)


def test_a_step_is_priced_only_at_a_k_it_both_verifies_and_proposes(aware_engine, questions):
    """A step's cost is the target's forward over the drafts the step before proposed plus
    the drafts it proposes: where the two k differ it is neither k's price, and is not
    timed (priced at the k it proposes, a step verifying nothing and proposing 4 made k = 4
    look as cheap as k = 0)."""
    scheduler = aware_engine.scheduler()
    started_with = scheduler.policy
    alternating = _Alternating(LATENCY, scheduler.new_acceptance(), 8)
    steady = GoodputController(LATENCY, scheduler.new_acceptance(), 8)
    prompts, sampling = _fixed_length(2, questions, tokens=16)
    try:
        scheduler.set_policy(alternating)
        aware_engine.generate(prompts, sampling)
        scheduler.set_policy(steady)
        aware_engine.generate(prompts, sampling)
    finally:
        scheduler.set_policy(started_with)
    assert alternating.steps > 4 and alternating.costs.weights.sum() == 0
    assert steady.costs.weights.sum() > 0


def test_the_scheduler_times_its_steps_and_restarts_on_a_cache_reset(aware_engine, questions):
    """Each decode step's time reaches the controller's costs (at the k it ran); a prefix
    cache reset (every weight swap makes one) turns the acceptance evidence into a prior."""
    scheduler = aware_engine.scheduler()
    started_with = scheduler.policy
    controller = GoodputController(LATENCY, scheduler.new_acceptance(), 8)
    prompts, sampling = _fixed_length(2, questions, tokens=16)
    try:
        scheduler.set_policy(controller)
        mark = scheduler.steps_scheduled
        aware_engine.generate(prompts, sampling)
        timed = controller.costs.weights.sum(axis=1)
        trace = scheduler.steps_since(mark)
        # timed at k: decode steps that verify drafts sized by the k they propose
        ran = Counter(
            k for (_, _, before, _), (_, _, k, decode_only) in zip(trace, trace[1:])
            if decode_only and k == before
        )  # fmt: skip
        assert timed.sum() > 0 and all(timed[k] > 0 for k in ran if ran[k] > 2)
        for _ in range(200):
            controller.acceptance.observe(4, 4)
        aware_engine.llm.reset_prefix_cache()
        assert controller.acceptance.tried[0] == pytest.approx(
            scheduler.controller_settings.acceptance_restart_weight
        )
    finally:
        scheduler.set_policy(started_with)


def test_the_engine_says_once_when_vllm_does_not_run_the_k_it_chose(
    aware_engine, questions, monkeypatch, capsys
):
    """The k chosen sizes the drafts the next step verifies. With k changing as requests
    finish the engine says nothing; when the drafts vLLM verifies are cut to one token
    (what a vLLM that caps k would do), it says so once, naming both numbers."""
    import vllm_plugin

    scheduler = aware_engine.scheduler()
    started_with = scheduler.policy
    monkeypatch.setattr(scheduler, "k_check", type(scheduler.k_check)())
    monkeypatch.setattr(vllm_plugin, "SAID", set())
    prompts = (questions * 2)[:12]
    sampling = [_sampling(4 + 3 * i) for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": aware_engine.encode(p)} for p in prompts]
    mark = scheduler.steps_scheduled
    aware_engine.llm.generate(inputs, sampling, use_tqdm=False)
    assert len({k for _, _, k, _ in scheduler.steps_since(mark)}) > 1  # k changed
    assert scheduler.k_check.seen is None and "did not run" not in capsys.readouterr().err

    original = scheduler.update_draft_token_ids

    def capped(draft_token_ids):
        draft_token_ids.draft_token_ids = [d[:1] for d in draft_token_ids.draft_token_ids]
        original(draft_token_ids)

    monkeypatch.setattr(scheduler, "update_draft_token_ids", capped)
    scheduler.set_policy(FixedPolicy(3))
    try:
        aware_engine.llm.generate(inputs[:2], [_sampling(40)] * 2, use_tqdm=False)
        aware_engine.llm.generate(inputs[:2], [_sampling(40)] * 2, use_tqdm=False)
    finally:
        scheduler.set_policy(started_with)
    assert scheduler.k_check.seen == (3, 1)
    said = [line for line in capsys.readouterr().err.splitlines() if "did not run" in line]
    assert len(said) == 1 and "at most 1 draft" in said[0] and "k = 3" in said[0], said


def test_without_the_cpu_sampling_fix_steps_with_sampled_requests_draft_nothing(
    aware_engine, questions, monkeypatch, capsys
):
    """Drafts at T > 0 on CPU need cpu_expand_kernel_v0_32 (vLLM's rejection sampler samples
    garbage without it): where it is not applied, steps running a sampled request draft
    nothing, said once; greedy requests still draft."""
    import vllm_plugin
    from vllm_plugin.scheduler import sampling_fix_missing

    assert sampling_fix_missing(True, []) and not sampling_fix_missing(False, [])
    assert not sampling_fix_missing(True, ["cpu_expand_kernel_v0_32"])
    scheduler = aware_engine.scheduler()
    assert scheduler.sampling_fix_missing is False  # applied here
    started_with = scheduler.policy
    monkeypatch.setattr(scheduler, "sampling_fix_missing", True)
    monkeypatch.setattr(vllm_plugin, "SAID", set())
    scheduler.set_policy(FixedPolicy(3))
    try:
        sampled = aware_engine.generate(
            questions[:4], SamplingSettings(temperature=1.0, max_tokens=16)
        )
        greedy = aware_engine.generate(questions[:4], SamplingSettings(max_tokens=16))
    finally:
        scheduler.set_policy(started_with)
    assert sampled.spec["draft_tokens"] == 0 and greedy.spec["draft_tokens"] > 0
    said = [line for line in capsys.readouterr().err.splitlines() if "cpu_expand_kernel" in line]
    assert len(said) == 1 and "draft nothing (k = 0)" in said[0]


def test_an_engine_whose_k0_steps_draft_says_once_when_the_draft_never_pays(
    aware_engine, questions, monkeypatch, capsys
):
    """On this engine (CPU, Model Runner V1, synchronous, the free k = 0 patch applied) a
    step at k = 0 skips the draft pass, so a controller that drafts nothing costs nothing
    and nothing is said. Where k = 0 steps still run the draft (Model Runner V2, CUDA's
    default) a window of steps at k = 0 is said once, as slower than no speculation."""
    import vllm_plugin
    from vllm_plugin.patches import acting
    from vllm_plugin.unpaid_draft import UnpaidDraftCheck, k0_steps_draft

    scheduler = aware_engine.scheduler()
    assert scheduler.unpaid_check.k0_steps_draft is False
    on_v1, on_v2 = acting(vllm_plugin.PATCHED, "V1"), acting(vllm_plugin.PATCHED, "V2")
    assert k0_steps_draft(on_v1, async_scheduling=False) is False
    assert k0_steps_draft(on_v2, async_scheduling=False) is True
    assert k0_steps_draft(on_v1, async_scheduling=True) is True
    assert k0_steps_draft([], async_scheduling=False) is True  # patches off

    started_with = scheduler.policy
    monkeypatch.setattr(vllm_plugin, "SAID", set())
    inputs = [{"prompt_token_ids": aware_engine.encode(q)} for q in questions[:2]]
    scheduler.set_policy(FixedPolicy(0))
    try:
        monkeypatch.setattr(scheduler, "unpaid_check", UnpaidDraftCheck(False, window=16))
        aware_engine.llm.generate(inputs, [_sampling(40)] * 2, use_tqdm=False)
        assert "draft head was used" not in capsys.readouterr().err
        monkeypatch.setattr(scheduler, "unpaid_check", UnpaidDraftCheck(True, window=16))
        aware_engine.llm.generate(inputs, [_sampling(40)] * 2, use_tqdm=False)
        aware_engine.llm.generate(inputs, [_sampling(40)] * 2, use_tqdm=False)
    finally:
        scheduler.set_policy(started_with)
    said = [line for line in capsys.readouterr().err.splitlines() if "draft head was used" in line]
    assert len(said) == 1 and "0 of the last 16 decode steps" in said[0], said


def test_a_window_where_the_draft_paid_often_enough_says_nothing():
    from vllm_plugin.unpaid_draft import IDLE_SHARE, UnpaidDraftCheck

    check = UnpaidDraftCheck(True, window=100)
    drafting = round(100 * (1 - IDLE_SHARE)) + 1  # just enough steps drafting per window
    said = [check.decode_step(2 if i % 100 < drafting else 0) for i in range(1000)]
    assert not any(said)
    said = [check.decode_step(2 if i % 100 < drafting - 2 else 0) for i in range(300)]
    assert sum(s is not None for s in said) == 1  # once, however long it lasts
