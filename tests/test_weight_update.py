"""The weight-update lifecycle that both the trainer's clients and the served route run
(vllm_plugin/weights/lifecycle.py), on a stand-in for `AsyncLLM` driven from another thread as
the route drives it."""

from __future__ import annotations

import asyncio

import pytest

from vllm_plugin.weights.clients import AsyncEngineClient
from vllm_plugin.weights.lifecycle import run_update


class _AsyncEngine:
    """Records the weight-update calls an `AsyncLLM` gets; its load and start fail as told."""

    def __init__(self, load_fails=False, session_open=None):
        self.calls, self.load_fails, self.session_open = [], load_fails, session_open

    async def start_weight_update(self):
        await self._start("start_weight_update")

    async def start_draft_weight_update(self):
        await self._start("start_draft_weight_update")

    async def _start(self, name):
        self.calls.append(name)
        if self.session_open:
            raise RuntimeError("a weight update is already active")

    async def update_weights(self, request):
        self.calls.append(("update_weights", request.update_info["version"]))
        if self.load_fails:
            raise ValueError("missing tensors: w")

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish_weight_update", weight_version))

    async def collective_rpc(self, method):
        self.calls.append(method)
        if method == "grpo_end_stale_weight_update":
            stale = self.session_open == "stale"
            self.session_open = None if stale else self.session_open
            reason = "its trainer died" if stale else "held by live pid 7"
            return [{"ended": stale, "reason": reason}]
        return [None]


def _update(engine, role, version=3):
    async def drive():
        client = AsyncEngineClient(engine, asyncio.get_running_loop())
        info = {"path": "/swap/w.safetensors", "version": version}
        await asyncio.to_thread(run_update, client, role, info, version)

    asyncio.run(drive())


def test_an_update_starts_loads_and_finishes_with_the_policy_s_version():
    policy, draft = _AsyncEngine(), _AsyncEngine()
    _update(policy, "policy")
    _update(draft, "draft")
    assert policy.calls == [
        "start_weight_update",
        ("update_weights", 3),
        ("finish_weight_update", "3"),
    ]
    assert draft.calls == [
        "start_draft_weight_update",
        ("update_weights", 3),
        ("finish_weight_update", None),  # the engine-level version is the policy's
    ]


def test_a_failed_load_is_undone_on_every_rank_and_raised():
    engine = _AsyncEngine(load_fails=True)
    with pytest.raises(ValueError, match="missing tensors"):
        _update(engine, "draft")
    assert engine.calls[-1] == "grpo_abort_weight_update"
    assert not any(c[0] == "finish_weight_update" for c in engine.calls if isinstance(c, tuple))


def test_a_session_a_dead_trainer_left_is_ended_and_a_live_one_s_named():
    stale = _AsyncEngine(session_open="stale")
    _update(stale, "policy")
    assert stale.calls[:3] == [
        "start_weight_update",
        "grpo_end_stale_weight_update",
        "start_weight_update",
    ]
    assert stale.calls[-1] == ("finish_weight_update", "3")
    live = _AsyncEngine(session_open="live")
    with pytest.raises(RuntimeError, match="held by live pid 7"):
        _update(live, "policy")
    assert not any(isinstance(c, tuple) for c in live.calls)  # nothing loaded


def test_an_overdue_swap_that_ends_leaves_another_still_overdue_refusing():
    """Served swaps queue on one lock, so a second can run past its deadline while the first
    still loads; the first one's end cleared the one flag both shared, and /health answered
    200 over an engine the second still held paused."""
    import asyncio
    from types import SimpleNamespace

    from vllm_plugin.weights.endpoint import _refusal, mark_overdue

    async def two_overdue_swaps():
        state = SimpleNamespace(grpo_mixed={}, grpo_stale_cache=None, grpo_overdue={})
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        mark_overdue(state, first, "swap 1 is overdue")
        mark_overdue(state, second, "swap 2 is overdue")
        both = _refusal(state)
        assert _refusal(state, overdue=False) is None  # the swap itself is not refused
        first.set_result(None)
        await asyncio.sleep(0)  # its done callbacks
        after_first = _refusal(state)
        second.set_result(None)
        await asyncio.sleep(0)
        return both, after_first, _refusal(state)

    assert asyncio.run(two_overdue_swaps()) == (
        "swap 1 is overdue; swap 2 is overdue",
        "swap 2 is overdue",
        None,
    )
