"""DataParallelSession: one rank of data-parallel training, on two ONNX Runtime sessions and torch.distributed.

Per step: the gradient-step graph computes this rank's gradients; they are combined across ranks (sum, or Adasum);
the optimizer graph updates the weights with the combined gradients. The combination happens once per optimizer
step on the accumulated gradients (`allreduce_post_accumulation=True`, accumulated in the graph) or after every
micro-step (False; the reduced gradients are accumulated here). Both give the same sum, so the same numbers.

ZeRO stage 1: each rank's optimizer graph updates only the tensors it owns and holds only their moments; after a
finite step the owners broadcast their updated weights, so every rank keeps full weights.

Torch gradient builder: the gradient-step graph depends on the input shapes, so `step_for` gives one per shape
signature (`GraphRunners`); the optimizer graph does not.

With `update="torch"` (update_path.py) there is no optimizer graph: `TorchOptimizer` updates the state in place
from the combined gradients (torch_optimizer.py), with the same semantics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import torch

from .distributed import Communicator
from .graph.data_parallel import DataParallelGraphs, GradientStepGraph
from .graph_runners import EvalGraphs, GraphRunners
from .rng import DropoutStreams
from .session import SessionBase, SessionConfig, from_torch, to_torch_view
from .torch_optimizer import TorchOptimizer


class DataParallelSession(SessionBase):
    """One rank's sessions: the gradient-step graph(s), the optimizer graph and the eval graph (module docstring)."""

    def __init__(
        self,
        graphs: DataParallelGraphs,
        eval_model: onnx.ModelProto,
        state: dict[str, np.ndarray],
        config: SessionConfig,
        comm: Communicator,
        *,
        accumulation_steps: int,
        adasum: bool,
        owners: dict[str, int] | None,
        rank: int,
        streams: DropoutStreams,
        step_for: Callable[[Sequence[torch.Tensor]], GradientStepGraph] | None = None,
        eval_for: EvalGraphs | None = None,
    ) -> None:
        super().__init__(eval_model, state, config, streams, eval_for)
        self.graphs, self.graph = graphs, graphs.optimizer
        self.comm = comm
        self._runners = GraphRunners(self._session, graphs.step, step_for, "", streams, self._specializer(graphs.step))
        update = graphs.optimizer.outside_update
        self._optimizer = TorchOptimizer(update, self.state_view) if update is not None else None
        self._train = None if update is not None else self._session(graphs.optimizer.model, config.optimized_model_path)
        self._train_inputs = {i.name for i in self._train.get_inputs()} if self._train is not None else set()
        self._accumulating = accumulation_steps > 1
        self._adasum, self._owners, self._rank = adasum, owners, rank
        self._buffers = [f"{p}_grad_accumulation_buffer" for p in graphs.step.gradients] if self._accumulating else []
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
        if in_graph and not optimizer_step:  # accumulate locally; nothing to communicate yet
            fetched = self._run_training(runner, feeds, outputs + list(step.accumulation.values()))
            self._state.update(zip(step.accumulation, fetched[len(outputs) :], strict=True))
            return self._results(outputs, fetched), True
        names = list(step.gradients)
        fetched = self._run_training(runner, feeds, outputs + [step.gradients[p] for p in names])
        combined = self._combine([to_torch_view(v) for v in fetched[len(outputs) :]])
        if self._accumulating and not in_graph:
            buffers = [to_torch_view(self._state[f"{p}_grad_accumulation_buffer"]) for p in names]
            for buffer, grad in zip(buffers, combined, strict=True):
                buffer.add_(grad)  # the state's own memory: accumulates in place
            if not optimizer_step:
                return self._results(outputs, fetched), True
            combined = buffers
        finite = self._optimize(dict(zip(names, combined, strict=True)), lr, update_count, loss_scale)
        if in_graph:
            self._state.update(self._zeros)  # graph inputs only: the shared zeros are never written
        else:
            for name in self._buffers:  # accumulated here, in place: clear in place too
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
