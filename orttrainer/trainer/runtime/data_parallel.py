"""DataParallelSession: one rank of data-parallel training, on two ONNX Runtime sessions and torch.distributed.

Per step: the gradient-step graph computes this rank's gradients; they are combined across ranks (sum, or Adasum);
the optimizer graph updates the weights with the combined gradients. The combination happens once per optimizer
step on the accumulated gradients (`allreduce_post_accumulation=True`, accumulated in the graph) or after every
micro-step (False; the reduced gradients are accumulated here). Both give the same sum, so the same numbers.

ZeRO stage 1: each rank's optimizer graph updates only the tensors it owns and holds only their moments; after a
finite step the owners broadcast their updated weights, so every rank keeps full weights.

Torch gradient builder: the gradient-step graph depends on the input shapes, so `step_for` gives one per shape
signature (`GraphRunners`); the optimizer graph does not.

With `update="torch"` (update/path.py) there is no optimizer graph: `TorchOptimizer` updates the state in place
from the combined gradients (update/torch_fused.py), with the same semantics.

Buffers the forward updates (BatchNorm's running statistics) follow each rank's own batches, as PyTorch's
DistributedDataParallel does with `broadcast_buffers=False`: every rank starts from rank 0's values, and a checkpoint
holds the values of the rank that saved it.

Ranks (`resolve_context`): rank and world size come from `distributed.world_rank/world_size/local_rank` or, when
those are left at their defaults, from the `torchrun` environment (RANK, WORLD_SIZE, LOCAL_RANK). The trainer
initialises the default process group (Gloo on CPU, NCCL on CUDA) when the user has not; an existing group must
agree with the options. Ranks check that they built the same model, then take rank 0's initial weights
(`start_from_rank0`). ZeRO stage 1 partitions the parameters (`partition_parameters`); gradients and weights travel
through `Communicator`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from ..compile.compiler import CompiledModel
from ..compile.contract import DataParallelGraphs, GradientStepGraph, accumulation_buffer_name
from ..state import AccumulationWindow, DropoutStreams
from ..update.torch_fused import TorchOptimizer
from .session import EvalGraphs, GraphRunners, SessionBase, SessionConfig, from_torch, to_torch_view


class DataParallelSession(SessionBase):
    """One rank's sessions: the gradient-step graph(s), the optimizer graph and the eval graph (module docstring)."""

    def __init__(
        self,
        compiled: CompiledModel,
        state: dict[str, np.ndarray],
        config: SessionConfig,
        comm: Communicator,
        *,
        window: AccumulationWindow,
        adasum: bool,
        owners: dict[str, int] | None,
        rank: int,
        streams: DropoutStreams,
        eval_for: EvalGraphs | None = None,
    ) -> None:
        super().__init__(compiled.eval_model, state, config, streams, eval_for, compiled.step_graph.data_inputs)
        assert compiled.step is not None and compiled.reduced_inputs is not None  # compiled for data parallelism
        graphs = DataParallelGraphs(compiled.step, compiled.training, compiled.reduced_inputs)
        self.graphs, self.graph = graphs, graphs.optimizer
        self.comm = comm
        step_for = cast(Callable[[Sequence[torch.Tensor]], GradientStepGraph] | None, compiled.graph_for)
        self._runners = GraphRunners(
            self._session, graphs.step, step_for, "", streams, self._specializer(graphs.step), compiled.graph_key
        )
        update = graphs.optimizer.outside_update
        self._optimizer = TorchOptimizer(update, self.state_view) if update is not None else None
        self._train = None if update is not None else self._session(graphs.optimizer.model, config.optimized_model_path)
        self._train_inputs = {i.name for i in self._train.get_inputs()} if self._train is not None else set()
        self._accumulating = window.accumulates
        self._adasum, self._owners, self._rank = adasum, owners, rank
        self._buffers = {p: accumulation_buffer_name(p) for p in graphs.step.gradients} if self._accumulating else {}
        self._zeros = {name: self._to_device(np.zeros_like(state[name])) for name in graphs.step.accumulation}

    def train(
        self,
        data: dict[str, torch.Tensor],
        lr: float,
        update_count: int,
        outputs: list[str],
        optimizer_step: bool,
        loss_scale: float | None = None,
    ) -> tuple[dict[str, torch.Tensor], bool]:
        runner = self._runners.for_data(data)
        step = runner.graph
        feeds = self._feeds(data, runner.inputs)
        if step.loss_scale_input:
            feeds[step.loss_scale_input] = self._host_scalar(np.float32(loss_scale))
        in_graph = bool(step.accumulation)
        buffers = list(step.buffer_updates.values())  # each rank's own BatchNorm statistics (module docstring)
        if in_graph and not optimizer_step:  # accumulate locally; nothing to communicate yet
            fetched = self._run_training(runner, feeds, outputs + list(step.accumulation.values()) + buffers)
            self._state.update(zip([*step.accumulation, *step.buffer_updates], fetched[len(outputs) :], strict=True))
            return self._results(outputs, fetched), True
        names = list(step.gradients)
        fetched = self._run_training(runner, feeds, outputs + [step.gradients[p] for p in names] + buffers)
        self._state.update(zip(step.buffer_updates, fetched[len(outputs) + len(names) :], strict=True))
        combined = self._combine([to_torch_view(v) for v in fetched[len(outputs) : len(outputs) + len(names)]])
        if self._accumulating and not in_graph:
            buffers = [to_torch_view(self._state[self._buffers[p]]) for p in names]
            for buffer, grad in zip(buffers, combined, strict=True):
                buffer.add_(grad)  # the state's own memory: accumulates in place
            if not optimizer_step:
                return self._results(outputs, fetched), True
            combined = buffers
        finite = self._optimize(dict(zip(names, combined, strict=True)), lr, update_count, loss_scale)
        if in_graph:
            self._state.update(self._zeros)  # graph inputs only: the shared zeros are never written
        else:
            for name in self._buffers.values():  # accumulated here, in place: clear in place too
                to_torch_view(self._state[name]).zero_()
        return self._results(outputs, fetched), finite

    @property
    def train_session(self) -> Any:
        """The optimizer graph's onnxruntime.InferenceSession (without one: the last gradient-step graph's)."""
        if self._train is None:
            return self._runners.latest.session if self._runners.latest is not None else None
        return self._train

    def _combine(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.comm.adasum(grads) if self._adasum else self.comm.sum(grads)

    def _optimize(self, grads: dict[str, torch.Tensor], lr: float, update_count: int, loss_scale: float | None) -> bool:
        if self._optimizer is not None:
            finite = self._optimizer.step(grads, lr, update_count, loss_scale)
            if finite and self._owners is not None:
                self._share_weights()
            return finite
        g = self.graph
        feeds = {name: self._state[name] for name in self._train_inputs if name in self._state}
        feeds.update(
            {
                self.graphs.reduced_inputs[p]: from_torch(t)
                for p, t in grads.items()
                if self.graphs.reduced_inputs[p] in self._train_inputs
            }
        )
        feeds.update(self._step_feeds(g, self._train_inputs, lr, update_count))
        if g.loss_scale_input:
            feeds[g.loss_scale_input] = self._host_scalar(np.float32(loss_scale))
        state_outputs = {**g.weight_updates, **g.optimizer_state}
        checks = [g.all_finite_output] if g.all_finite_output else []
        fetched = self._run(self._train, feeds, list(state_outputs.values()) + checks)
        finite = bool(fetched[-1].numpy().all()) if checks else True  # the same on every rank: same reduced grads
        if finite:
            self._state.update(zip(state_outputs, fetched[: len(state_outputs)], strict=True))
            if self._owners is not None:
                self._share_weights()
        return finite

    def _share_weights(self) -> None:
        """ZeRO: every rank receives the weights their owners just updated."""
        by_owner: dict[int, list[str]] = {r: [] for r in range(self.comm.world_size)}
        for name, owner in (self._owners or {}).items():
            by_owner[owner].append(name)
        tensors = {
            r: [
                to_torch_view(self._state[n]).clone()
                if r == self._rank
                else torch.empty_like(to_torch_view(self._state[n]))
                for n in names
            ]
            for r, names in by_owner.items()
        }
        shared = self.comm.share(tensors)
        for r, names in by_owner.items():
            if r != self._rank:
                self._state.update({n: from_torch(t.contiguous()) for n, t in zip(names, shared[r], strict=True)})

    def _results(self, outputs: list[str], fetched: list) -> dict[str, torch.Tensor]:
        return {name: self._to_torch(value) for name, value in zip(outputs, fetched, strict=False)}


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


def start_from_rank0(session: SessionBase, names: list[str], rank: int, world_size: int) -> None:
    """Ranks check that they built the same model (same state names, shapes and dtypes), then take rank 0's
    initial weights."""
    values = session.get_state(names)
    signature = [(n, tuple(values[n].shape), str(values[n].dtype)) for n in names]
    check_ranks_agree(signature, rank, world_size)
    received = broadcast_from_rank0([torch.from_numpy(values[n]) for n in names])
    if rank != 0:
        session.set_state({n: t.numpy() for n, t in zip(names, received, strict=True)})


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
