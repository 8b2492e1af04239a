"""Mixed precision: the forward and backward pass run in float16, the optimizer on float32 master weights.

Three passes, applied in this order by the compiler:

1. `to_float16(model, keep_float32)`: every float tensor becomes float16, except
   - the graph inputs and outputs named in `keep_float32` (the master weights, data inputs and the loss): each such
     input is cast to float16 where it is consumed, so its gradient comes back through the cast's gradient in
     float32 — the master weights' gradients are float32;
   - the inputs and outputs of the loss-sensitive ops in `FLOAT32_OPS`, which run in float32 between casts. As the
     original's mixed-precision transformer kept its loss subgraph in float32, so does this: softmax cross-entropy
     and NLL (the loss itself, and the log-probabilities), LayerNormalization and the reductions and powers a
     decomposed layer norm (opset < 17) is made of — mean and variance of fp16 activations lose too much precision
     and overflow easily, and the loss and its reductions must not underflow.
   It uses ONNX Runtime's own float16 converter (`onnxruntime.transformers.float16`) and re-sorts the graph.
2. `append_loss_scale(model, loss)`: `scaled_loss = loss · loss_scale` (float32); gradients are built from the scaled
   loss, so small fp16 gradients do not underflow; the training graph divides by the scale again in float32.
3. `cast_fp32_only_kernels(model)` (after the gradient graph): a few ONNX Runtime CPU kernels declare float16 support
   but implement only float/double (SliceGrad fails with "Type for T or Tind not supported yet"), so ONNX Runtime
   does not wrap them in casts itself. Each such node gets `Cast(to=float)` on its data input and a `CastLike` of
   its output back to the input's original type — a no-op on float32 tensors.
"""

from __future__ import annotations

import warnings

import onnx
from onnx import TensorProto, helper

from .editor import GraphEditor, copy_model, raise_opset, topologically_sorted

FLOAT32_OPS = (
    "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss",
    "LogSoftmax",
    "LayerNormalization",
    "ReduceMean",
    "ReduceSum",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceProd",
    "Pow",
    "Sqrt",
)
FP32_ONLY_CPU_KERNELS = ("SliceGrad",)  # data input 0 is the gradient
LOSS_SCALE_INPUT = "loss_scale"


def to_float16(model: onnx.ModelProto, keep_float32: list[str]) -> onnx.ModelProto:
    """Rule 1 above. Inputs/outputs in `keep_float32` stay float32; the argument is not modified."""
    from onnxruntime.transformers import float16

    blocked = list(dict.fromkeys([*float16.DEFAULT_OP_BLOCK_LIST, *FLOAT32_OPS]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the converter warns about values clamped to the fp16 range
        converted = float16.convert_float_to_float16(
            copy_model(model), keep_io_types=list(keep_float32), op_block_list=blocked
        )
    return topologically_sorted(converted)


def append_loss_scale(model: onnx.ModelProto, loss: str) -> tuple[onnx.ModelProto, str, str]:
    """Rule 2: returns (model, scaled loss name, loss-scale input name). The scaled loss becomes a graph output
    (the gradient builder seeds its gradient there); the caller removes it once gradients are built."""
    result = copy_model(model)
    ed = GraphEditor(result.graph, "orttrainer/amp")
    scale = ed.unused(LOSS_SCALE_INPUT)
    result.graph.input.append(helper.make_tensor_value_info(scale, TensorProto.FLOAT, []))
    scaled = ed.op("Mul", [loss, scale], f"{loss}_scaled")
    ed.add_output(scaled, TensorProto.FLOAT, [])
    return result, scaled, scale


def cast_fp32_only_kernels(
    model: onnx.ModelProto, op_types: tuple[str, ...] = FP32_ONLY_CPU_KERNELS
) -> onnx.ModelProto:
    """Rule 3: `y = K(g, ...)` becomes `y = CastLike(K(Cast(g, float), ...), g)` for op types in `op_types`."""
    if not any(n.op_type in op_types for n in model.graph.node):
        return model
    result = copy_model(model)
    ed = GraphEditor(result.graph, "orttrainer/amp_cpu")
    nodes = []
    for node in list(result.graph.node):
        if node.op_type not in op_types:
            nodes.append(node)
            continue
        grad, output = node.input[0], node.output[0]
        grad_f32, output_f32 = ed.fresh(f"{grad}_f32"), ed.fresh(f"{output}_f32")
        nodes.append(
            helper.make_node("Cast", [grad], [grad_f32], name=ed.fresh(f"{node.name}_cast_in"), to=TensorProto.FLOAT)
        )
        node.input[0], node.output[0] = grad_f32, output_f32
        nodes.append(node)
        nodes.append(helper.make_node("CastLike", [output_f32, grad], [output], name=ed.fresh(f"{node.name}_cast_out")))
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    raise_opset(result, 15)  # CastLike
    return result
