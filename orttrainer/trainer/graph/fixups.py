"""Graph fix-ups that ONNX Runtime's gradient builder and the eval graph need.

Each function is a pure pass: it checks its precondition (`PassPreconditionError`), then returns a new model (or its
argument, when nothing applies) and leaves its argument untouched. The upper-case names are the same passes as
`passes.FunctionPass` objects, for `passes.run_passes`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import helper

from .editor import GraphEditor, copy_model, fresh_name, graph_value_names, topologically_sorted
from .passes import FunctionPass, Problem, graph_output_names, opset_below, require

# Optional outputs the ORT gradient builders read (docs/engine.md §0.2): without them the builder fails with
# "GradientBuilderBase::O(size_t, bool) const i < node_->OutputDefs().size() was false".
_REQUIRED_OUTPUT_COUNT = {"SoftmaxCrossEntropyLoss": 2, "LayerNormalization": 3, "Dropout": 2}


def name_optional_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give SoftmaxCrossEntropyLoss 2, LayerNormalization 3 and Dropout 2 named outputs.

    Rule: for each such node with fewer outputs (or empty output names), append/replace the missing ones with fresh
    names `<first output>__extra<k>`. The values are otherwise unused; ORT's gradient builders read them.

    Precondition: each such node has a named first output (the new names are made from it).
    """
    require("name_optional_outputs", _unnamed_first_output(model))
    result = copy_model(model)
    taken = graph_value_names(result.graph)
    for node in result.graph.node:
        wanted = _REQUIRED_OUTPUT_COUNT.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if wanted is None:
            continue
        for k in range(wanted):
            if k < len(node.output) and node.output[k]:
                continue
            name = fresh_name(f"{node.output[0]}__extra{k}", taken)
            if k < len(node.output):
                node.output[k] = name
            else:
                node.output.append(name)
    return result


def _unnamed_first_output(model: onnx.ModelProto) -> Problem:
    for node in model.graph.node:
        wanted = node.op_type in _REQUIRED_OUTPUT_COUNT and node.domain in ("", "ai.onnx")
        if wanted and (not node.output or not node.output[0]):
            return f"{node.op_type} node {node.name!r} has no named first output"
    return None


def dropout_to_identity(model: onnx.ModelProto, only: set[int] | None = None) -> onnx.ModelProto:
    """Replace every Dropout node (or those at the node indices in `only`) by an Identity of its data input.

    Rule: `Dropout(x, ratio, training_mode) -> (y, mask)` becomes `Identity(x) -> y`.

    Why not `training_mode=False`: ORT's DropoutGrad still scales by 1/(1-p) when training mode is off (docs/engine.md
    §1.4), a silently wrong gradient. Identity is exact, and it is what eval-mode dropout means.

    Precondition: the mask output of no rewritten Dropout is read by a node or is a graph output (it could not be
    rewritten), and each index in `only` is that of a Dropout node.
    """
    require("dropout_to_identity", _dropout_problem(model, only))
    result = copy_model(model)
    for i, node in enumerate(result.graph.node):
        if not _is_dropout(node) or (only is not None and i not in only):
            continue
        rewritten = helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)
        node.CopyFrom(rewritten)
    return result


def _is_dropout(node: onnx.NodeProto) -> bool:
    return node.op_type == "Dropout" and node.domain in ("", "ai.onnx")


def _dropout_problem(model: onnx.ModelProto, only: set[int] | None) -> Problem:
    """A Dropout (of `only`) whose mask is read, or an index in `only` that is not a Dropout node."""
    nodes = model.graph.node
    strays = sorted(i for i in only or () if not 0 <= i < len(nodes) or not _is_dropout(nodes[i]))
    if strays:
        return f"node indices {strays} are not Dropout nodes"
    used = {name for node in nodes for name in node.input} | graph_output_names(model)
    for i, node in enumerate(nodes):
        mask = node.output[1] if _is_dropout(node) and len(node.output) > 1 else ""
        if mask in used and mask and (only is None or i in only):
            return f"Dropout node {node.name!r}: its mask output {mask!r} is used, cannot disable dropout"
    return None


