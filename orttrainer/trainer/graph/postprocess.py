"""The legacy "internal post-processing" of an exported model (`_internal_use.enable_internal_postprocess`).

The original ran four passes (docs/legacy_api.md §11). Two of them matter for training with current exporters and ORT:

* `name_nodes`: every node gets a unique name, so gradient nodes and error messages can refer to it. The original
  renamed *every* node to `<op_type>_<i>`; this one only names unnamed nodes, because the exporter's names carry the
  module scope (`/encoder/layers.0/self_attn/...`) that recompute and the debug tools use.
* `fuse_log_softmax_nll`: `LogSoftmax -> NegativeLogLikelihoodLoss` becomes one `SoftmaxCrossEntropyLoss`, because
  ORT has no gradient for NegativeLogLikelihoodLoss. The original fused into the contrib op SparseSoftmaxCrossEntropy;
  the standard op has the same value, a CPU kernel and a gradient.

The original's two `fix_expand_shape` passes only added `value_info` hints for PyTorch 1.5 exports; ONNX Runtime's
own shape inference has covered those patterns for years, so they are not repeated.

Both check their precondition first (`PassPreconditionError`) and return a new model; `POSTPROCESS_PASSES` lists
them as `passes.FunctionPass` objects, in order, for `passes.run_passes`.
"""

from __future__ import annotations

import onnx
from onnx import helper

from .editor import copy_model
from .passes import FunctionPass, Problem, first_problem, repeated_output, require


def run_postprocess(model: onnx.ModelProto) -> onnx.ModelProto:
    """Apply the legacy post-processing passes in order; returns a new model."""
    return fuse_log_softmax_nll(name_nodes(model))


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rule: a node without a name gets `<op_type>_<i>` (i = its index), made unique; named nodes keep theirs.

    Precondition: no two named nodes share a name (the result would not name every node uniquely)."""
    require("name_nodes", _shared_node_name(model))
    result = copy_model(model)
    taken = {n.name for n in result.graph.node if n.name}
    for i, node in enumerate(result.graph.node):
        if node.name:
            continue
        name, k = f"{node.op_type}_{i}", 1
        while name in taken:
            name, k = f"{node.op_type}_{i}_{k}", k + 1
        node.name = name
        taken.add(name)
    return result


def _shared_node_name(model: onnx.ModelProto) -> Problem:
    seen: set[str] = set()
    for node in model.graph.node:
        if node.name in seen:
            return f"two nodes are named {node.name!r}; name_nodes names only unnamed nodes"
        if node.name:
            seen.add(node.name)
    return None


def fuse_log_softmax_nll(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rule: `y = LogSoftmax(x, axis=1 or -1 on 2-D x); loss = NegativeLogLikelihoodLoss(y, label[, weight])`
    becomes `loss, y = SoftmaxCrossEntropyLoss(x, label[, weight])` with the same `reduction` and `ignore_index`.

    Only fused when the log-probabilities are consumed by that one NLL node or are a graph output (then the fused
    node's second output keeps the name), and when the softmax axis is the class axis (1) as both ops require.
    Before opset 13 LogSoftmax flattens its input to 2-D at `axis`, so it is the class-axis softmax on 2-D x only.
    A chain of Identity nodes between the two (activation markers, `graph/statistics.py`), each the only consumer
    of its input, is looked through: it moves after the fused node and reads its log-probability output.

    Precondition: every tensor is assigned once (a tensor's producer is its one node), and the model imports the
    default-domain opset.
    """
    require("fuse_log_softmax_nll", _fuse_problem(model))
    result = copy_model(model)
    graph = result.graph
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    shapes = None
    replaced: dict[int, list[onnx.NodeProto]] = {}
    removed: set[int] = set()
    for node in graph.node:
        if node.op_type != "NegativeLogLikelihoodLoss" or node.domain not in ("", "ai.onnx"):
            continue
        chain = _identity_chain(node.input[0], producers, consumers)
        log_probs = chain[-1].input[0] if chain else node.input[0]
        log_softmax = producers.get(log_probs)
        if log_softmax is None or log_softmax.op_type != "LogSoftmax" or consumers.get(log_probs, 0) != 1:
            continue
        shapes = shapes or onnx.shape_inference.infer_shapes(result).graph
        if not _is_class_axis(log_softmax, shapes, _onnx_opset(result)):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        fused = helper.make_node(
            "SoftmaxCrossEntropyLoss",
            [log_softmax.input[0], *node.input[1:]],
            [node.output[0], log_softmax.output[0]],
            name=f"{node.name or 'nll'}_fused_softmax_cross_entropy",
            **{k: v for k, v in attrs.items() if k in ("reduction", "ignore_index")},
        )
        replaced[id(node)] = [fused, *reversed(chain)]
        removed.update({id(log_softmax), *(id(n) for n in chain)})
    if replaced:
        _replace_nodes(graph, replaced, removed)
    return result


def _replace_nodes(graph: onnx.GraphProto, replaced: dict[int, list[onnx.NodeProto]], removed: set[int]) -> None:
    """Put each fused node (and the Identity chain after it) where its NLL node was, and drop the removed nodes.

    The fused node takes the NLL node's place: its inputs (logits, label) exist before the NLL node, and its
    log-probability output only fed that NLL node (or is a graph output), so the order stays topological."""
    nodes = []
    for n in graph.node:
        if id(n) in replaced:
            nodes.extend(replaced[id(n)])
        elif id(n) not in removed:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)


def _fuse_problem(model: onnx.ModelProto) -> Problem:
    imported = any(o.domain in ("", "ai.onnx") for o in model.opset_import)
    return first_problem(repeated_output(model.graph), None if imported else "the model imports no default opset")


def _identity_chain(name: str, producers: dict, consumers: dict[str, int]) -> list[onnx.NodeProto]:
    """The Identity nodes that lead to `name`, nearest first, while each output has exactly one consumer."""
    chain = []
    node = producers.get(name)
    while (
        node is not None
        and node.op_type == "Identity"
        and node.domain in ("", "ai.onnx")
        and consumers.get(node.output[0], 0) == 1
    ):
        chain.append(node)
        node = producers.get(node.input[0])
    return chain


def _is_class_axis(log_softmax: onnx.NodeProto, graph: onnx.GraphProto, opset: int) -> bool:
    axis = next(
        (helper.get_attribute_value(a) for a in log_softmax.attribute if a.name == "axis"), -1 if opset >= 13 else 1
    )
    rank = _rank_of(log_softmax.input[0], graph)
    if opset < 13:  # LogSoftmax-1/11 normalises over all axes from `axis` on: the class axis alone only on 2-D x
        return axis in (1, -1) and rank == 2
    if axis == 1:
        return True
    return axis == -1 and rank == 2


def _onnx_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _rank_of(name: str, graph: onnx.GraphProto) -> int | None:
    for vi in list(graph.value_info) + list(graph.input) + list(graph.output):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return len(vi.type.tensor_type.shape.dim)
    return None


NAME_NODES = FunctionPass("name_nodes", name_nodes, _shared_node_name)
FUSE_LOG_SOFTMAX_NLL = FunctionPass("fuse_log_softmax_nll", fuse_log_softmax_nll, _fuse_problem)
POSTPROCESS_PASSES = (NAME_NODES, FUSE_LOG_SOFTMAX_NLL)
