"""Activation statistics on the ONNX Runtime path: `orttrainer.debug` subscribers for models run by ORTTrainer.

A PyTorch model subscribed with `GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(...)])` (or using
`inspect_activation` in its forward) writes the same files, in the same format and order, whether it runs in
PyTorch or in ORTTrainer. How, in the trainer:

1. Export (`ActivationStatistics.marking`): when a manager is subscribed to the model, a private manager marks every
   module output and `inspect_activation` tensor with `_Mark` (an identity whose ONNX symbolic is the marker op of
   `graph/statistics.py`), named exactly as `StatisticsSubscriber` names them. The export runs inside
   `no_increase_global_step()`: it counts no step and writes no file.
2. `prepare`: the markers become Identity nodes (`marks_to_identity`), and `trace_activations` runs the model once
   in PyTorch (forward + backward of the trainer's loss, no side effects) for the dump order: forward in hook
   order, backward in autograd order.
3. `instrument`: the statistics of each marked tensor, and of its gradient `<tensor>_grad`, become small extra
   outputs of the training graph; forward statistics also of the eval graph (`append_statistics`).
4. Each step (`begin_step`/`end_step`): when a `StatisticsSubscriber` of a live manager subscribed to the model has
   the manager's current step in its range, the statistics outputs are fetched too and written with
   `StatisticsSubscriber.dump` in the traced order. Otherwise nothing extra is fetched, so nothing extra runs.

With the torch gradient builder (`prepare_traced`), steps 1-3 happen in the trace instead: while AOTAutograd
traces the training graph (and torch.export the eval graph), a private manager marks each activation with
`activation_mark` (gradient/torch_private/custom_ops.py), whose gradient marks the activation's gradient, so the
exported graph carries a marker for every forward activation and every gradient; `instrument` makes them Identity
nodes (`directed_marks_to_identity`) and appends the same statistics outputs. The files are the same: names,
depths, order (from the same PyTorch trace) and format.

Steps: a `train_step` is one step (one forward and its backward) and an `eval_step` one step (forward files only),
as one completed root forward is in PyTorch; the trainer moves the subscribed managers' counters itself
(`SubscriberManager.advance_step`). A model subscribed only after the graph was compiled gets its steps counted but
no statistics (a warning says so). Only `StatisticsSubscriber`s are served: other subscribers run Python on PyTorch
tensors, which the trainer does not have (a warning names them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import onnx
import torch

from ..debug import StatisticsSubscriber, TensorStatistics, trace_activations
from ..debug.statistics import to_torch_dtype
from ..debug.subscriber import SubscriberManager, exclusive, managers_of, no_increase_global_step
from ..debug.trace import ActivationRecord, RecordingSubscriber
from .gradient.torch_private.custom_ops import activation_mark
from .graph.editor import graph_value_names, tensor_elem_type
from .graph.statistics import (
    MARK_ATTRIBUTE,
    MARK_DOMAIN,
    MARK_OP,
    StatisticsOutputs,
    StatisticsTarget,
    append_statistics,
    decode_statistics,
    directed_marks_to_identity,
    gradient_tensor,
    marks_to_identity,
)


class _Mark(torch.autograd.Function):
    """Identity in PyTorch; in the ONNX export, the marker op carrying the activation name."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor.detach()  # an alias, as the debug taps return (in-place ops after it stay legal)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None

    @staticmethod
    def symbolic(g, tensor, name: str):
        marked = g.op(f"{MARK_DOMAIN}::{MARK_OP}", tensor, **{f"{MARK_ATTRIBUTE}_s": name})
        marked.setType(tensor.type())
        return marked


class MarkingSubscriber(RecordingSubscriber):
    """Marks each activation a `StatisticsSubscriber` would dump (`RecordingSubscriber`'s names) for the export."""

    def _tap(self, name: str, depth: int, details: dict[str, Any], tensor: torch.Tensor) -> torch.Tensor:
        return _Mark.apply(tensor, name)


class TraceMarkingSubscriber(RecordingSubscriber):
    """Marks each activation, and through its gradient the activation's gradient, for the torch builder's traces."""

    def _tap(self, name: str, depth: int, details: dict[str, Any], tensor: torch.Tensor) -> torch.Tensor:
        return activation_mark(tensor, name, False)


