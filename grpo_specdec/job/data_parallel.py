"""Data parallelism for the policy learner: N ranks, each with a contiguous shard of the
batch, gradients summed with torch.distributed (gloo on CPU, NCCL on CUDA).

The GRPO loss is a weighted sum over micro-batches whose weights are shares of the whole
batch, so summing the ranks' gradients gives the gradient one rank would compute on the
whole batch; every rank then takes the same optimiser step.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def shard(n: int, rank: int, world: int) -> range:
    """The contiguous part of range(n) that `rank` of `world` handles (sizes differ by ≤ 1)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def rendezvous_address(host: str) -> str:
    """A free TCP address on `host` (this process's node) for the ranks to meet at."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


def join(address: str, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
    """Join the process group. `timeout_s` bounds every collective: a rank whose peer died
    fails after it instead of waiting forever. It must outlast the slowest rank's work
    before a collective (a rank whose shard has nothing to learn from waits there for the
    others' forward and backward); the job itself does not wait for it (a dead peer is
    seen by Ray at once)."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=address,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the ranks, in one flat buffer. A parameter
    keeps no gradient only if no rank produced one (as on a single rank, the optimiser
    then leaves it alone)."""
    has_grad = torch.tensor(
        [p.grad is not None for p in params], dtype=torch.int32, device=params[0].device
    )
    dist.all_reduce(has_grad)
    kept = [p for p, n in zip(params, has_grad.tolist(), strict=True) if n]
    if not kept:
        return
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in kept]
    )
    dist.all_reduce(flat)
    offset = 0
    for p in kept:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()


def all_reduce_sums(values: dict[str, float], keys: list[str], device: torch.device) -> dict:
    """`values` summed over the ranks, for `keys` (a key a rank lacks counts as 0)."""
    t = torch.tensor([values.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist(), strict=True))


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
