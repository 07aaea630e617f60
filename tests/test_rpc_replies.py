"""`vllm_plugin/patches/fixes/rpc_replies_v0_32.py` on stand-ins for vLLM's executor and its
per-worker reply queues: after a call that failed on one rank, every other rank's unread
reply is read, even past a rank that never answers, so the next call reads its own."""

from __future__ import annotations

import queue

import pytest

from vllm_plugin.patches.fixes.rpc_replies_v0_32 import _wrap


class _Queue:
    def __init__(self, replies=()):
        self.items = queue.Queue()
        for reply in replies:
            self.items.put(reply)

    def dequeue(self, timeout=None):
        return self.items.get(timeout=0.05)  # a worker that never answers: queue.Empty


class _Executor:
    """Reads rank 0's reply and raises on it, as vLLM's collective_rpc does, leaving the
    other ranks' replies unread."""

    def __init__(self, queues):
        self.response_mqs = queues

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False,
                       unique_reply_rank=None, kv_output_aggregator=None,
                       ec_output_aggregator=None):  # fmt: skip
        reply = self.response_mqs[0].dequeue()
        if reply == "failed":
            raise RuntimeError("rank 0 failed")
        return [reply] + [q.dequeue() for q in self.response_mqs[1:]]


def test_every_rank_s_unread_reply_is_read_past_a_silent_one():
    silent, answering = _Queue(), _Queue(["rank 2's reply to the update"])
    executor = _Executor([_Queue(["failed", "rank 0: versions"]), silent, answering])
    call = _wrap(_Executor.collective_rpc)
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        call(executor, "update_weights", timeout=0.05)
    assert answering.items.empty()  # drained, though rank 1 before it never answered
    silent.items.put("rank 1: versions")
    answering.items.put("rank 2: versions")
    assert call(executor, "versions") == [
        "rank 0: versions",
        "rank 1: versions",
        "rank 2: versions",
    ]