def restore_dropout_training_mode(model: onnx.ModelProto) -> onnx.ModelProto:
    """For a PyTorch module exported in training mode: give every Dropout without a `training_mode` input a constant
    true one.

    Why: PyTorch's TorchScript exporter writes the dropout of `scaled_dot_product_attention` (used by
    `nn.MultiheadAttention`, so by every `nn.TransformerEncoderLayer`) as `Dropout(x, ratio)` without the flag, which
    ONNX runs as the identity — while PyTorch applies that dropout in training, and ORT's DropoutGrad still scales
    its gradient by 1/(1-ratio) (docs/engine.md §1.4). With the flag the graph does what PyTorch does. Dropouts the
    exporter writes for `nn.Dropout` carry the flag already; eval-mode dropout is not exported at all.

    Precondition: where a Dropout lacks the flag, the default-domain opset is at least 12 (the flag's input).
    """
    missing = _inference_dropouts(model)
    if not missing:
        return model
    require("restore_dropout_training_mode", _training_mode_problem(model))
    result = copy_model(model)
    flag = fresh_name("orttrainer/dropout_training_mode", graph_value_names(result.graph))
    result.graph.initializer.append(onnx.numpy_helper.from_array(np.array(True), flag))
    for i in missing:
        node = result.graph.node[i]
        del node.input[2:]
        node.input.extend([""] * (2 - len(node.input)) + [flag])
    return result


def _training_mode_problem(model: onnx.ModelProto) -> Problem:
    if not _inference_dropouts(model):
        return None
    return opset_below(model, 12, "Dropout's training_mode input")


