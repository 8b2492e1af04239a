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

Each function checks its precondition first (`PassPreconditionError`) and leaves its argument untouched; the
`*_pass` functions and `CAST_FP32_ONLY_KERNELS` are the same passes as `passes.FunctionPass` objects.
"""

from __future__ import annotations

import warnings
from functools import partial

import onnx
from onnx import TensorProto, helper

from .editor import GraphEditor, copy_model, raise_opset, raise_opset_problem, topologically_sorted
from .passes import FunctionPass, Problem, first_result, require

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


def to_float16(model: onnx.ModelProto, keep_float32: list[str], block: tuple[str, ...] = ()) -> onnx.ModelProto:
    """Rule 1 above. Inputs/outputs in `keep_float32` stay float32, and so do the ops in `block` besides
    `FLOAT32_OPS`; the argument is not modified.

    Precondition: no name in `keep_float32` is an initializer: the converter keeps only graph inputs and outputs
    float32, so that initializer would silently become float16 (`move_initializers_to_inputs` first)."""
    require("to_float16", _keep_float32_problem(model, keep_float32))
    from onnxruntime.transformers import float16

    blocked = list(dict.fromkeys([*float16.DEFAULT_OP_BLOCK_LIST, *FLOAT32_OPS, *block]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the converter warns about values clamped to the fp16 range
        converted = float16.convert_float_to_float16(
            copy_model(model), keep_io_types=list(keep_float32), op_block_list=blocked
        )
    return topologically_sorted(converted)


def _keep_float32_problem(model: onnx.ModelProto, keep_float32: list[str]) -> Problem:
    constants = sorted({i.name for i in model.graph.initializer} & set(keep_float32))
    return f"float32 tensors {constants} are initializers, not graph inputs" if constants else None


def to_float16_pass(keep_float32: list[str]) -> FunctionPass:
    return FunctionPass(
        "to_float16",
        partial(to_float16, keep_float32=list(keep_float32)),
        partial(_keep_float32_problem, keep_float32=list(keep_float32)),
    )


def append_loss_scale(model: onnx.ModelProto, loss: str) -> tuple[onnx.ModelProto, str, str]:
    """Rule 2: returns (model, scaled loss name, loss-scale input name). The scaled loss becomes a graph output
    (the gradient builder seeds its gradient there); the caller removes it once gradients are built. The input is
    appended after the other graph inputs and the output after the other graph outputs (`loss_scale_names`).

    Precondition: `loss` is a float32 graph output."""
    require("append_loss_scale", _loss_problem(model, loss))
    result = copy_model(model)
    ed = GraphEditor(result.graph, "orttrainer/amp")
    scale = ed.unused(LOSS_SCALE_INPUT)
    result.graph.input.append(helper.make_tensor_value_info(scale, TensorProto.FLOAT, []))
    scaled = ed.op("Mul", [loss, scale], f"{loss}_scaled")
    ed.add_output(scaled, TensorProto.FLOAT, [])
    return result, scaled, scale


def _loss_problem(model: onnx.ModelProto, loss: str) -> Problem:
    output = next((o for o in model.graph.output if o.name == loss), None)
    if output is None:
        return f"the loss {loss!r} is not a graph output"
    if output.type.tensor_type.elem_type != TensorProto.FLOAT:
        return f"the loss {loss!r} is not a float32 tensor (to_float16 keeps it float32)"
    return None


def append_loss_scale_pass(loss: str) -> FunctionPass:
    """`append_loss_scale` as a pass; read the names it added with `loss_scale_names`."""
    return FunctionPass(
        "append_loss_scale", first_result(append_loss_scale, loss=loss), partial(_loss_problem, loss=loss)
    )


def loss_scale_names(model: onnx.ModelProto) -> tuple[str, str]:
    """(scaled loss, loss-scale input) of a model `append_loss_scale` made: its last graph output and input."""
    return model.graph.output[-1].name, model.graph.input[-1].name


def cast_fp32_only_kernels(
    model: onnx.ModelProto, op_types: tuple[str, ...] = FP32_ONLY_CPU_KERNELS
) -> onnx.ModelProto:
    """Rule 3: `y = K(g, ...)` becomes `y = CastLike(K(Cast(g, float), ...), g)` for op types in `op_types`.

    Precondition: where such nodes exist, each has a named data input and first output, and the default-domain
    opset is 15 or can be raised to 15 (`CastLike`) without changing the meaning of a node."""
    if not any(n.op_type in op_types for n in model.graph.node):
        return model
    require("cast_fp32_only_kernels", _kernels_problem(model, op_types))
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


def _kernels_problem(model: onnx.ModelProto, op_types: tuple[str, ...] = FP32_ONLY_CPU_KERNELS) -> Problem:
    nodes = [n for n in model.graph.node if n.op_type in op_types]
    if not nodes:
        return None
    unnamed = [n.name or n.op_type for n in nodes if not (n.input and n.input[0] and n.output and n.output[0])]
    if unnamed:
        return f"nodes {unnamed} lack a named data input or output"
    return raise_opset_problem(model, 15)


CAST_FP32_ONLY_KERNELS = FunctionPass("cast_fp32_only_kernels", cast_fp32_only_kernels, _kernels_problem)
