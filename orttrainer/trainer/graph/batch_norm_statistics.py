"""BatchNormalization's running statistics, updated by the training graph itself, for ONNX Runtime's gradient builder.

Why: ONNX Runtime trains a training-mode BatchNormalization as `BatchNormInternal`, whose kernel writes the updated
running statistics into its running-mean and running-variance inputs in place (docs/engine.md §11.1) — for the
trainer, into its state, with the population variance and without `num_batches_tracked`, where PyTorch moves the
running variance with the unbiased variance and counts the batches.

Rule (`update_batch_norm_statistics`), for each training-mode BatchNormalization node whose running mean and
variance are the state tensors of a `BatchNormStatistics`:
- the node reads constants in their place (zeros and ones: a training-mode node normalises with the batch's
  statistics, so its output is unchanged), so nothing writes into the state;
- appended nodes compute, in float32, from the node's input X of shape (N, C, ...): the batch mean and variance
  over every position of a channel (the unbiased variance `Σ(x - mean)² / (n - 1)` for PyTorch's semantics, the
  population variance `/ n` for ONNX's), and the new running statistics `(1 - f) · old + f · batch`, where `f` is
  `momentum` (PyTorch's convention: the weight of the batch), or with `momentum` None the cumulative average
  `1 / (batches + 1)`; the batch counter, when there is one, is incremented;
- the new values are graph outputs named `compile/contract.buffer_update_name(state)`, which the training graph
  hands to the session as buffer updates, every step.
Precondition: each named running mean, variance and counter is a graph input or initializer; each node X has rank
at least 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import onnx
from onnx import TensorProto

from ..compile.contract import buffer_update_name
from .editor import GraphEditor, copy_model
from .passes import FunctionPass, Problem, first_problem, graph_input_names


@dataclass(frozen=True)
class BatchNormStatistics:
    """The state tensors of one BatchNorm's running statistics and how they move (module docstring)."""

    mean: str
    var: str
    counter: str | None  # PyTorch's num_batches_tracked (int64 scalar); None: ONNX semantics have none
    momentum: float | None  # the batch's weight; None: the cumulative average (needs the counter)
    unbiased: bool  # PyTorch: the running variance moves with the unbiased batch variance; ONNX: the population's


def update_batch_norm_statistics(model: onnx.ModelProto, statistics: list[BatchNormStatistics]) -> onnx.ModelProto:
    """The rule of the module docstring; `model` is not modified."""
    by_state = {(s.mean, s.var): s for s in statistics}
    result = copy_model(model)
    opset = next((o.version for o in result.opset_import if o.domain in ("", "ai.onnx")), 14)
    ed = GraphEditor(result.graph, "orttrainer/batch_norm")
    shapes = _state_shapes(result)
    for node in list(result.graph.node):
        spec = by_state.get((node.input[3], node.input[4])) if _in_training(node) else None
        if spec is not None:
            _update(ed, node, spec, opset, shapes[spec.mean])
    return result


def update_batch_norm_statistics_problem(model: onnx.ModelProto, statistics: list[BatchNormStatistics]) -> Problem:
    known = graph_input_names(model) | {i.name for i in model.graph.initializer}
    named = [n for s in statistics for n in (s.mean, s.var, s.counter) if n is not None]
    missing = sorted(n for n in named if n not in known)
    counterless = [s.mean for s in statistics if s.momentum is None and s.counter is None]
    return first_problem(
        f"running statistics {missing} are neither graph inputs nor initializers" if missing else None,
        f"{counterless}: the cumulative average (momentum None) needs a batch counter" if counterless else None,
    )


def batch_norm_statistics_pass(statistics: list[BatchNormStatistics]) -> FunctionPass:
    """`update_batch_norm_statistics` as a graph pass."""
    fixed = list(statistics)
    return FunctionPass(
        "update_batch_norm_statistics",
        partial(update_batch_norm_statistics, statistics=fixed),
        partial(update_batch_norm_statistics_problem, statistics=fixed),
    )


def onnx_batch_norm_statistics(model: onnx.ModelProto, state: list[str]) -> list[BatchNormStatistics]:
    """The ONNX semantics of every training-mode BatchNormalization of `model` whose running statistics are in
    `state`: the node's `momentum` attribute (default 0.9, the weight of the old value), the population variance."""
    found = []
    for node in model.graph.node:
        if _in_training(node) and node.input[3] in state and node.input[4] in state:
            momentum = next((a.f for a in node.attribute if a.name == "momentum"), 0.9)
            found.append(BatchNormStatistics(node.input[3], node.input[4], None, 1.0 - momentum, unbiased=False))
    return found


