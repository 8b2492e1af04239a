"""An embedding's padding row gets no gradient from its lookups, as in PyTorch: ONNX Runtime's `GatherGrad` masked.

Why: `nn.Embedding(..., padding_idx=p)` never updates row p from a lookup (PyTorch's embedding backward skips the
indices equal to p). The TorchScript exporter writes the lookup as a plain `Gather` ("ONNX does not support not
updating the embedding vector at padding_idx during training", it warns), and ONNX Runtime's gradient of Gather adds
every looked-up row's gradient, p's too. A Pegasus or a Marian model, whose decoder starts each sequence with the pad
token, then trained its shared embedding differently from PyTorch, and so did a RoCBert, whose default pronunciation
and shape ids are the padding index (docs/engine.md §40).

Rule: for each `GatherGrad(shape, indices, dY)` (com.microsoft, axis 0) whose `shape` is `Shape(W)` (or of a
`Cast` of W) of a weight W in `padding` (initializer name -> padding index, from the model's `nn.Embedding`
modules), dY becomes `dY * Cast(indices != p)` with the mask's trailing axis added (`Unsqueeze` of the last axis),
so the rows of the looked-up padding index add nothing. A weight's other uses (a tied output projection) keep their
gradient in row p, as in PyTorch. Runs before `scatter_grad.py` turns GatherGrad into a scatter-add.

Precondition: every such GatherGrad node has its three inputs named.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx
from onnx import helper

from .editor import GraphEditor, copy_model, inferred_shapes, tensor_elem_type
from .passes import FunctionPass, Problem, default_opset, require

_AXES_AS_INPUT = 13  # Unsqueeze takes its axes as an input from opset 13


def padding_rows_without_gradient(model: onnx.ModelProto, padding: Mapping[str, int]) -> onnx.ModelProto:
    """Apply the rule above; returns a new model (the argument is not modified)."""
    shapes_of = _shape_sources(model)
    if all(_padded_weight(n, shapes_of, padding) is None for n in model.graph.node):
        return model
    require("padding_rows_without_gradient", _padding_problem(model))
    result = copy_model(model)
    ed = GraphEditor(result.graph, "orttrainer/embedding_padding")
    opset = default_opset(result)
    nodes: list[onnx.NodeProto] = []
    for node in list(result.graph.node):
        weight = _padded_weight(node, shapes_of, padding)
        if weight is not None:
            start = len(ed.graph.node)
            node.input[2] = _masked(ed, result, node.input[1], node.input[2], padding[weight], opset)
            nodes.extend(ed.graph.node[start:])
            del ed.graph.node[start:]
        nodes.append(node)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    return result


def _shape_sources(model: onnx.ModelProto) -> dict[str, str]:
    """Each `Shape` output -> the tensor it reads, through `Cast`s (mixed precision looks up a float16 copy)."""
    cast_of = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast" and n.input and n.output}
    sources = {}
    for node in model.graph.node:
        if node.op_type == "Shape" and node.input and node.output:
            source = node.input[0]
            while source in cast_of:
                source = cast_of[source]
            sources[node.output[0]] = source
    return sources


def _padded_weight(node: onnx.NodeProto, shapes_of: dict[str, str], padding: Mapping[str, int]) -> str | None:
    if node.op_type != "GatherGrad" or node.domain != "com.microsoft" or len(node.input) != 3:
        return None
    if any(a.name == "axis" and helper.get_attribute_value(a) != 0 for a in node.attribute):
        return None
    weight = shapes_of.get(node.input[0])
    return weight if weight in padding else None


def _masked(ed: GraphEditor, model: onnx.ModelProto, indices: str, grad: str, index: int, opset: int) -> str:
    """`grad` with the rows whose index is `index` set to zero (indices compared as int64: int32 ones too)."""
    kind = _element_type(model, grad)
    wide = ed.op("Cast", [indices], "indices_int64", to=onnx.TensorProto.INT64)
    padded = ed.op("Equal", [wide, ed.constant(index, dtype="int64", hint="padding_idx")], "is_padding")
    keep = ed.op("Cast", [ed.op("Not", [padded], "not_padding")], "keep", to=kind)
    if opset >= _AXES_AS_INPUT:
        keep = ed.op("Unsqueeze", [keep, ed.constant([-1], dtype="int64", hint="last_axis")], "keep_rows")
    else:
        keep = ed.op("Unsqueeze", [keep], "keep_rows", axes=[-1])
    return ed.op("Mul", [grad, keep], "grad_without_padding")


def _element_type(model: onnx.ModelProto, name: str) -> int:
    try:
        return tensor_elem_type(model, name)
    except KeyError:
        return inferred_shapes(model).get(name, (onnx.TensorProto.FLOAT, ()))[0]


def _padding_problem(model: onnx.ModelProto) -> Problem:
    for node in model.graph.node:
        if node.op_type == "GatherGrad" and (len(node.input) != 3 or not all(node.input)):
            return f"GatherGrad node {node.name!r} needs three named inputs (shape, indices, gradient)"
    return None


def padding_rows_pass(padding: Mapping[str, int]) -> FunctionPass:
    """The rule above for the weights in `padding`."""
    return FunctionPass(
        "padding_rows_without_gradient",
        lambda model: padding_rows_without_gradient(model, padding),
        _padding_problem,
    )
