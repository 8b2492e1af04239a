"""Graph fix-ups that ONNX Runtime's gradient builder and the eval graph need.

Each function is a pure pass: it takes a ModelProto and returns a new one, leaving its argument untouched.
"""

from __future__ import annotations

import onnx
from onnx import helper

from .editor import copy_model, fresh_name, graph_value_names

# Optional outputs the ORT gradient builders read (engine.md §0.2): without them the builder fails with
# "GradientBuilderBase::O(size_t, bool) const i < node_->OutputDefs().size() was false".
_REQUIRED_OUTPUT_COUNT = {"SoftmaxCrossEntropyLoss": 2, "LayerNormalization": 3, "Dropout": 2}


def name_optional_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give SoftmaxCrossEntropyLoss 2, LayerNormalization 3 and Dropout 2 named outputs.

    Rule: for each such node with fewer outputs (or empty output names), append/replace the missing ones with fresh
    names `<first output>__extra<k>`. The values are otherwise unused; ORT's gradient builders read them.
    """
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


def dropout_to_identity(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace every Dropout node by an Identity of its data input.

    Rule: `Dropout(x, ratio, training_mode) -> (y, mask)` becomes `Identity(x) -> y`. A Dropout whose mask output is
    consumed by another node cannot be rewritten and raises ValueError.

    Why not `training_mode=False`: ORT's DropoutGrad still scales by 1/(1-p) when training mode is off (engine.md
    §1.4), a silently wrong gradient. Identity is exact, and it is what eval-mode dropout means.
    """
    result = copy_model(model)
    consumed = {name for node in result.graph.node for name in node.input}
    graph_outputs = {o.name for o in result.graph.output}
    for node in result.graph.node:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        mask = node.output[1] if len(node.output) > 1 else ""
        if mask and (mask in consumed or mask in graph_outputs):
            raise ValueError(f"Dropout node {node.name!r}: its mask output {mask!r} is used, cannot disable dropout")
        rewritten = helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)
        node.CopyFrom(rewritten)
    return result


def batchnorm_to_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """Turn training-mode BatchNormalization nodes into inference-mode ones (running statistics, one output).

    Rule: `training_mode=1` -> `0`, and the running-statistics outputs are dropped (inference-mode BatchNormalization
    has exactly one output). Used for the eval graph only; training keeps batch statistics.
    """
    result = copy_model(model)
    for node in result.graph.node:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        kept = [a for a in node.attribute if a.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend(kept)
        del node.output[1:]
    return result
