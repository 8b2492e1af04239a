"""The torch builder as the compiler uses it: what it traces (`TorchSource`) and the gradient model for one batch's
input shapes, with the trainer's state as its only state inputs.

Rules:
- State: the traced graph takes every parameter and buffer of the module; the session feeds the trainer's state
  (the tensors the forward uses). Other state inputs become constants or disappear (`bind_foreign_state`).
- Shapes: a graph traced with the dims of `TorchSource.dynamic_dims` dynamic (where the trace allows it) is valid
  for the inputs its `accepts` takes; a graph traced for other inputs keeps their concrete shapes (see
  `torch_builder.py`). The compiler keeps the graph for each shape signature it has seen: the first
  `STATIC_SIGNATURES` signatures get graphs traced for their shapes, a later one the dynamic graph
  (compile/compiler.TorchShapeGraphs; the eval graphs likewise, build/torch_route.TorchEvalGraphs).
- Values: a module whose forward branches on the batch's values gets a graph for the way the batch's values
  branch; its `accepts` also checks that a batch's values branch the same way (`branches_on_values`;
  gradient/torch_trace.py).
- Mode: the module is traced in the train/eval mode it had when the trainer first saw it.
- Names: with `state_names` (module name -> trainer name; an ONNX model's `OnnxModule`), `trainable` and `state`
  are given in trainer names and the gradient model is renamed to them (`graph/state_names.rename_state_pass`).
- Mixed precision (`TorchSource.mixed_precision`): the module is traced in float16 on its float32 state, with the
  loss-scale input and the scaled-loss output `loss_scale_names` gives (gradient/torch_builder.py); every graph
  traced from that source, for any input shapes, has them.
- Features (`TorchSource.features`): recompute, memory-efficient gradients and the `orttrainer.debug` marks act on
  every graph traced from the source (`torch_builder.TraceFeatures`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import onnx
import torch

from ...debug.subscriber import no_increase_global_step
from ...dtypes import tensor_proto
from ..graph.class_labels import GUARD_PYTORCH_INDICES
from ..graph.editor import fresh_name
from ..graph.mixed_precision import LOSS_SCALE_INPUT
from ..graph.passes import run_passes
from ..graph.state_names import rename_state_pass
from .errors import GradientBuildError
from .torch_builder import TraceFeatures, build_torch_gradient_graph

_logger = logging.getLogger(__name__)


# Input-shape signatures that get a graph traced for their shapes before one is traced with dynamic dims. Why: a
# trace for the batch's shapes goes through the direct translation (gradient/aten_onnx.py) and a dynamic one through
# torch.export and torch.onnx, which cost more: the first step of a new batch size took 8.0 against about 1 s on the
# benchmark transformer, 5.3 on the CNN and 364 s on the LSTM, whose unrolled steps torch.onnx optimises
# (docs/engine.md §29). Three keep an epoch's full and last partial batch, and a second data set's, on the fast
# traces, and cost no more than one dynamic trace of the transformer; the dynamic graph then serves the shapes to
# come (sequence lengths that change with every batch).
STATIC_SIGNATURES = 3


@dataclass(frozen=True)
class TorchSource:
    """What the torch builder traces: `_ModelWithLoss(module, loss_fn, input_names)` in mode `training`, with the
    dims `dynamic_dims[i]` of input i dynamic (model_desc's string dims) in the first graph, and each group of
    `same_sizes` ((input, dim) pairs model_desc names alike) one size."""

    module: torch.nn.Module
    loss_fn: Callable | None
    input_names: list[str]
    opset_version: int
    training: bool
    dynamic_dims: list[list[int]] = field(default_factory=list)
    same_sizes: list[list[tuple[int, int]]] = field(default_factory=list)
    state_names: Mapping[str, str] | None = None  # module state name -> the trainer's name, where they differ
    mixed_precision: bool = False  # traced in float16 with a loss-scale input (module docstring)
    features: TraceFeatures = field(default_factory=TraceFeatures)  # recompute, memory efficiency, debug marks
    float16_casts: bool = True  # False: the module computes in float16 itself (build/onnx_float16.py)


Accepts = Callable[[Sequence[torch.Tensor]], bool]


@dataclass(frozen=True)
class TorchGradientModel:
    """A torch-built gradient model, the rule saying which inputs it is valid for, and the buffers the forward
    updates that were not yet the trainer's state (with their values): the trainer adds them to its frozen state.
    `branches_on_values`: the forward branched on tensor values, so `accepts` also checks that the inputs' values
    branch the same way (torch_private.ValueGuards); such a model is one of several for its input shapes."""

    model: onnx.ModelProto
    accepts: Accepts
    added_state: dict[str, torch.Tensor]
    branches_on_values: bool = False


def torch_gradient_model(
    source: TorchSource,
    inputs: Sequence[torch.Tensor],
    outputs: list[str],
    trainable: list[str],
    state: list[str],
    dynamic: bool = False,
) -> TorchGradientModel:
    """The gradient model for `inputs` (with `dynamic`: for every shape its trace allows): the data and the
    trainer's `state` tensors (trainable and frozen) as graph inputs; `outputs` (loss first), then `<p>_grad` for
    each of `trainable`, then `<b>__updated` for each buffer the forward updates in place, as graph outputs. A
    buffer the forward updates is state even when the trainer did not list it (BatchNorm's `num_batches_tracked`,
    which no eval-mode forward reads). Under mixed precision, also the loss-scale input (last) and the scaled-loss
    output (first), named by `loss_scale_names`."""
    names = dict(source.state_names or {})
    scale = loss_scale_names(source.input_names, outputs, state) if source.mixed_precision else None
    to_module = {trainer: module for module, trainer in names.items()}
    trainable, state = [to_module.get(n, n) for n in trainable], [to_module.get(n, n) for n in state]
    params = {name for name, _ in source.module.named_parameters()}
    frozen = [n for n in state if n in params and n not in set(trainable)]
    # orttrainer.debug hooks pass values through while tracing: no step counted, no file written from fake tensors
    with _mode(source.module, source.training), no_increase_global_step(), _trainer_names_in_errors(names):
        graph = build_torch_gradient_graph(
            source.module,
            source.loss_fn,
            source.input_names,
            list(inputs),
            outputs,
            trainable,
            frozen,
            source.opset_version,
            source.dynamic_dims if dynamic else None,
            source.same_sizes,
            scale,
            source.features,
            source.float16_casts,
        )
    if dynamic:
        kind = f"dynamic dims {graph.dynamic_dims}" if graph.dynamic else "the sample's concrete shapes"
        _logger.info("torch gradient builder: the training graph is traced with %s", kind)
    values = {n: t.detach() for n, t in [*source.module.named_parameters(), *source.module.named_buffers()]}
    added = [b for b in graph.mutated_buffers if b not in state]
    kept = [*state, *added, *scale[1:]] if scale else [*state, *added]
    model = bind_foreign_state(graph.model, len(source.input_names), kept, values)
    passes = [GUARD_PYTORCH_INDICES, *([rename_state_pass(names)] if names else [])]  # graph/class_labels.py
    added_state = {names.get(b, b): values[b].clone() for b in added}
    return TorchGradientModel(run_passes(model, passes), graph.accepts, added_state, graph.values is not None)


def loss_scale_names(data_inputs: Sequence[str], outputs: Sequence[str], state: Sequence[str]) -> tuple[str, str]:
    """(scaled loss, loss-scale input) of a mixed-precision torch gradient model: `<loss>_scaled` and
    `LOSS_SCALE_INPUT`, each made unique among the data inputs, outputs and state (the same names for every graph
    of one trainer)."""
    taken = {*data_inputs, *outputs, *state}
    return fresh_name(f"{outputs[0]}_scaled", taken), fresh_name(LOSS_SCALE_INPUT, taken)


@contextlib.contextmanager
def _trainer_names_in_errors(names: dict[str, str]) -> Iterator[None]:
    """A GradientBuildError's `unreachable` parameters in the trainer's names: the caller freezes them by those."""
    try:
        yield
    except GradientBuildError as err:
        err.unreachable = [names.get(n, n) for n in err.unreachable]
        raise


@contextlib.contextmanager
def _mode(module: torch.nn.Module, training: bool) -> Iterator[None]:
    was_training = module.training
    module.train(training)
    try:
        yield
    finally:
        module.train(was_training)


def bind_foreign_state(
    model: onnx.ModelProto, data_count: int, state: Sequence[str], values: dict[str, torch.Tensor]
) -> onnx.ModelProto:
    """Rule: every graph input after the first `data_count` (the data) that is not in `state` becomes an initializer
    holding `values[name]` when a node reads it, and is removed when none does. `model` is modified and returned.

    Why: the torch builder's graph takes all module state; the trainer feeds only its own state, which leaves out
    tensors the exported forward does not use (BatchNorm's `num_batches_tracked`, unused parameters)."""
    kept = set(state)
    read = {name for node in model.graph.node for name in node.input}
    foreign = [i for i in list(model.graph.input)[data_count:] if i.name not in kept]
    missing = [i.name for i in foreign if i.name in read and i.name not in values]
    if missing:
        raise ValueError(f"graph inputs {missing} are neither trainer state nor module state with a value")
    for value in foreign:
        model.graph.input.remove(value)
        if value.name in read:
            model.graph.initializer.append(tensor_proto(values[value.name], value.name))
    return model