@dataclasses.dataclass(frozen=True)
class _Dump:
    """One file per collected step: the record's name, direction and depth, and the graph outputs to read."""

    name: str
    direction: str
    depth: int
    dtype: torch.dtype
    outputs: StatisticsOutputs


class ActivationStatistics:
    """The trainer's side of `orttrainer.debug` for one model (`None` for an ONNX model: nothing to do)."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.model = model  # the PyTorch model the subscribers watch (debug.subscriber.WATCHED)
        self._marked = False  # the last export ran with markers
        self._marks: dict[str, str] = {}  # activation name -> marked tensor
        self._order: list[ActivationRecord] | None = None  # None: the graph carries no marks
        self._dumps: dict[str, list[_Dump]] = {"train": [], "eval": []}
        self._pending: list[tuple[SubscriberManager, int, list[StatisticsSubscriber]]] = []
        self._kind = "train"
        self._warned_late = False
        self._traced = False  # the torch builder marks in its traces (prepare_traced)

    @property
    def subscribed(self) -> bool:
        """Whether a manager is subscribed to the model now (its statistics need the 'ort' gradient builder)."""
        return self.model is not None and bool(managers_of(self.model))

    @property
    def marked(self) -> bool:
        """Whether the last export marked activations (a manager is subscribed to the model)."""
        return self._marked

    @property
    def instrumented(self) -> bool:
        """Whether the graphs compiled from the last export get activation statistics (it marked activations)."""
        return self._order is not None

    @contextlib.contextmanager
    def marking(self) -> Iterator[None]:
        """Context for the export: no step counted and no file written; activations marked when subscribed."""
        with no_increase_global_step():
            if self.model is None or not managers_of(self.model):
                yield
                return
            _warn_unserved(self.model)
            manager = SubscriberManager()
            with exclusive(manager):
                manager.subscribe(self.model, [MarkingSubscriber()])
                try:
                    yield
                finally:
                    manager.unsubscribe()
            self._marked = True

    def prepare(self, model: onnx.ModelProto, loss_fn, model_desc, inputs: list) -> onnx.ModelProto:
        """The exported model with its markers made Identity nodes; traces the dump order when it has marks."""
        if not self._marked or self.model is None:
            return model
        model, marks = marks_to_identity(model)
        self._marks = dict(marks)
        self._order = trace_order(self.model, loss_fn, model_desc, inputs)
        return model

    def prepare_traced(self, loss_fn, model_desc, inputs: list) -> Callable[[], AbstractContextManager] | None:
        """For the torch builder: None when no manager is subscribed to the model; otherwise traces the dump order
        and returns the context in which a trace marks the activations (`trace_marking`)."""
        if self.model is None or not managers_of(self.model):
            return None
        _warn_unserved(self.model)
        self._order = trace_order(self.model, loss_fn, model_desc, inputs)
        self._marked = self._traced = True
        return self.trace_marking

    @contextlib.contextmanager
    def trace_marking(self) -> Iterator[None]:
        """Within the block, a forward of the model marks each activation (`TraceMarkingSubscriber`) and no other
        manager acts; a fresh manager each time, so each trace names the activations as one PyTorch step does."""
        assert self.model is not None  # prepare_traced returned this context for a model
        manager = SubscriberManager()
        with exclusive(manager):
            manager.subscribe(self.model, [TraceMarkingSubscriber()])
            try:
                yield
            finally:
                manager.unsubscribe()

    def instrument(self, model: onnx.ModelProto, kind: str) -> onnx.ModelProto:
        """A pass: `model` with the statistics outputs appended. `kind` 'train': the gradient model (forward
        activations and their gradients; a tensor the graph lacks is named in a warning); 'eval': the eval model
        (forward activations only)."""
        if self._order is None:
            return model
        traced: dict[tuple[str, str], str] = {}
        if self._traced:
            model, found = directed_marks_to_identity(model)
            traced = {(activation, direction): tensor for activation, direction, tensor in found}
        names, targets, records, lost = graph_value_names(model.graph), {}, {}, []
        for record in self._order:
            if kind == "eval" and record.direction != "forward":
                continue
            if self._traced:
                tensor = traced.get((record.name, record.direction))
            else:
                tensor = self._marks.get(record.name)
                if tensor is not None and record.direction == "backward":
                    tensor = gradient_tensor(model, tensor)
            if tensor is None or tensor not in names:
                lost.append(record.file_name)
                continue
            targets[record.file_name] = StatisticsTarget(tensor, _elem_type(model, tensor))
            records[record.file_name] = record
        if lost and kind == "train":
            warnings.warn(
                f"ORTTrainer cannot collect statistics for {lost}: the exported graph has no such tensor "
                "or no gradient for it (e.g. unused outputs, or log-probabilities fused into "
                "SoftmaxCrossEntropyLoss); those files are missing from its dumps",
                stacklevel=2,
            )
        model, outputs = append_statistics(model, targets)
        # The graph's element type (float16 under mixed precision), else PyTorch's from the trace.
        self._dumps[kind] = [
            _Dump(r.name, r.direction, r.depth, _torch_dtype(targets[f].elem_type, r.dtype), outputs[f])
            for f, r in records.items()
            if f in outputs
        ]
        return model

    def begin_step(self, kind: str) -> list[str]:
        """Graph outputs to fetch in this `train`/`eval` step (none unless a subscriber collects this step)."""
        self._pending, self._kind = [], kind
        if self.model is None:
            return []
        managers = [m for m in managers_of(self.model) if m.is_live()]
        if not managers:
            return []
        if self._order is None and not self._warned_late:
            self._warned_late = True
            warnings.warn(
                f"{type(self.model).__name__} was subscribed after ORTTrainer compiled its graph: steps "
                "are counted but no activation statistics are collected. Subscribe before the first "
                "train_step/eval_step.",
                stacklevel=3,
            )
        for manager in managers:
            step = manager.get_run_context().global_states.execution_step
            collecting = [s for s in manager.subscribers if isinstance(s, StatisticsSubscriber) and s.in_range(step)]
            self._pending.append((manager, step, collecting if self._order is not None else []))
        if any(collecting for _, _, collecting in self._pending):
            return [name for dump in self._dumps[kind] for name in dump.outputs.names]
        return []

    def end_step(self, results: dict[str, Any]) -> None:
        """Write this step's files from the fetched `results`, then count the step for each subscribed manager."""
        pending, self._pending = self._pending, []
        decoded: dict[str, TensorStatistics] = {}
        for manager, step, collecting in pending:
            for dump in self._dumps[self._kind] if collecting else []:
                key = dump.outputs.values
                if key not in decoded:
                    decoded[key] = decode_statistics(*(results[n] for n in dump.outputs.names), dtype=dump.dtype)
                for subscriber in collecting:
                    subscriber.dump(step, dump.name, dump.direction, decoded[key], dump.depth)
            manager.advance_step()


