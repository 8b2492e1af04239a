"""Class labels, and the indices PyTorch's gather and scatter take, are range-checked inside the graph as PyTorch
checks them.

Why (docs/reliability.md §2): PyTorch refuses a cross-entropy label outside [0, classes) unless it is
the `ignore_index` ("Target -3 is out of bounds"). ONNX Runtime's loss kernels do not check labels at all, and the
ops PyTorch's own graphs are made of, GatherElements and ScatterElements, take negative indices as counted from the
end: a label of -3 for 5 classes trained silently (loss 1.62) with either gradient builder, while a label >= 5 was
refused by ScatterElements' own bounds check.

Rule, `guard_class_labels(model)`: for each tensor L read as class labels — input 1 of SoftmaxCrossEntropyLoss and
NegativeLogLikelihoodLoss (classes: dim 1 of input 0), input 2 of ONNX Runtime's SoftmaxCrossEntropyLossGrad
(classes: dim 1 of input 1), with the node's `ignore_index` (none when absent) — the graph computes, before the
first node that reads L (and after what the check needs),

    bad     = the number of elements of L outside [0, classes) that are not ignore_index
    zero    = Gather([0], bad)
    L_check = L + Cast(zero, L's type)

and every later node reads L_check instead of L. With no bad label, zero is 0 and L_check is L, with L's static
shape (shape inference, and so the static-shape specialisation, sees through the Add); with any, the Gather's
index is out of range and ONNX Runtime fails the run naming the node, whose name says what was out of range.
Neither runtime's graph optimisations fold a Gather with a computed index (tests/test_reliability_class_labels.py
runs the check with them on); an earlier form, a Reshape of a constant to a computed shape and then to [1], was
optimised away by onnxruntime 1.32, which fuses consecutive Reshapes. Where L's element type cannot be told from
the graph, L_check is `Reshape(L, Shape(L) + zero)` instead, which needs no type but hides L's shape from shape
inference. The failed step changes nothing (the trainer's rule for any step that raises).

`guard_pytorch_indices(model)` applies the same rule, and also to the indices (input 1) of GatherElements and
ScatterElements (bound: dim `axis` of input 0; no ignore index): for graphs traced from PyTorch only (the torch
gradient builder's training graphs, the torch route's eval graphs), where every such node comes from
`torch.gather`/`scatter` (a cross-entropy's labels among them), which refuse negative indices; an ONNX model's own
GatherElements may count from the end, so `guard_class_labels` leaves them alone.

Only the main graph is rewritten; nodes inside subgraphs keep reading L. Returns a new model; a model without
such nodes is returned as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from .editor import GraphEditor, copy_model, tensor_elem_type
from .passes import FunctionPass

__all__ = ["GUARD_CLASS_LABELS", "GUARD_PYTORCH_INDICES", "guard_class_labels", "guard_pytorch_indices"]

# op type -> (labels input, input whose dim 1 is the number of classes): ONNX's losses and ONNX Runtime's gradient
_LOSSES = {
    ("", "SoftmaxCrossEntropyLoss"): (1, 0),
    ("", "NegativeLogLikelihoodLoss"): (1, 0),
    ("com.microsoft", "SoftmaxCrossEntropyLossGrad"): (2, 1),
}
_PYTORCH_INDEXED = {"GatherElements", "ScatterElements"}


@dataclass(frozen=True)
class _Check:
    tensor: str  # the labels or indices
    bound: str  # the tensor whose dim `axis` is the exclusive upper bound
    axis: int
    ignore_index: int | None
    what: str  # how the failing node's name describes the values


def guard_class_labels(model: onnx.ModelProto) -> onnx.ModelProto:
    """Range-check the class labels of the loss nodes (module docstring); returns a new model."""
    return _guard(model, pytorch_indices=False)


def guard_pytorch_indices(model: onnx.ModelProto) -> onnx.ModelProto:
    """Range-check the class labels and the GatherElements/ScatterElements indices of a graph traced from PyTorch
    (module docstring); returns a new model."""
    return _guard(model, pytorch_indices=True)


def _guard(model: onnx.ModelProto, pytorch_indices: bool) -> onnx.ModelProto:
    checks = _checks(model.graph, pytorch_indices)
    if not checks:
        return model
    result = copy_model(model)
    editor = GraphEditor(result.graph, "orttrainer/range_check")
    for check in checks:
        _insert(editor, check, _element_type(result, check.tensor))
    return result


# Ops whose output has the element type of one of their inputs (which one): enough to trace labels and indices
# back to a declared input or a Cast.
_SAME_TYPE_AS = {
    "Identity": 0,
    "Reshape": 0,
    "Unsqueeze": 0,
    "Squeeze": 0,
    "Flatten": 0,
    "Expand": 0,
    "Transpose": 0,
    "Slice": 0,
    "Gather": 0,
    "Concat": 0,
    "Where": 1,
    "Add": 0,
}


def _element_type(model: onnx.ModelProto, name: str) -> int | None:
    """The element type of `name`: declared (input, value_info, initializer), or traced back through `_SAME_TYPE_AS`
    ops to a declaration or a Cast; None when the graph does not tell."""
    producers = {output: node for node in model.graph.node for output in node.output}
    for _ in range(len(model.graph.node) + 1):
        try:
            return tensor_elem_type(model, name)
        except KeyError:
            pass
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            return int(helper.get_attribute_value(next(a for a in node.attribute if a.name == "to")))
        if node.op_type not in _SAME_TYPE_AS or node.domain not in ("", "ai.onnx"):
            return None
        name = node.input[_SAME_TYPE_AS[node.op_type]]
    return None


def _checks(graph: onnx.GraphProto, pytorch_indices: bool) -> list[_Check]:
    """One check per (tensor, ignore_index), in node order; the first reader's bound serves them all (every loss
    node reading the same labels has the same number of classes)."""
    checks: dict[tuple[str, int | None], _Check] = {}
    for node in graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (domain, node.op_type) in _LOSSES:
            labels, scores = _LOSSES[(domain, node.op_type)]
            ignore = attributes.get("ignore_index")
            what = f"a class label of {node.op_type} {node.name!r} is outside [0, classes)"
            what += f" and is not its ignore_index {ignore}" if ignore is not None else ""
            check = _Check(node.input[labels], node.input[scores], 1, ignore, what)
        elif pytorch_indices and domain == "" and node.op_type in _PYTORCH_INDEXED:
            axis = int(attributes.get("axis", 0))
            what = f"an index of {node.op_type} {node.name!r} is outside [0, size of axis {axis})"
            what += " (from a loss: a class label outside [0, classes) that is not its ignore_index)"
            check = _Check(node.input[1], node.input[0], axis, None, what)
        else:
            continue
        if check.tensor and check.bound:
            checks.setdefault((check.tensor, check.ignore_index), check)
    return list(checks.values())


def _insert(editor: GraphEditor, check: _Check, elem_type: int | None) -> None:
    """Append the check's nodes, move them before the first reader of the tensor that comes after everything they
    read, and make the readers from there on read the checked tensor."""
    graph = editor.graph
    start = len(graph.node)
    checked = _check_nodes(editor, check, elem_type)
    added = list(graph.node[start:])
    del graph.node[start:]
    nodes = list(graph.node)
    ready = max((i + 1 for i, n in enumerate(nodes) if {check.tensor, check.bound} & set(n.output)), default=0)
    position = next((i for i, n in enumerate(nodes) if i >= ready and check.tensor in n.input), len(nodes))
    for node in nodes[position:]:
        for index, name in enumerate(node.input):
            if name == check.tensor:
                node.input[index] = checked
    del graph.node[:]
    graph.node.extend(nodes[:position] + added + nodes[position:])


def _check_nodes(editor: GraphEditor, check: _Check, elem_type: int | None) -> str:
    """The nodes of the rule (module docstring), appended to the graph; returns the checked tensor's name."""
    ed, int64 = editor, TensorProto.INT64
    values = ed.op("Cast", [check.tensor], "values", to=int64)
    size = ed.op("Gather", [ed.op("Shape", [check.bound], "bound_shape"), ed.constant(check.axis, "int64", "axis")])
    below = ed.op("Less", [values, ed.constant(0, "int64", "zero")], "negative")
    above = ed.op("Not", [ed.op("Less", [values, size], "in_bound")], "too_large")
    bad = ed.op("Or", [below, above], "out_of_range")
    if check.ignore_index is not None:
        ignored = ed.op("Equal", [values, ed.constant(check.ignore_index, "int64", "ignore_index")], "ignored")
        bad = ed.op("And", [bad, ed.op("Not", [ignored], "counted")], "refused")
    count = ed.op("ReduceSum", [ed.op("Cast", [bad], "refused_i", to=int64)], "refused_count", keepdims=0)
    zero = ed.op("Gather", [ed.constant([0], "int64", "zeros"), count], "zero")  # fails unless count == 0
    graph = ed.graph
    graph.node[-1].name = ed.unused(f"orttrainer: {check.what}; PyTorch refuses it (this step changed nothing)")
    if elem_type is None:
        shape = ed.op("Add", [ed.op("Shape", [check.tensor], "shape"), zero], "checked_shape")
        return ed.op("Reshape", [check.tensor, shape], "checked")
    if elem_type != int64:
        zero = ed.op("Cast", [zero], "zero_typed", to=elem_type)
    return ed.op("Add", [check.tensor, zero], "checked")


GUARD_CLASS_LABELS = FunctionPass("guard_class_labels", guard_class_labels)
GUARD_PYTORCH_INDICES = FunctionPass("guard_pytorch_indices", guard_pytorch_indices)
