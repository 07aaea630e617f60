"""Data-parallel policy ranks as plain processes (no Ray): two ranks take the step one
rank takes on the whole batch, even when one rank's shard has nothing to learn from."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from grpo_specdec.engine import SpecCounters
from grpo_specdec.job.config import PolicySettings
from grpo_specdec.job.data_parallel import shard
from grpo_specdec.job.roles import PolicyBatch, PolicyLearner

SETTINGS = PolicySettings(lr=1e-3, autocast="off", micro_batch=4)


def _batch() -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(12, 40, (16,), generator=g).tolist()
    # Groups of 4; only the first two have reward variance, so the second rank's shard
    # (sequences 8..15) trains nothing and contributes no gradient of its own.
    return PolicyBatch(
        [torch.randint(0, 200, (n,), generator=g).tolist() for n in lengths],
        [6] * 16,
        torch.randn(16, generator=g).tolist(),
        [True] * 8 + [False] * 8,
    )


def _rank(rank: int, address: str, target: str, out: str) -> None:
    learner = PolicyLearner(target, SETTINGS)
    learner.join(address, rank, 2, timeout_s=60)
    learner.prepare(_batch())
    stats = learner.update()
    torch.save({"stats": stats, "weights": learner.model.state_dict()}, f"{out}/rank{rank}.pt")
    learner.shutdown()


def test_two_ranks_take_the_single_rank_step(tiny_target, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(_rank, args=(address, tiny_target, str(tmp_path)), nprocs=2, join=True)
    single = PolicyLearner(tiny_target, SETTINGS)
    single.prepare(_batch())
    expected = single.update()
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for got in ranks:
        assert got["stats"]["policy_sequences"] == expected["policy_sequences"] == 8
        for key in ("policy_loss", "policy_grad_norm"):
            assert got["stats"][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        for name, w in single.model.state_dict().items():
            torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=1e-6)


def test_shards_cover_the_batch_in_order():
    for n in range(0, 20):
        for world in (1, 2, 3, 5):
            parts = [shard(n, r, world) for r in range(world)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_engines_counters_combine_into_one_engines():
    g = torch.Generator().manual_seed(0)
    steps = [
        (int(d), int(torch.randint(0, int(d) + 1, (1,), generator=g)))
        for d in torch.randint(0, 5, (200,), generator=g)
    ]
    whole, parts = SpecCounters(), [SpecCounters(), SpecCounters(), SpecCounters()]
    for i, (drafted, accepted) in enumerate(steps):
        whole.observe(drafted, accepted)
        parts[i % 3].observe(drafted, accepted)
    assert SpecCounters.combined([p.metrics() for p in parts]) == whole.metrics()
