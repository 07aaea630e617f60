"""The policy learner over N ranks (torch.distributed: gloo on CPU, NCCL on CUDA), run by
torch's FSDP2 (`fully_shard`). With `policy.sharding: fsdp` each rank holds 1/N of the
parameters, gradients and AdamW state: a layer's parameters are gathered for its forward
and backward, its gradients reduce-scattered after each micro-batch. With `none` every
rank holds them all (FSDP2 over N replicas of one shard) and gradients are all-reduced
once per step.

Each rank takes a contiguous shard of the batch. The GRPO loss is a weighted sum over
micro-batches whose weights are shares of the whole batch, so the ranks' gradients are
summed, not averaged: that is the gradient one rank computes on the whole batch.
"""

from __future__ import annotations

import socket
import warnings
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from grpo_specdec.learner_state import configured_settings_kept

Sharding = Literal["none", "fsdp"]
# Whole state dicts, gathered to rank 0's CPU (the other ranks get empty ones); loaded
# from rank 0's and scattered, so that only rank 0 reads a checkpoint's files.
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


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
    before a collective; the job itself does not wait for it (a dead peer is seen by Ray
    at once)."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=address,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def distribute(model: torch.nn.Module, sharding: Sharding, device: torch.device) -> None:
    """Put `model` (a HF causal LM) on FSDP2 over the process group's ranks, in place: one
    unit per decoder layer, and one for the rest (embedding, final norm, lm_head)."""
    world = dist.get_world_size()
    if sharding == "fsdp":
        mesh = init_device_mesh(device.type, (world,))
    else:
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
    # The learner never changes a model's output in place, which is what this warns of.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has neither AVG nor PREMUL_SUM


def is_distributed(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank must ask, in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors` (its shards of distributed ones)."""
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


def max_over_ranks(n: int, device: torch.device) -> int:
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def all_reduce_sums(values: dict[str, float], keys: list[str], device: torch.device) -> dict:
    """`values` summed over the ranks, for `keys` (a key a rank lacks counts as 0)."""
    t = torch.tensor([values.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist(), strict=True))


# ---- whole state, in the layout of a one-rank checkpoint --------------------------------
# A checkpoint holds the whole model and torch's own optimiser state dict (parameters
# numbered in model.named_parameters() order), whatever the ranks that wrote it: a run
# resumes on any number of ranks, and checkpoints from before sharding still load.


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state dict, optimiser state dict), whole, on rank 0 (empty on the others)."""
    if not is_distributed(model):
        return model.state_dict(), opt.state_dict()
    weights = get_model_state_dict(model, options=_GATHER)
    by_name = get_optimizer_state_dict(model, opt, options=_GATHER)
    if not by_name:
        return weights, {}
    number = {name: i for i, name in enumerate(_names(model))}
    return weights, {
        "state": {number[name]: s for name, s in by_name["state"].items()},
        "param_groups": [
            {**g, "params": [number[name] for name in g["params"]]} for g in by_name["param_groups"]
        ],
    }


def load_full_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, weights: dict, opt_state: dict
) -> None:
    """Load what `full_state` gave; under ranks, rank 0's is scattered (the others pass {})."""
    if not is_distributed(model):
        model.load_state_dict(weights)
        with configured_settings_kept(opt):
            opt.load_state_dict(opt_state)
        return
    set_model_state_dict(model, weights, options=_SCATTER)
    if opt_state:
        names = _names(model)
        opt_state = {
            "state": {names[i]: s for i, s in opt_state["state"].items()},
            "param_groups": [
                {**g, "params": [names[i] for i in g["params"]]} for g in opt_state["param_groups"]
            ],
        }
    with configured_settings_kept(opt):
        set_optimizer_state_dict(model, opt, opt_state, options=_SCATTER)


def _names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]