def trace_order(model: torch.nn.Module, loss_fn, model_desc, inputs: list) -> list[ActivationRecord]:
    """The dumps of one PyTorch train step of `model` on `inputs` with the trainer's loss, in order.txt order."""
    from .build.export import _ModelWithLoss, flatten_outputs

    wrapper = _ModelWithLoss(model, loss_fn, [d.name for d in model_desc.inputs])
    if loss_fn is not None:

        def loss(preds):
            return loss_fn(preds, inputs[-1])
    else:
        index = [d.is_loss for d in model_desc.outputs].index(True)

        def loss(preds):
            return flatten_outputs(preds)[index]

    with torch.enable_grad():  # the first step may be an eval_step under torch.no_grad()
        return trace_activations(model, (), wrapper.model_kwargs(inputs), loss_fn=loss)


def _elem_type(model: onnx.ModelProto, tensor: str) -> int | None:
    try:
        return tensor_elem_type(model, tensor)
    except KeyError:
        return None


def _torch_dtype(elem_type: int | None, fallback: torch.dtype) -> torch.dtype:
    try:
        return to_torch_dtype(elem_type) if elem_type is not None else fallback
    except ValueError:
        return fallback


def _warn_unserved(model: torch.nn.Module) -> None:
    others = sorted(
        {type(s).__name__ for m in managers_of(model) for s in m.subscribers if not isinstance(s, StatisticsSubscriber)}
    )
    if others:
        warnings.warn(
            f"subscribers {others} of {type(model).__name__} do not run in ORTTrainer (only "
            "StatisticsSubscriber is collected, inside the ONNX Runtime graph)",
            stacklevel=6,
        )
