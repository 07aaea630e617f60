"""vLLM 0.32.0 and 0.33.0, several worker processes (tensor parallel, `MultiprocExecutor`):
after a collective RPC that failed on one rank, later RPCs read other calls' replies (0.33
reads every reply before raising only with `enable_fault_tolerance`, off by default).

`MultiprocExecutor.collective_rpc` reads one reply per worker, in rank order, and raises at
the first failure: the replies of the ranks after it stay in their queues, and the next
call reads them as its own. Seen with a weight update that failed on rank 0 of two: the
call that then took rank 1 back to its old weights returned rank 1's reply to the update,
and every call after it was one reply behind on rank 1 (its versions came back as the
answer to "are your weights mixed?").

The replacement counts the replies read from each worker's queue; when a blocking call
raises, it first reads the replies that call left unread (each worker answers every call
it is sent), then raises as before. Calls made with `non_block` are left as they are: their
replies are read later, by whoever resolves their futures.
"""

from __future__ import annotations

TARGET_VERSIONS = ("0.32.0", "0.33.0")
NEEDS_V1_RUNNER = False
DRAIN_TIMEOUT_S = 300.0  # for a reply the failed call left unread, when the call set none


def _count_reads(queue) -> None:
    if hasattr(queue, "_grpo_reads"):
        return
    dequeue = queue.dequeue
    queue._grpo_reads = 0

    def counted(*args, **kwargs):
        reply = dequeue(*args, **kwargs)
        queue._grpo_reads += 1
        return reply

    queue.dequeue = counted


def _replying(executor, unique_reply_rank, aggregated: bool) -> list:
    """The queues a blocking call reads: every worker's, or the one rank's it names."""
    if unique_reply_rank is None or aggregated:
        return list(executor.response_mqs)
    return [executor.response_mqs[unique_reply_rank]]


def _wrap(original):
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False,
                       unique_reply_rank=None, kv_output_aggregator=None,
                       ec_output_aggregator=None):  # fmt: skip
        call = (method, timeout, args, kwargs, non_block, unique_reply_rank)
        aggregators = {
            "kv_output_aggregator": kv_output_aggregator,
            "ec_output_aggregator": ec_output_aggregator,
        }
        if non_block or not getattr(self, "response_mqs", None):
            return original(self, *call, **aggregators)
        queues = _replying(self, unique_reply_rank, any(aggregators.values()))
        for queue in queues:
            _count_reads(queue)
        before = [queue._grpo_reads for queue in queues]
        try:
            return original(self, *call, **aggregators)
        except Exception:
            for queue, reads in zip(queues, before, strict=True):
                if queue._grpo_reads == reads:
                    try:
                        queue.dequeue(timeout=timeout or DRAIN_TIMEOUT_S)
                    except Exception:  # this worker gone or silent: the others still
                        continue  # have a reply to read
            raise

    collective_rpc._grpo_original = original
    return collective_rpc


def applies() -> bool:
    from vllm_plugin.patches import vllm_is

    return vllm_is(TARGET_VERSIONS)


def apply() -> bool:
    if not applies():
        return False
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if not hasattr(MultiprocExecutor.collective_rpc, "_grpo_original"):
        MultiprocExecutor.collective_rpc = _wrap(MultiprocExecutor.collective_rpc)
    return True
