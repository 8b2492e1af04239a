"""`ConvGrad` in forms ONNX Runtime's CPU kernel computes right: explicit pads for `auto_pad` SAME, and grouped
convolutions of one or three spatial axes without the kernel writing past its input gradient.

Why: onnxruntime-training's CPU `ConvGrad` (com.microsoft, 1.19.2) has two faults, and the 'ort' builder's gradient
graph meets both (docs/engine.md §40):
- It reads only the `pads` attribute, never `auto_pad`: a convolution exported with `auto_pad` SAME_UPPER (PyTorch's
  `padding="same"`: EfficientNet's depthwise convolutions) gets the gradient of an unpadded one, with the padded
  output's sizes, and reads and writes outside its buffers: EfficientNet's first step ended in a segmentation
  fault.
- It computes the input gradient dX group by group, and for any spatial rank but 2 zeroes each group's slice of dX
  with the size of all C channels instead of the group's C / group: for the last image, groups 1 … group-1 write
  zeros past the end of dX, into whatever ONNX Runtime placed there. A SqueezeBERT (grouped Conv1d) gave some
  parameters no update at all and others a wrong one, differently with each graph optimisation level and between
  runs of one session; an LFM2 and a Data2Vec-Audio the same.

Rules, for each `ConvGrad`:
- `auto_pad` SAME_UPPER or SAME_LOWER becomes NOTSET with the explicit `pads` ONNX's Conv defines for it: per axis
  the total `max((ceil(in / stride) - 1) * stride + (kernel - 1) * dilation + 1 - in, 0)`, its larger half at the
  end (SAME_UPPER) or the beginning (SAME_LOWER). With every stride 1 the total is `(kernel - 1) * dilation`; with a
  larger stride it needs the input's spatial sizes, which shape inference must know (else a RuntimeError names the
  node: 'auto' then trains the model with the torch builder). VALID is zero pads, as the kernel reads it.
- `group` > 1 with the dX output read, one spatial axis: the convolution in 2-D form. dY, X and W get a unit axis at
  2 (`Unsqueeze`), the attributes a leading unit entry (kernel [1, k], pads [0, b, 0, e], strides [1, s], dilations
  [1, d]), and dX and dW lose that axis again (`Squeeze`); dB is unchanged. The 2-D kernel computes every output
  the same way, sizes right.
- `group` > 1 with the dX output read, three (or more) spatial axes: one `ConvGrad` per group, with `group` 1, on
  the group's channels (`Split` of dY and X along axis 1 and of W along axis 0), the results concatenated (dX along
  axis 1, dW and dB along axis 0).
Any other `ConvGrad` is left as it is: the dW and dB computations are right for every rank.

Precondition: every rewritten node has its three inputs named.
"""

from __future__ import annotations

import math

import onnx
from onnx import helper

from .editor import GraphEditor, copy_model, inferred_shapes
from .passes import FunctionPass, Problem, default_opset, require

_AXES_AS_INPUT = 13  # Unsqueeze, Squeeze and Split take their axes or sizes as inputs from opset 13
_SPLIT_NUM_OUTPUTS = 18  # an equal Split names its number of outputs from opset 18


def conv_grad_in_safe_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """Apply the rules above; returns a new model (the argument is not modified)."""
    if not any(_same_padded(n) or _grouped(n) for n in model.graph.node):
        return model
    require("conv_grad_in_safe_form", _conv_grad_problem(model))
    result = copy_model(model)
    needs_shapes = any(
        _same_padded(n) and (_strided(n) or not _attribute(n, "kernel_shape", None)) for n in result.graph.node
    )
    shapes = inferred_shapes(result) if needs_shapes else {}
    for node in result.graph.node:
        if _same_padded(node):
            _explicit_pads(node, shapes)
    ed = GraphEditor(result.graph, "orttrainer/conv_grad")
    opset = default_opset(result)
    nodes: list[onnx.NodeProto] = []
    for node in list(result.graph.node):
        if not _grouped(node):
            nodes.append(node)
            continue
        start = len(ed.graph.node)
        if _spatial_rank(node) == 1:
            _as_two_dimensional(ed, node, opset)
        else:
            _per_group(ed, node, opset)
        nodes.extend(ed.graph.node[start:])
        del ed.graph.node[start:]
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    return result


def _is_conv_grad(node: onnx.NodeProto) -> bool:
    return node.op_type == "ConvGrad" and node.domain == "com.microsoft"


def _same_padded(node: onnx.NodeProto) -> bool:
    return _is_conv_grad(node) and _auto_pad(node) in ("SAME_UPPER", "SAME_LOWER")


def _grouped(node: onnx.NodeProto) -> bool:
    return (
        _is_conv_grad(node)
        and _attribute(node, "group", 1) > 1
        and bool(node.output[:1] and node.output[0])
        and _spatial_rank(node) != 2
    )


def _auto_pad(node: onnx.NodeProto) -> str:
    value = _attribute(node, "auto_pad", "NOTSET")
    return value.decode() if isinstance(value, bytes) else str(value)


def _strided(node: onnx.NodeProto) -> bool:
    return any(s != 1 for s in _attribute(node, "strides", []) or [])


