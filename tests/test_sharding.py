"""Policy ranks as plain processes (no Ray): two ranks, whole or sharded by FSDP2, take
the step one rank takes on the whole batch, whether both ranks hold sequences to learn
from or one rank's shard has none; a checkpoint written by two ranks resumes on one, and the reverse."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from grpo_specdec.engine import SpecCounters
from grpo_specdec.job.config import PolicySettings
from grpo_specdec.job.learners import PolicyBatch, PolicyLearner
from grpo_specdec.job.sharding import shard

# kl_coef > 0: the frozen reference model is put on the ranks too.
SETTINGS = dict(lr=1e-3, autocast="off", micro_batch=4, kl_coef=0.05)
# Summed gradients differ from one rank's only in the order of float additions (measured:
# weights within 1.1e-6 after a step at lr 1e-3 with both ranks learning, one element of
# 16384 above 2e-7: AdamW's first step divides a near-zero gradient by its own size). A
# rank-local token count in the loss moves weights by ~lr instead.
WEIGHT_ATOL = 5e-6


def _batch(seed: int = 0) -> PolicyBatch:
    """Rank 0 takes sequences 0..8 (3 micro-batches), rank 1 9..16 (2), of uneven lengths.
    Seed 0: both ranks hold sequences with reward variance (6 and 3, so a loss normalised
    by a rank's own token count would weigh them wrongly). Seed 1: only the first 8 have
    variance, so rank 1 trains nothing and contributes no gradient. Sampled at T = 0.8:
    every rank scales its logits alike."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, 40, (17,), generator=g).tolist()
    informative = [True] * 8 + [False] * 9
    if seed == 0:
        informative = [True] * 6 + [False] * 3 + [True] * 3 + [False] * 5
    return PolicyBatch(
        [torch.randint(0, 200, (n,), generator=g).tolist() for n in lengths],
        [6] * 17,
        torch.randn(17, generator=g).tolist(),
        informative,
        temperature=0.8,
    )


def _step(learner: PolicyLearner, seed: int = 0) -> dict:
    learner.prepare(_batch(seed))
    return learner.update().record()


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _memory(learner) -> dict[str, int]:
    """Bytes this rank holds of the policy's parameters, gradients and optimiser state, and
    the process's peak resident set."""
    import resource

    from grpo_specdec.job import sharding

    params = list(learner.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    opt = [t for s in learner.opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "params": sharding.local_bytes(params),
        "grads": sharding.local_bytes(grads),
        "optimizer": sharding.local_bytes(opt),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _rank(rank: int, address: str, target: str, out: str, settings: dict, plan: str) -> None:
    """`plan`: "step" (one step), "save" (one step, then a checkpoint), "resume" (load the
    checkpoint, then the second step)."""
    learner = PolicyLearner(target, PolicySettings(**settings))
    learner.join(address, rank, 2, timeout_s=120)
    if plan == "resume":
        learner.load(Path(out) / "ckpt")
    stats = _step(learner, seed=1 if plan == "resume" else 0)
    if plan == "save":
        learner.save(Path(out) / "ckpt")
    weights = learner.export_weights("float32")
    result = {"stats": stats, "memory": _memory(learner), "weights": weights}
    torch.save(result, f"{out}/rank{rank}.pt")
    learner.shutdown()


def _two_ranks(tmp_path, target: str, settings: dict, plan: str) -> list[dict]:
    mp.spawn(
        _rank,
        args=(_address(), target, str(tmp_path), settings, plan),
        nprocs=2,
        join=True,
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


def _state_bytes(memory: dict) -> int:
    return memory["params"] + memory["grads"] + memory["optimizer"]


def _assert_same_step(got: dict, expected: dict, weights: dict) -> None:
    for key in ("policy_sequences", "policy_steps"):
        assert got["stats"][key] == expected[key], key
    for key in ("policy_loss", "policy_kl", "policy_grad_norm"):
        assert got["stats"][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert got["weights"].keys() == weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.parametrize(
    "sharding, checkpointing", [("none", False), ("fsdp", False), ("fsdp", True)]
)
def test_two_ranks_take_the_single_rank_step(tiny_target, tmp_path, sharding, checkpointing):
    settings = SETTINGS | dict(sharding=sharding, activation_checkpointing=checkpointing)
    ranks = _two_ranks(tmp_path, tiny_target, settings, "step")
    single = PolicyLearner(tiny_target, PolicySettings(**SETTINGS))
    expected = _step(single)
    assert expected["policy_sequences"] == 9
    rank0, rank1 = ranks
    assert rank1["weights"] is None  # only rank 0 publishes
    _assert_same_step(rank0, expected, single.export_weights("float32"))
    assert rank1["stats"] == rank0["stats"]
    one = _state_bytes(_memory(single))
    per_rank = [_state_bytes(r["memory"]) for r in ranks]
    if sharding == "fsdp":
        assert max(per_rank) <= 0.6 * one, (per_rank, one)
    else:
        assert per_rank == [one, one]


@pytest.mark.parametrize("writers", [2, 1])
def test_a_checkpoint_resumes_on_another_number_of_ranks(tiny_target, tmp_path, writers):
    """Two steps, a checkpoint between them written by `writers` ranks and resumed by the
    other number: the weights and statistics of one rank that took both steps. The second
    step depends on AdamW's moments and step count, so they must come back too: without
    them it moves weights by ~lr, 100x the tolerance. (At lr 1e-3, AdamW's second step
    turned the ranks' float-order differences in one near-zero gradient into 5.6e-6.)"""
    single = SETTINGS | dict(lr=1e-4)
    settings = single | dict(sharding="fsdp")
    whole = PolicyLearner(tiny_target, PolicySettings(**single))
    _step(whole)
    expected = _step(whole, seed=1)
    if writers == 2:
        _two_ranks(tmp_path, tiny_target, settings, "save")
        # the layout one rank writes: a tied lm_head is not written as a tensor of its own
        saved = load_file(tmp_path / "ckpt" / "policy" / "model.safetensors")
        assert saved.keys() == whole.export_weights("float32").keys()
        resumed = PolicyLearner(tiny_target, PolicySettings(**single))
        resumed.load(tmp_path / "ckpt")
        got = {"stats": _step(resumed, seed=1), "weights": resumed.export_weights("float32")}
    else:
        writer = PolicyLearner(tiny_target, PolicySettings(**single))
        _step(writer)
        writer.save(tmp_path / "ckpt")
        got = _two_ranks(tmp_path, tiny_target, settings, "resume")[0]
    assert got["stats"]["policy_version"] == expected["policy_version"] == 2
    _assert_same_step(got, expected, whole.export_weights("float32"))


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