def inference_dropout_to_identity(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rule: a Dropout without a `training_mode` input (the ONNX default: off) becomes an Identity, which is what it
    computes; ORT's DropoutGrad would still scale its gradient by 1/(1-ratio) (docs/engine.md §1.4).

    Precondition: the mask output of no such Dropout is read."""
    missing = _inference_dropouts(model)
    return dropout_to_identity(model, only=set(missing)) if missing else model


def _inference_mask_problem(model: onnx.ModelProto) -> Problem:
    return _dropout_problem(model, set(_inference_dropouts(model)))


def _inference_dropouts(model: onnx.ModelProto) -> list[int]:
    return [i for i, n in enumerate(model.graph.node) if _is_dropout(n) and (len(n.input) < 3 or not n.input[2])]


def batchnorm_to_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """Turn training-mode BatchNormalization nodes into inference-mode ones (running statistics, one output).

    Rule: `training_mode=1` -> `0`, and the running-statistics outputs are dropped (inference-mode BatchNormalization
    has exactly one output). Used for the eval graph only; training keeps batch statistics.

    Precondition: no node and no graph output reads the dropped running-statistics outputs.
    """
    require("batchnorm_to_inference", _read_extra_output(model, _is_batchnorm))
    result = copy_model(model)
    for node in result.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        kept = [a for a in node.attribute if a.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend(kept)
        del node.output[1:]
    return result


def _is_batchnorm(node: onnx.NodeProto) -> bool:
    return node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")


def _read_extra_output(model: onnx.ModelProto, selected: Callable[[onnx.NodeProto], bool]) -> Problem:
    """An output after the first of a `selected` node that a node or the graph output reads."""
    used = {name for node in model.graph.node for name in node.input} | graph_output_names(model)
    for node in model.graph.node:
        read = [name for name in node.output[1:] if name and name in used]
        if read and selected(node):
            return f"{node.op_type} node {node.name!r}: its output {read[0]!r} is read, but the rewrite drops it"
    return None


def inference_batchnorm_to_affine(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite every inference-mode BatchNormalization as the per-channel affine map it computes, for ONNX Runtime's
    gradient builder.

    Rule: `BatchNormalization(X, scale, B, mean, var)` with `training_mode` absent or 0 becomes
    `Y = X * a + b`, `a = scale / sqrt(var + epsilon)`, `b = B - mean * a`, with `a` and `b` reshaped to
    `[C, 1, ..., 1]` (rank(X) - 2 ones, computed in the graph, so any input rank and dynamic dims work).
    Training-mode nodes are left alone.

    Why: ONNX Runtime differentiates an inference-mode BatchNormalization with `BatchNormalizationGrad`, which uses
    the batch statistics, so the gradients are wrong (by 0.1-0.3, docs/engine.md §1.4); the affine form has exact
    gradients for `scale` and `B` (and `X`), and the running statistics are constants of the step, as in PyTorch.

    Precondition: each such node has its five inputs, and no node or graph output reads its other outputs (opsets
    before 14 have no `training_mode`: a node with used statistics outputs there is a training one).
    """
    if not any(_is_inference_batchnorm(n) for n in model.graph.node):
        return model
    require("inference_batchnorm_to_affine", _affine_problem(model))
    result = copy_model(model)
    replaced = [n for n in result.graph.node if _is_inference_batchnorm(n)]
    kept = [n for n in result.graph.node if not _is_inference_batchnorm(n)]
    del result.graph.node[:]
    result.graph.node.extend(kept)
    ed = GraphEditor(result.graph, "orttrainer/batchnorm_affine")
    for node in replaced:
        _append_affine(ed, node)
    return topologically_sorted(result)


def _is_inference_batchnorm(node: onnx.NodeProto) -> bool:
    if not _is_batchnorm(node):
        return False
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return not attributes.get("training_mode", 0)


def _affine_problem(model: onnx.ModelProto) -> Problem:
    for node in model.graph.node:
        if _is_inference_batchnorm(node) and (len(node.input) < 5 or not all(node.input[:5])):
            return f"BatchNormalization node {node.name!r} lacks some of its inputs X, scale, B, mean, var"
    return _read_extra_output(model, _is_inference_batchnorm)


def _append_affine(ed: GraphEditor, node: onnx.NodeProto) -> None:
    """`Y = X * a + b` for one inference-mode BatchNormalization `node` (see `inference_batchnorm_to_affine`)."""
    x, scale, bias, mean, var = node.input[:5]
    epsilon = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"), 1e-5)
    hint = (node.name or node.output[0]).strip("/")
    # float32 constants: the pass runs on the float32 forward, before any float16 conversion
    std = ed.op("Sqrt", [ed.op("Add", [var, ed.constant(epsilon, hint="epsilon")], f"{hint}/var_eps")], f"{hint}/std")
    a = ed.op("Div", [scale, std], f"{hint}/a")
    b = ed.op("Sub", [bias, ed.op("Mul", [mean, a], f"{hint}/mean_a")], f"{hint}/b")
    rank = ed.op("Size", [ed.op("Shape", [x], f"{hint}/x_shape")], f"{hint}/rank")
    spatial_rank = ed.op("Sub", [rank, ed.constant(2, np.int64, "two")], f"{hint}/spatial_rank")
    spatial_rank_1d = ed.op("Reshape", [spatial_rank, ed.constant([1], np.int64, "one_dim")], f"{hint}/spatial_1d")
    ones = ed.op(
        "ConstantOfShape",
        [spatial_rank_1d],
        f"{hint}/ones",
        value=helper.make_tensor("one", onnx.TensorProto.INT64, [1], [1]),
    )
    channel_shape = ed.op(
        "Concat", [ed.op("Shape", [scale], f"{hint}/channels"), ones], f"{hint}/channel_shape", axis=0
    )
    scaled = ed.op("Mul", [x, ed.op("Reshape", [a, channel_shape], f"{hint}/a_channels")], f"{hint}/scaled")
    ed.op(
        "Add",
        [scaled, ed.op("Reshape", [b, channel_shape], f"{hint}/b_channels")],
        f"{hint}/y",
        outputs=[node.output[0]],
    )


NAME_OPTIONAL_OUTPUTS = FunctionPass("name_optional_outputs", name_optional_outputs, _unnamed_first_output)
DROPOUT_TO_IDENTITY = FunctionPass("dropout_to_identity", dropout_to_identity, partial(_dropout_problem, only=None))
RESTORE_DROPOUT_TRAINING_MODE = FunctionPass(
    "restore_dropout_training_mode", restore_dropout_training_mode, _training_mode_problem
)
INFERENCE_DROPOUT_TO_IDENTITY = FunctionPass(
    "inference_dropout_to_identity", inference_dropout_to_identity, _inference_mask_problem
)
BATCHNORM_TO_INFERENCE = FunctionPass(
    "batchnorm_to_inference", batchnorm_to_inference, partial(_read_extra_output, selected=_is_batchnorm)
)
INFERENCE_BATCHNORM_TO_AFFINE = FunctionPass(
    "inference_batchnorm_to_affine", inference_batchnorm_to_affine, _affine_problem
)
