"""Convolutions in ONNX Runtime's blocked channel layout (NCHWc), for weights that are not constants.

ONNX Runtime's CPU provider has convolution kernels for a channels-blocked layout — the channels cut into blocks of
8 (AVX2) or 16 (AVX-512) values stored together — in its `com.microsoft.nchwc` domain, 1.3–1.45× faster than its
plain `Conv` on the benchmark CNN's layers (docs/engine.md §21). Its own optimiser moves a `Conv` there only when the
weight is a constant, since it reorders the weight once, while optimising: in a training graph the weights are
inputs, so no convolution ever got the blocked kernels. This pass writes the reorder into the graph instead, where
it costs a copy of the (small) weight per run.

Rule (`blocked_convolutions(model, block)`): a `Conv` of the default domain whose weight W shape inference gives as
float32 [O, C, kh, kw] (so the input X is [N, C, H, W]), with `group` 1, no `auto_pad`, and C and O multiples of
`block`, becomes

    ReorderOutput(nchwc.Conv(ReorderInput(X), W', B), channels=O)

with the same pads, strides, dilations and kernel shape, where W' is W in ONNX Runtime's blocked filter layout
(OIHWBiBo: `Reshape(Transpose(Reshape(W, [O/b, b, C/b, b, kh, kw]), [0, 2, 4, 5, 3, 1]), [O, C, kh, kw])`, b = `block`).
A `ConvTranspose` with strides 1 (an input's gradient, gradient/torch_decompositions.py), `group` 1, no `auto_pad`,
`output_padding` or `output_shape`, pads p at most d·(k - 1) and whole blocks of channels is the same as a `Conv` of its
input with its weight [C, O, kh, kw] read as [O, C, kh, kw] and reversed along kh and kw, pads d·(k - 1) - p and the
same dilations d; it becomes that `Conv`, blocked (the reversal a `Slice` with step -1 of the weight, the swap folded
into the reorder's transpose). `block` must be ONNX Runtime's block size on the machine that runs the graph
(`runtime/ort.nchwc_block`): the layout depends on it, so the pass runs when a session is created, not into the compile
cache. The results are the same convolution, summed in another order.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from .editor import GraphEditor, copy_model, inferred_shapes

NCHWC_DOMAIN = "com.microsoft.nchwc"


def blocked_convolutions(model: onnx.ModelProto, block: int) -> onnx.ModelProto:
    """Apply the rule above; returns a new model, or `model` itself when no convolution qualifies."""
    if not any(_is_conv(node) or _is_conv_transpose(node) for node in model.graph.node):
        return model
    shapes = inferred_shapes(model)
    weights = {
        node.output[0]: weight
        for node in model.graph.node
        if _is_conv(node) and (weight := _blocked_shape(node, shapes, block)) is not None
    }
    weights |= {
        node.output[0]: weight
        for node in model.graph.node
        if _is_conv_transpose(node) and (weight := _transposed_shape(node, shapes, block)) is not None
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
        if node.op_type == "ConvTranspose":
            _write_transposed(editor, node, weight, block)
        else:
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


def _write_transposed(editor: GraphEditor, conv: onnx.NodeProto, weight: tuple[int, int, int, int], block: int) -> None:
    """Append the blocked `Conv` that computes the stride-1 `conv` (a ConvTranspose; `weight`: its [C, O, kh, kw])."""
    in_channels, out_channels, kh, kw = weight
    attributes = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
    dilations = list(attributes.get("dilations", [1, 1]))
    pads = list(attributes.get("pads", [0, 0, 0, 0]))
    reach = [d * (k - 1) for d, k in zip(dilations, (kh, kw), strict=True)]
    flipped = editor.op(
        "Slice",
        [
            conv.input[1],
            editor.constant([-1, -1], dtype=np.int64, hint="last"),
            editor.constant([-(2**62), -(2**62)], dtype=np.int64, hint="before_first"),
            editor.constant([2, 3], dtype=np.int64, hint="spatial_axes"),
            editor.constant([-1, -1], dtype=np.int64, hint="backwards"),
        ],
        "weight_reversed",
    )
    blocked = [in_channels // block, block, out_channels // block, block, kh, kw]
    w = editor.op("Reshape", [flipped, editor.constant(blocked, dtype=np.int64, hint="blocks")], "weight_blocks")
    w = editor.op("Transpose", [w], "weight_order", perm=[2, 0, 4, 5, 1, 3])
    shape = [out_channels, in_channels, kh, kw]
    w = editor.op("Reshape", [w, editor.constant(shape, dtype=np.int64, hint="weight_shape")], "weight")
    x = editor.op("ReorderInput", [conv.input[0]], "input", domain=NCHWC_DOMAIN, channels_last=0)
    conv_pads = [reach[i % 2] - p for i, p in enumerate(pads)]
    y = editor.op(
        "Conv",
        [x, w, *conv.input[2:3]],
        "conv",
        domain=NCHWC_DOMAIN,
        pads=conv_pads,
        dilations=dilations,
        kernel_shape=[kh, kw],
        group=1,
    )
    editor.op("ReorderOutput", [y], "output", outputs=[conv.output[0]], domain=NCHWC_DOMAIN, channels=out_channels)


def _is_conv(node: onnx.NodeProto) -> bool:
    return node.op_type == "Conv" and node.domain in ("", "ai.onnx") and len(node.input) >= 2


def _blocked_shape(node: onnx.NodeProto, shapes: dict, block: int) -> tuple[int, int, int, int] | None:
    """W's [O, C, kh, kw] when `node` qualifies for the rule, else None."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attributes.get("group", 1) != 1 or attributes.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    weight = _float32_kernel(shapes.get(node.input[1]))
    if weight is None or weight[0] % block or weight[1] % block:
        return None
    return weight


def _is_conv_transpose(node: onnx.NodeProto) -> bool:
    return node.op_type == "ConvTranspose" and node.domain in ("", "ai.onnx") and len(node.input) >= 2


def _transposed_shape(node: onnx.NodeProto, shapes: dict, block: int) -> tuple[int, int, int, int] | None:
    """W's [C, O, kh, kw] when the ConvTranspose `node` qualifies for the rule, else None."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if any(name in attributes for name in ("output_shape", "auto_pad")) or attributes.get("group", 1) != 1:
        return None
    if any(s != 1 for s in attributes.get("strides", [1, 1])) or any(attributes.get("output_padding", [0, 0])):
        return None
    weight = _float32_kernel(shapes.get(node.input[1]))
    if weight is None or weight[0] % block or weight[1] % block:
        return None
    in_channels, out_channels, kh, kw = weight
    dilations = list(attributes.get("dilations", [1, 1]))
    reach = [d * (k - 1) for d, k in zip(dilations, (kh, kw), strict=True)]
    if any(p > reach[i % 2] for i, p in enumerate(attributes.get("pads", [0, 0, 0, 0]))):
        return None
    return in_channels, out_channels, kh, kw


def _float32_kernel(weight: tuple[int, tuple] | None) -> tuple[int, int, int, int] | None:
    """The dims of a float32 2-D convolution's weight of known shape (the input's rank, channels and type follow from
    it: ONNX's `Conv` and `ConvTranspose` require them to match), else None."""
    if weight is None or weight[0] != TensorProto.FLOAT or len(weight[1]) != 4:
        return None
    dims = [d for d in weight[1] if isinstance(d, int)]
    if len(dims) != 4:
        return None
    return dims[0], dims[1], dims[2], dims[3]
