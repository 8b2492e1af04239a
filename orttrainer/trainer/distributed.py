"""Distributed training on `torch.distributed`: which rank this is, how parameters are partitioned (ZeRO stage 1),
and how gradients and weights travel between ranks.

Rank and world size come from `distributed.world_rank/world_size/local_rank` or, when those are left at their
defaults, from the `torchrun` environment (RANK, WORLD_SIZE, LOCAL_RANK). The trainer initialises the default process
group (Gloo on CPU, NCCL on CUDA) when the user has not; an existing group must agree with the options.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int


def resolve_context(options, device_type: str) -> DistributedContext | None:
    """The distributed context for these options, initialising the process group if needed; None for one process."""
    opts = options.distributed
    env_size, env_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    env_local = int(os.environ.get("LOCAL_RANK", "0"))
    if opts.world_size == 1 and opts.world_rank == 0 and env_size > 1:
        context = DistributedContext(env_rank, env_size, env_local)
    else:
        context = DistributedContext(opts.world_rank, opts.world_size, opts.local_rank)
    if context.world_size == 1:
        if opts.world_rank != 0:
            raise ValueError(f"options distributed.world_rank={opts.world_rank} needs distributed.world_size > 1")
        return None
    if not 0 <= context.rank < context.world_size:
        raise ValueError(f"options distributed.world_rank={context.rank} is outside world_size={context.world_size}")
    _init_process_group(context, device_type)
    return context


def _init_process_group(context: DistributedContext, device_type: str) -> None:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise RuntimeError(
                "torch.distributed is not initialised and MASTER_PORT is not set: launch with "
                "torchrun, or call torch.distributed.init_process_group first"
            )
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", rank=context.rank, world_size=context.world_size
        )
    if dist.get_world_size() != context.world_size or dist.get_rank() != context.rank:
        raise ValueError(
            f"options distributed.world_rank={context.rank}, world_size={context.world_size} do not "
            f"match the torch.distributed process group (rank {dist.get_rank()} of "
            f"{dist.get_world_size()})"
        )


StateSignature = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype) of every state tensor, in order


def check_ranks_agree(signature: StateSignature, rank: int, world_size: int) -> None:
    """Every rank must hold the same state tensors: names, shapes and dtypes. Rule: the signatures are gathered
    (one small collective, pickled lists), so every rank sees every difference and raises the same error naming
    the first one — instead of Gloo aborting the process on mismatched tensor sizes later."""
    gathered: list[StateSignature | None] = [None] * world_size
    dist.all_gather_object(gathered, signature)
    reference = gathered[0] or []
    for other, theirs in enumerate(gathered[1:], start=1):
        difference = _first_difference(reference, theirs or [])
        if difference:
            raise RuntimeError(
                f"rank {other}'s model differs from rank 0's: {difference}. Every rank of a data-parallel run must "
                f"build the same model (this is rank {rank})"
            )


def _first_difference(mine: StateSignature, theirs: StateSignature) -> str | None:
    for (name, shape, dtype), (other_name, other_shape, other_dtype) in zip(mine, theirs, strict=False):
        if name != other_name:
            return f"state tensor {name!r} on rank 0 is {other_name!r} there"
        if (shape, dtype) != (other_shape, other_dtype):
            return f"{name!r} is {list(shape)} {dtype} on rank 0 but {list(other_shape)} {other_dtype} there"
    if len(mine) != len(theirs):
        extra = (mine if len(mine) > len(theirs) else theirs)[min(len(mine), len(theirs))][0]
        return f"rank 0 has {len(mine)} state tensors, that rank {len(theirs)} (the first unmatched is {extra!r})"
    return None


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank receives rank 0's values of `tensors` (same shapes and dtypes on every rank: check_ranks_agree),
    one broadcast per dtype. Why: data parallelism must start from one set of weights, as DistributedDataParallel
    does; ranks seeded differently would otherwise train different models."""
    result = list(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        dist.broadcast(flat, src=0)
        for i, piece in zip(indices, _split_like(flat, [tensors[i] for i in indices]), strict=True):
            result[i] = piece
    return result


def partition_parameters(shapes: dict[str, tuple[int, ...]], world_size: int) -> dict[str, int]:
    """ZeRO stage 1: each trainable tensor is owned by one rank. Largest first, each goes to the rank holding the
    fewest elements so far (ties: the lowest rank), which balances optimizer memory to about 1/world_size."""
    load = [0] * world_size
    owner: dict[str, int] = {}
    for name in sorted(shapes, key=lambda n: (-math.prod(shapes[n]), n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += math.prod(shapes[name])
    return {name: owner[name] for name in shapes}


@dataclass
class Communicator:
    """The collectives a data-parallel step uses, on flat buckets; `calls` counts collective calls by kind."""

    world_size: int
    calls: dict[str, int] = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0, "broadcast": 0})

    def sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Element-wise sum over ranks, one all_reduce for all tensors."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        self.calls["all_reduce"] += 1
        return _split_like(flat, tensors)

    def adasum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Adasum per tensor over ranks: pairwise `(1 - g1·g2 / (2‖g1‖²))·g1 + (1 - g1·g2 / (2‖g2‖²))·g2`, applied
        recursively (ranks 0+1, 2+3, then the pairs' results). The world size must be a power of two."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(gathered, flat)
        self.calls["all_gather"] += 1
        parts = [_split_like(g, tensors) for g in gathered]
        while len(parts) > 1:
            parts = [
                [adasum_pair(a, b) for a, b in zip(parts[i], parts[i + 1], strict=True)]
                for i in range(0, len(parts), 2)
            ]
        return parts[0]

    def share(self, tensors_by_owner: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """Every rank receives each rank's tensors (ZeRO: the weights each owner updated), one broadcast per rank."""
        shared: dict[int, list[torch.Tensor]] = {}
        for owner in range(self.world_size):
            tensors = tensors_by_owner[owner]
            if not tensors:
                shared[owner] = []
                continue
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=owner)
            self.calls["broadcast"] += 1
            shared[owner] = _split_like(flat, tensors)
        return shared


def adasum_pair(g1: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
    """The Adasum rule for two gradients (dot products in float64); a zero gradient contributes nothing."""
    a, b = g1.double(), g2.double()
    dot, n1, n2 = (a * b).sum(), (a * a).sum(), (b * b).sum()
    c1 = 1 - dot / (2 * n1) if n1 > 0 else torch.zeros((), dtype=torch.float64)
    c2 = 1 - dot / (2 * n2) if n2 > 0 else torch.zeros((), dtype=torch.float64)
    return (c1 * a + c2 * b).to(g1.dtype)


def check_adasum_world_size(world_size: int) -> None:
    if world_size & (world_size - 1):
        raise ValueError(f"options distributed.enable_adasum needs a power-of-two world size, got {world_size}")


def _split_like(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    pieces, offset = [], 0
    for t in like:
        pieces.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return pieces
