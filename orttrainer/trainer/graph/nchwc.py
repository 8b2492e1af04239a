"""Convolutions in ONNX Runtime's blocked channel layout (NCHWc), for weights that are not constants.

ONNX Runtime's CPU provider has convolution kernels for a channels-blocked layout — the channels cut into blocks of
8 (AVX2) or 16 (AVX-512) values stored together — in its `com.microsoft.nchwc` domain, 1.3–1.45× faster than its
plain `Conv` on the benchmark CNN's layers (docs/engine.md §21). Its own optimiser moves a `Conv` there only when the
weight is a constant, since it reorders the weight once, while optimising: in a training graph the weights are
inputs, so no convolution ever got the blocked kernels. This pass writes the reorder into the graph instead, where
it costs a copy of the (small) weight per run.

Rule (`blocked_convolutions(model, block)`): a `Conv` of the default domain whose input X and weight W shape
inference gives as float32 [N, C, H, W] and [O, C, kh, kw], with `group` 1, no `auto_pad`, and C and O multiples of
`block`, becomes

    ReorderOutput(nchwc.Conv(ReorderInput(X), W', B), channels=O)

with the same pads, strides, dilations and kernel shape, where W' is W in ONNX Runtime's blocked filter layout
(OIHWBiBo: `Reshape(Transpose(Reshape(W, [O/b, b, C/b, b, kh, kw]), [0, 2, 4, 5, 3, 1]), [O, C, kh, kw])`, b =
`block`). `block` must be ONNX Runtime's block size on the machine that runs the graph
(`runtime/ort.nchwc_block`): the layout depends on it, so the pass runs when a session is created, not into the
compile cache. The results are the same convolution, summed in another order.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from .editor import GraphEditor, copy_model, inferred_shapes
from .passes import FunctionPass

NCHWC_DOMAIN = "com.microsoft.nchwc"


def blocked_convolutions(model: onnx.ModelProto, block: int) -> onnx.ModelProto:
    """Apply the rule above; returns a new model, or `model` itself when no convolution qualifies."""
    if not any(_is_conv(node) for node in model.graph.node):
        return model
    shapes = inferred_shapes(model)
    weights = {
        node.output[0]: weight
        for node in model.graph.node
        if _is_conv(node) and (weight := _blocked_shape(node, shapes, block)) is not None
    }
    if not weights:
        return model
    result = copy_model(model)
    graph = result.graph
    editor = GraphEditor(graph, "orttrainer/nchwc")
    nodes: list[onnx.NodeProto] = []
    for node in list(graph.node):
        weight = weights.get(node.output[0]) if node.output else None
        if weight is None:
            nodes.append(node)
            continue
        start = len(graph.node)
        _write_blocked(editor, node, weight, block)
        nodes.extend(graph.node[start:])
        del graph.node[start:]
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == NCHWC_DOMAIN for o in result.opset_import):
        result.opset_import.append(helper.make_opsetid(NCHWC_DOMAIN, 1))
    return result


def _write_blocked(editor: GraphEditor, conv: onnx.NodeProto, weight: tuple[int, int, int, int], block: int) -> None:
    """Append the blocked form of `conv` (writing its output) to the graph."""
    out_channels, in_channels, kh, kw = weight
    blocked = [out_channels // block, block, in_channels // block, block, kh, kw]
    x = editor.op("ReorderInput", [conv.input[0]], "input", domain=NCHWC_DOMAIN, channels_last=0)
    w = editor.op("Reshape", [conv.input[1], editor.constant(blocked, dtype=np.int64, hint="blocks")], "weight_blocks")
    w = editor.op("Transpose", [w], "weight_order", perm=[0, 2, 4, 5, 3, 1])
    w = editor.op("Reshape", [w, editor.constant(list(weight), dtype=np.int64, hint="weight_shape")], "weight")
    attributes = {
        a.name: helper.get_attribute_value(a)
        for a in conv.attribute
        if a.name in ("pads", "strides", "dilations", "kernel_shape", "group")
    }
    y = editor.op("Conv", [x, w, *conv.input[2:3]], "conv", domain=NCHWC_DOMAIN, **attributes)
    editor.op("ReorderOutput", [y], "output", outputs=[conv.output[0]], domain=NCHWC_DOMAIN, channels=out_channels)


def _is_conv(node: onnx.NodeProto) -> bool:
    return node.op_type == "Conv" and node.domain in ("", "ai.onnx") and len(node.input) >= 2


def _blocked_shape(node: onnx.NodeProto, shapes: dict, block: int) -> tuple[int, int, int, int] | None:
    """W's [O, C, kh, kw] when `node` qualifies for the rule, else None."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attributes.get("group", 1) != 1 or attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
    if x is None or w is None or x[0] != TensorProto.FLOAT or w[0] != TensorProto.FLOAT:
        return None
    if len(x[1]) != 4 or len(w[1]) != 4 or not all(isinstance(d, int) for d in w[1]):
        return None
    out_channels, in_channels, kh, kw = (int(d) for d in w[1])
    if out_channels % block or in_channels % block or x[1][1] != in_channels:
        return None
    return out_channels, in_channels, kh, kw


def blocked_convolutions_pass(block: int) -> FunctionPass:
    return FunctionPass("blocked_convolutions", lambda model: blocked_convolutions(model, block))