def _in_training(node: onnx.NodeProto) -> bool:
    """A BatchNormalization that normalises with the batch's statistics: `training_mode=1` (opset 14 and later),
    or one with its running-statistics outputs (opsets 9-13, where training is told by the outputs)."""
    if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) < 5:
        return False
    mode = next((a.i for a in node.attribute if a.name == "training_mode"), None)
    return bool(mode) if mode is not None else len([o for o in node.output if o]) > 1


def _state_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    for value in model.graph.input:
        shapes.setdefault(value.name, [d.dim_value for d in value.type.tensor_type.shape.dim])
    return shapes


def _update(ed: GraphEditor, node: onnx.NodeProto, spec: BatchNormStatistics, opset: int, channels: list[int]) -> None:
    x = ed.op("Cast", [node.input[0]], "x_float", to=TensorProto.FLOAT)  # float16 under mixed precision
    shape = ed.op("Shape", [x], "shape")
    leading = ed.op("Slice", [shape, ed.constant([0], np.int64), ed.constant([2], np.int64)], "n_c")
    grouped = ed.op("Reshape", [x, ed.op("Concat", [leading, ed.constant([-1], np.int64)], "ncs", axis=0)], "ncs_x")
    total = _reduce_sum(ed, grouped, opset)  # per channel
    count = ed.op(
        "Cast",
        [ed.op("Div", [ed.op("Size", [x], "size"), ed.op("Gather", [shape, ed.constant(1, np.int64)], "c")], "n")],
        "n_float",
        to=TensorProto.FLOAT,
    )
    mean = ed.op("Div", [total, count], "batch_mean")
    centered = ed.op("Sub", [grouped, ed.op("Reshape", [mean, ed.constant([1, -1, 1], np.int64)], "mean_b")], "xc")
    squares = _reduce_sum(ed, ed.op("Mul", [centered, centered], "xc2"), opset)
    divisor = ed.op("Sub", [count, ed.constant(1.0)], "n_minus_1") if spec.unbiased else count
    var = ed.op("Div", [squares, divisor], "batch_var")
    factor: str
    if spec.counter is not None:
        counted = ed.op("Add", [spec.counter, ed.constant(1, np.int64)], "counted")
        ed.op("Identity", [counted], "counter", outputs=[ed.claim(buffer_update_name(spec.counter))])
        ed.add_output(buffer_update_name(spec.counter), TensorProto.INT64, [])
    if spec.momentum is None:
        assert spec.counter is not None  # the precondition
        factor = ed.op("Reciprocal", [ed.op("Cast", [counted], "count_f", to=TensorProto.FLOAT)], "factor")
    else:
        factor = ed.constant(float(spec.momentum), hint="momentum")
    keep = ed.op("Sub", [ed.constant(1.0), factor], "keep")
    for state, batch in ((spec.mean, mean), (spec.var, var)):
        moved = ed.op("Add", [ed.op("Mul", [state, keep], "old"), ed.op("Mul", [batch, factor], "new")], "moved")
        ed.op("Identity", [moved], "running", outputs=[ed.claim(buffer_update_name(state))])
        ed.add_output(buffer_update_name(state), TensorProto.FLOAT, None)
    dtype = np.float16 if _is_half(ed, node) else np.float32  # the node's own statistics type
    node.input[3] = ed.constant(np.zeros(channels), dtype, hint="zero_mean")
    node.input[4] = ed.constant(np.ones(channels), dtype, hint="one_var")


def _reduce_sum(ed: GraphEditor, x: str, opset: int) -> str:
    """Σ over axes 0 and 2 of an (N, C, S) tensor: (C)."""
    if opset >= 13:
        return ed.op("ReduceSum", [x, ed.constant([0, 2], np.int64)], "sum", keepdims=0)
    return ed.op("ReduceSum", [x], "sum", axes=[0, 2], keepdims=0)


def _is_half(ed: GraphEditor, node: onnx.NodeProto) -> bool:
    """Whether the node's running statistics are float16 (mixed precision converted them)."""
    for init in ed.graph.initializer:
        if init.name == node.input[3]:
            return init.data_type == TensorProto.FLOAT16
    for value in ed.graph.input:
        if value.name == node.input[3]:
            return value.type.tensor_type.elem_type == TensorProto.FLOAT16
    return False