def _explicit_pads(node: onnx.NodeProto, shapes: dict) -> None:
    """Rule 1, in place: the pads `auto_pad` stands for, `auto_pad` NOTSET."""
    kernel = list(_attribute(node, "kernel_shape", None) or _weight_kernel(node, shapes))
    rank = len(kernel)
    strides = list(_attribute(node, "strides", None) or [1] * rank)
    dilations = list(_attribute(node, "dilations", None) or [1] * rank)
    sizes = shapes.get(node.input[1], (0, ()))[1][2:] if _strided(node) else (None,) * rank
    begins, ends = [], []
    for axis in range(rank):
        extent = (kernel[axis] - 1) * dilations[axis] + 1
        if strides[axis] == 1:
            total = extent - 1
        elif axis < len(sizes) and isinstance(sizes[axis], int):
            size = sizes[axis]
            total = max((math.ceil(size / strides[axis]) - 1) * strides[axis] + extent - size, 0)
        else:
            raise RuntimeError(
                f"ConvGrad node {node.name!r} has auto_pad {_auto_pad(node)} and strides {strides}, and the size of "
                "its input's spatial axes is not known before the first run: ONNX Runtime's CPU kernel ignores "
                "auto_pad, and its pads cannot be written without that size. Give the model's inputs fixed spatial "
                "sizes, or train it with the torch gradient builder (options _internal_use.gradient_builder='torch')"
            )
        small, large = total // 2, total - total // 2
        begins.append(small if _auto_pad(node) == "SAME_UPPER" else large)
        ends.append(large if _auto_pad(node) == "SAME_UPPER" else small)
    kept = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute("pads", begins + ends)])


def _weight_kernel(node: onnx.NodeProto, shapes: dict) -> list[int]:
    dims = shapes.get(node.input[2], (0, ()))[1][2:]
    if not dims or not all(isinstance(d, int) for d in dims):
        raise RuntimeError(f"ConvGrad node {node.name!r} has auto_pad SAME and no kernel_shape or known weight shape")
    return [int(d) for d in dims]


def _spatial_rank(node: onnx.NodeProto) -> int:
    """The spatial rank from the attributes ONNX Runtime's gradient builder always writes (kernel_shape, strides)."""
    for name in ("kernel_shape", "strides", "dilations"):
        value = _attribute(node, name, None)
        if value:
            return len(value)
    pads = _attribute(node, "pads", None)
    return len(pads) // 2 if pads else 2  # unknown: left unchanged


def _attribute(node: onnx.NodeProto, name: str, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _three_outputs(node: onnx.NodeProto) -> list[str]:
    """dX, dW and dB, "" for each one the node does not name."""
    return list(node.output) + [""] * (3 - len(node.output))


def _as_two_dimensional(ed: GraphEditor, node: onnx.NodeProto, opset: int) -> None:
    dy, x, w = (_with_unit_axis(ed, "Unsqueeze", name, opset) for name in node.input)
    attributes = _attributes(node)
    for name in ("kernel_shape", "strides", "dilations"):
        if name in attributes:
            attributes[name] = [1, *attributes[name]]
    if "pads" in attributes:
        begin, end = attributes["pads"]
        attributes["pads"] = [0, begin, 0, end]
    dx, dw, db = _three_outputs(node)
    planar = ed.op_outputs(
        "ConvGrad",
        [dy, x, w],
        "conv_grad_2d",
        [ed.fresh("dX_2d"), ed.fresh("dW_2d") if dw else "", db],
        domain="com.microsoft",
        **attributes,
    )
    _with_unit_axis(ed, "Squeeze", planar[0], opset, output=dx)
    if dw:
        _with_unit_axis(ed, "Squeeze", planar[1], opset, output=dw)


def _with_unit_axis(ed: GraphEditor, op: str, name: str, opset: int, output: str | None = None) -> str:
    """`Unsqueeze` or `Squeeze` of axis 2, in the form of the model's opset."""
    outputs = None if output is None else [output]
    if opset >= _AXES_AS_INPUT:
        return ed.op(op, [name, ed.constant([2], dtype="int64", hint="axis_2")], op.lower(), outputs)
    return ed.op(op, [name], op.lower(), outputs, axes=[2])


def _per_group(ed: GraphEditor, node: onnx.NodeProto, opset: int) -> None:
    groups = _attribute(node, "group", 1)
    dy, x, w = (_split(ed, name, 0 if i == 2 else 1, groups, opset) for i, name in enumerate(node.input))
    attributes = _attributes(node) | {"group": 1}
    outputs = _three_outputs(node)
    parts: list[list[str]] = [[], [], []]
    for g in range(groups):
        wanted = [
            ed.fresh(f"{kind}_group{g}") if name else "" for kind, name in zip(("dX", "dW", "dB"), outputs, strict=True)
        ]
        found = ed.op_outputs(
            "ConvGrad", [dy[g], x[g], w[g]], f"conv_grad_group{g}", wanted, domain="com.microsoft", **attributes
        )
        for i, name in enumerate(found):
            if name:
                parts[i].append(name)
    for i, (name, axis) in enumerate(zip(outputs, (1, 0, 0), strict=True)):
        if name:
            ed.op("Concat", parts[i], "concat", [name], axis=axis)


def _split(ed: GraphEditor, name: str, axis: int, parts: int, opset: int) -> list[str]:
    """`name` split into `parts` equal parts along `axis`."""
    if opset >= _SPLIT_NUM_OUTPUTS:
        return ed.op_outputs("Split", [name], "split", parts, axis=axis, num_outputs=parts)
    return ed.op_outputs("Split", [name], "split", parts, axis=axis)


def _conv_grad_problem(model: onnx.ModelProto) -> Problem:
    for node in model.graph.node:
        if (_same_padded(node) or _grouped(node)) and (len(node.input) != 3 or not all(node.input)):
            return f"ConvGrad node {node.name!r} needs three named inputs (dY, X, W)"
    return None


CONV_GRAD_IN_SAFE_FORM = FunctionPass("conv_grad_in_safe_form", conv_grad_in_safe_form, _conv_grad_problem)
