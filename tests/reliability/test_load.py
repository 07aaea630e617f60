"""Many concurrent requests through the concurrency-aware plugin on the tiny models."""

from __future__ import annotations

import threading

import pytest

from grpo_specdec.engine import Engine, SamplingSettings
from grpo_specdec.tasks.arithmetic import make_problems
from tests.conftest import tiny_engine_config


def current_rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class RssPeak:
    """Peak resident memory of this process while the block runs, sampled from the
    current RSS by a thread (the lifetime peak, ru_maxrss, may have been set by an earlier
    test). A sample count, not a time window, tells when the thread has looked."""

    def __init__(self, every_s: float = 0.01):
        self.every_s = every_s
        self.samples = 0
        self._sampled = threading.Condition()
        self._done = threading.Event()

    def __enter__(self) -> RssPeak:
        self.before = self.peak = current_rss_mb()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            rss = current_rss_mb()
            with self._sampled:
                self.peak = max(self.peak, rss)
                self.samples += 1
                self._sampled.notify_all()
            self._done.wait(self.every_s)

    def wait_for_sample(self) -> None:
        """Return once the thread has read the RSS after this call began, however long the
        thread waits to be scheduled (the next sample may have been read before the call:
        wait for the one after it)."""
        with self._sampled:
            wanted = self.samples + 2
            while self.samples < wanted:
                if not self._thread.is_alive():
                    raise RuntimeError("the RSS sampling thread has stopped")
                self._sampled.wait(timeout=1.0)  # only to notice a dead thread

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_mb())

    @property
    def growth_mb(self) -> float:
        return self.peak - self.before


def test_rss_peak_sees_growth_below_an_earlier_peak():
    earlier = bytearray(300 << 20)  # sets the lifetime peak, then is given back
    del earlier
    with RssPeak() as rss:
        block = bytearray(150 << 20)
        rss.wait_for_sample()
        del block
    assert rss.growth_mb > 100


@pytest.mark.slow
def test_2048_requests_complete_losslessly_with_bounded_memory(
    tiny_target, tiny_draft, job_profile, plain_engine
):
    prompts = [
        p.question for lvl in (1, 2) for p in make_problems(128, seed=99, level=lvl)
    ]  # 256 prompts
    requests = [p for p in prompts for _ in range(8)]  # x 8 samples = 2048 requests
    sampling = SamplingSettings(max_tokens=24)
    engine = Engine(
        tiny_engine_config(
            tiny_target,
            max_num_seqs=256,
            kv_cache_gib=0.5,
            speculative={
                "draft": tiny_draft,
                "k": 4,
                "concurrency_aware": True,
                "controller": {"profile": job_profile},
            },
        )
    )
    try:
        with RssPeak() as rss:
            got = engine.generate(requests, sampling)
        trace = list(engine.scheduler().step_trace)
    finally:
        engine.shutdown()
    want = plain_engine.generate(requests, sampling)
    assert len(got.outputs) == 2048 and all(
        g[0].finish_reason in ("stop", "length") for g in got.outputs
    )
    assert [g[0].token_ids for g in got.outputs] == [g[0].token_ids for g in want.outputs]
    assert max(b for _, b, _, _ in trace) == 256  # the engine really ran at full concurrency
    print(f"peak RSS {rss.peak:.0f} MB (was {rss.before:.0f} MB before the 2048 requests)")
    assert rss.growth_mb < 1024  # bounded: the KV cache is preallocated, requests queue
