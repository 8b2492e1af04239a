"""Activation statistics inside the graph: marked tensors, and their reductions as small extra outputs.

Two passes, and `decode_statistics`, which turns the fetched outputs back into `orttrainer.debug.TensorStatistics`:

* `marks_to_identity`: the export routes every subscribed activation through a marker op
  (`orttrainer.debug::ActivationMark`, attribute `activation`); this pass makes each marker a plain `Identity`, so the
  graph is standard ONNX again, and reports which tensor holds which activation. The marker outputs stay distinct
  tensors, so the gradient builder gives each its own gradient (`<tensor>_grad`, the sum over its consumers). The
  torch builder's traces mark gradients too (attribute `direction` 'backward', gradient/torch_private/custom_ops.py):
  `directed_marks_to_identity` reports the direction of each.
* `append_statistics`: for each target tensor, reductions computed on the device (min, max, sum, sum of squared
  deviations, nan/inf/neg/pos/zero counts, the shape and the first 128 flattened elements) become three graph
  outputs. Nothing else changes, so a session that runs with `only_execute_path_to_fetches` computes them only on
  the steps that fetch them.

Both check their precondition first (`PassPreconditionError`) and return a new model; `MARKS_TO_IDENTITY` and
`append_statistics_pass` are the same passes as `passes.FunctionPass` objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from ...debug import TensorStatistics, statistics_from_reductions
from .editor import GraphEditor, copy_model, fresh_name, graph_value_names
from .passes import FunctionPass, Problem, first_result, require

MARK_DOMAIN = "orttrainer.debug"
MARK_OP = "ActivationMark"
MARK_ATTRIBUTE = "activation"
NUM_SAMPLES = 128


@dataclass(frozen=True)
class StatisticsTarget:
    """A tensor of the graph to summarise, and its ONNX element type (`None`: unknown, ONNX Runtime infers it)."""

    tensor: str
    elem_type: int | None


@dataclass(frozen=True)
class StatisticsOutputs:
    """Graph outputs of one target: `values` double[4] = (min, max, sum, sum of squared deviations from the mean),
    `counts` int64[5 + rank] = (nan, inf, neg, pos, zero, *shape), `samples` = the first 128 flattened elements."""

    values: str
    counts: str
    samples: str

    @property
    def names(self) -> list[str]:
        return [self.values, self.counts, self.samples]


def marks_to_identity(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[tuple[str, str]]]:
    """Rule: every `orttrainer.debug::ActivationMark(x) -> y` node becomes `Identity(x) -> y`, named
    `orttrainer/activation/<activation>` (a backward mark: `orttrainer/activation_backward/<activation>`); the
    `orttrainer.debug` opset import is dropped.

    Returns the new model and `(activation, y)` pairs of the forward marks in node order. Precondition: each marker
    has one input, one output and a string `activation` attribute (else `PassPreconditionError` naming the node).
    """
    result, marks = directed_marks_to_identity(model)
    return result, [(activation, y) for activation, direction, y in marks if direction == "forward"]


def directed_marks_to_identity(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[tuple[str, str, str]]]:
    """`marks_to_identity`, returning `(activation, direction, y)` for every mark; `direction` is the marker's
    `direction` attribute ('forward' when absent)."""
    require("marks_to_identity", _marker_problem(model))
    result = copy_model(model)
    taken = {n.name for n in result.graph.node} | graph_value_names(result.graph)
    marks: list[tuple[str, str, str]] = []
    for node in result.graph.node:
        if not _is_marker(node):
            continue
        activation = _marked_activation(node).decode("utf-8")
        found = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "direction"), b"forward")
        direction = found.decode("utf-8")
        scope = "activation" if direction == "forward" else "activation_backward"
        node.CopyFrom(
            helper.make_node(
                "Identity",
                list(node.input),
                list(node.output),
                name=fresh_name(f"orttrainer/{scope}/{activation}", taken),
            )
        )
        marks.append((activation, direction, node.output[0]))
    kept = [o for o in result.opset_import if o.domain != MARK_DOMAIN]
    del result.opset_import[:]
    result.opset_import.extend(kept)
    return result, marks


def _is_marker(node: onnx.NodeProto) -> bool:
    return node.op_type == MARK_OP and node.domain == MARK_DOMAIN


def _marked_activation(node: onnx.NodeProto) -> Any:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == MARK_ATTRIBUTE), None)


def _marker_problem(model: onnx.ModelProto) -> Problem:
    for node in model.graph.node:
        if not _is_marker(node):
            continue
        if len(node.input) != 1 or len(node.output) != 1 or not isinstance(_marked_activation(node), bytes):
            return (
                f"activation marker {node.name!r} must have one input, one output and a string "
                f"'{MARK_ATTRIBUTE}' attribute"
            )
    return None


MARKS_TO_IDENTITY = FunctionPass("marks_to_identity", first_result(marks_to_identity), _marker_problem)


def gradient_tensor(model: onnx.ModelProto, tensor: str) -> str | None:
    """`<tensor>_grad` when a node of `model` produces it (ORT's gradient builder names the gradient of every
    tensor on the backward path so, summing over the tensor's consumers), else `None`."""
    name = f"{tensor}_grad"
    return name if any(name in node.output for node in model.graph.node) else None


def append_statistics(
    model: onnx.ModelProto, targets: dict[str, StatisticsTarget]
) -> tuple[onnx.ModelProto, dict[str, StatisticsOutputs]]:
    """Rule: for each `label -> target`, append nodes computing the target's statistics and three graph outputs
    (see `StatisticsOutputs`). Reductions run in float64 on the flattened tensor (every other element type is cast,
    exactly for floats and for integers below 2**53); min/max sit behind an `If` on a non-empty tensor (ONNX
    Runtime's ReduceMin/ReduceMax fail on empty input); the samples keep the tensor's type (bfloat16 as float32),
    and their output is declared without a type when the target's is unknown.

    The outputs are appended after the existing ones, three per target in `targets` order (`statistics_outputs`).

    Precondition: each target tensor is produced by a node or is a graph input or initializer (else
    `PassPreconditionError`). Existing nodes and outputs are left as they are.
    """
    require("append_statistics", _targets_problem(model, targets))
    result = copy_model(model)
    ed = GraphEditor(result.graph, "orttrainer/statistics")
    outputs = {label: _append_one(ed, label, target) for label, target in targets.items()}
    return result, outputs


def _targets_problem(model: onnx.ModelProto, targets: dict[str, StatisticsTarget]) -> Problem:
    known = graph_value_names(model.graph)
    missing = sorted({t.tensor for t in targets.values() if t.tensor not in known})
    return f"statistics requested for tensors the graph does not have: {missing}" if missing else None


def append_statistics_pass(targets: dict[str, StatisticsTarget]) -> FunctionPass:
    """`append_statistics` as a pass; `statistics_outputs` reads back the output names it added."""
    return FunctionPass(
        "append_statistics",
        first_result(append_statistics, targets=targets),
        partial(_targets_problem, targets=targets),
    )


def statistics_outputs(model: onnx.ModelProto, targets: dict[str, StatisticsTarget]) -> dict[str, StatisticsOutputs]:
    """The `StatisticsOutputs` of each target of a model `append_statistics(_, targets)` returned: its last
    3·len(targets) graph outputs, in target order."""
    names = [o.name for o in model.graph.output][len(model.graph.output) - 3 * len(targets) :]
    return {label: StatisticsOutputs(*names[3 * k : 3 * k + 3]) for k, label in enumerate(targets)}


def _append_one(ed: GraphEditor, label: str, target: StatisticsTarget) -> StatisticsOutputs:
    hint = f"{label}/"
    flat = ed.op("Reshape", [target.tensor, ed.constant([-1], np.int64, hint="minus_one")], hint + "flat")
    x = (
        flat
        if target.elem_type == TensorProto.DOUBLE
        else ed.op("Cast", [flat], hint + "double", to=TensorProto.DOUBLE)
    )
    size = ed.op("Size", [x], hint + "size")
    total = ed.op("ReduceSum", [x], hint + "sum")
    mean = ed.op("Div", [total, ed.op("Cast", [size], hint + "n", to=TensorProto.DOUBLE)], hint + "mean")
    m2 = ed.op("ReduceSumSquare", [ed.op("Sub", [x, mean], hint + "dev")], hint + "m2")
    min_max = _min_max(ed, hint, x, size)
    values = ed.op("Concat", [min_max, total, m2], hint + "values", axis=0)
    zero = ed.constant(0.0, np.float64, hint="zero_d")
    flags = [
        ed.op("IsNaN", [x], hint + "isnan"),
        ed.op("IsInf", [x], hint + "isinf"),
        ed.op("Less", [x, zero], hint + "neg"),
        ed.op("Greater", [x, zero], hint + "pos"),
        ed.op("Equal", [x, zero], hint + "zero"),
    ]
    flag_counts = [
        ed.op("ReduceSum", [ed.op("Cast", [f], hint + "flag", to=TensorProto.INT64)], hint + "count") for f in flags
    ]
    counts = ed.op("Concat", [*flag_counts, ed.op("Shape", [target.tensor], hint + "shape")], hint + "counts", axis=0)
    samples = ed.op(
        "Slice",
        [flat, ed.constant([0], np.int64, hint="zero_i"), ed.constant([NUM_SAMPLES], np.int64, hint="num_samples")],
        hint + "samples",
    )
    sample_type = target.elem_type
    if target.elem_type == TensorProto.BFLOAT16:  # numpy has no bfloat16
        samples, sample_type = ed.op("Cast", [samples], hint + "samples_f", to=TensorProto.FLOAT), TensorProto.FLOAT
    ed.add_output(values, TensorProto.DOUBLE, [4])
    ed.add_output(counts, TensorProto.INT64, None)
    if sample_type is None:
        untyped = onnx.ValueInfoProto()
        untyped.name = samples
        ed.graph.output.append(untyped)
    else:
        ed.add_output(samples, sample_type, None)
    return StatisticsOutputs(values, counts, samples)


def _min_max(ed: GraphEditor, hint: str, x: str, size: str) -> str:
    """double[2] (min, max), or (nan, nan) for an empty tensor."""
    lo, hi, both, nan = (ed.fresh(hint + part) for part in ("min", "max", "min_max_then", "nan_nan"))
    then_graph = helper.make_graph(
        [
            helper.make_node("ReduceMin", [x], [lo]),
            helper.make_node("ReduceMax", [x], [hi]),
            helper.make_node("Concat", [lo, hi], [both], axis=0),
        ],
        "non_empty",
        [],
        [helper.make_tensor_value_info(both, TensorProto.DOUBLE, [2])],
    )
    else_graph = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], [nan], value=helper.make_tensor("nan", TensorProto.DOUBLE, [2], [math.nan, math.nan])
            )
        ],
        "empty",
        [],
        [helper.make_tensor_value_info(nan, TensorProto.DOUBLE, [2])],
    )
    non_empty = ed.op("Greater", [size, ed.constant(0, np.int64, hint="zero_count")], hint + "non_empty")
    return ed.op("If", [non_empty], hint + "min_max", then_branch=then_graph, else_branch=else_graph)


def decode_statistics(values: Any, counts: Any, samples: Any, *, dtype: torch.dtype) -> TensorStatistics:
    """`TensorStatistics` from the three outputs `append_statistics` adds for one tensor (see `StatisticsOutputs`).

    Decisions as in `orttrainer.debug.statistics`: min/max are NaN when a NaN is present (as `torch.min`), std is
    the unbiased std (NaN below two elements), and an empty tensor has NaN min/max/mean/std.
    """
    lo, hi, total, m2 = _host(values).astype(np.float64).tolist()
    count_list = _host(counts).astype(np.int64).tolist()
    nan, inf, neg, pos, zero = count_list[:5]
    shape = count_list[5:]
    size = math.prod(shape)
    mean = std = None
    if size == 0:
        lo = hi = None
    else:
        if nan:
            lo = hi = math.nan
        mean = total / size
        std = math.sqrt(m2 / (size - 1)) if size > 1 else math.nan
    return statistics_from_reductions(
        shape=shape,
        dtype=dtype,
        min=lo,
        max=hi,
        mean=mean,
        std=std,
        nan=nan,
        inf=inf,
        neg=neg,
        pos=pos,
        zero=zero,
        samples=_host(samples),
    )


def _host(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
