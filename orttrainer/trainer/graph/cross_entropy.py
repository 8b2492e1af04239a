"""Softmax cross-entropy and its gradient as plain ONNX ops instead of ONNX Runtime's fused kernels.

Why: on the CPU, `SoftmaxCrossEntropyLoss` + `SoftmaxCrossEntropyLossGrad` on [2048, 1000] logits take 34 ms, the
plain ops below 8 ms (LogSoftmax, NegativeLogLikelihoodLoss and three elementwise passes: MLAS's vectorised
softmax and exp against the fused kernels' scalar loops; docs/engine.md §14). The loss is a few percent of a
transformer step; the two kernels were 6% of orttrainer's (benchmarks/run_all.py --profile).

Rule, for each `SoftmaxCrossEntropyLoss(scores, labels) -> (loss, log_prob)` whose `log_prob` is read only by
`SoftmaxCrossEntropyLossGrad(dloss, log_prob, labels) -> dscores` (same labels, `reduction` and `ignore_index`, no
class weights):
- forward: `log_prob = LogSoftmax(scores, axis=1)`, `loss = NegativeLogLikelihoodLoss(log_prob, labels)` with the
  same `reduction` and `ignore_index`;
- gradient: `dscores = (exp(log_prob) - onehot(labels)) · s`, the one-hot subtracted by
  `ScatterElements(..., reduction='add')` of -1 at each label along axis 1, and `s` broadcast along axis 1:
  `dloss / count` (`mean`; `count` = the labels that are not `ignore_index`), `dloss` (`sum`) or `dloss` per
  element (`none`), times 0 where the label is `ignore_index` (such labels scatter into class 0, then are zeroed).
Both are exactly the kernels' definitions (ONNX's SoftmaxCrossEntropyLoss spec); results agree to float32
rounding. Scores of any rank ([N, C] or [N, C, d1, ...]); the loss must be declared float32 (the pass leaves float16
and float64 losses alone); the opset is raised to 16 (ScatterElements'
`reduction`), so a graph that cannot be raised safely (`editor.can_raise_opset`) is left unchanged, as are
losses with class weights and log-probabilities read elsewhere.

Precondition: the nodes the rule matches have their inputs and outputs named. Returns a new model.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .editor import GraphEditor, can_raise_opset, copy_model, raise_opset, tensor_elem_type
from .passes import FunctionPass, Problem, require

_OPSET = 16  # ScatterElements with reduction='add'


def cross_entropy_as_plain_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """Apply the rule in the module docstring; returns a new model (the argument is not modified)."""
    pairs = _pairs(model)
    if not pairs or not can_raise_opset(model):
        return model
    require("cross_entropy_as_plain_ops", _naming_problem(pairs))
    result = copy_model(model)
    ed = GraphEditor(result.graph, "orttrainer/cross_entropy")
    forwards = {fwd.output[1] for fwd, _ in pairs}  # matched by their (single-assignment) outputs
    grads = {grad.output[0]: fwd for fwd, grad in pairs}
    nodes: list[onnx.NodeProto] = []
    for node in list(result.graph.node):
        if node.op_type == "SoftmaxCrossEntropyLoss" and node.output[1:2] and node.output[1] in forwards:
            nodes.extend(_forward_nodes(node))
        elif node.op_type == "SoftmaxCrossEntropyLossGrad" and node.output[:1] and node.output[0] in grads:
            nodes.extend(_gradient_nodes(ed, node, _attributes(grads[node.output[0]])))
        else:
            nodes.append(node)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    raise_opset(result, _OPSET)
    return result


def _pairs(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, onnx.NodeProto]]:
    """(forward, gradient) node pairs the rule applies to."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output}
    pairs = []
    for fwd in model.graph.node:
        if fwd.op_type != "SoftmaxCrossEntropyLoss" or fwd.domain not in ("", "ai.onnx") or len(fwd.input) != 2:
            continue
        if len(fwd.output) != 2 or not fwd.output[1] or fwd.output[1] in outputs:
            continue
        users = readers.get(fwd.output[1], [])
        if len(users) == 1 and _matching_gradient(fwd, users[0]) and _float32(model, fwd.output[0]):
            pairs.append((fwd, users[0]))
    return pairs


def _float32(model: onnx.ModelProto, loss: str) -> bool:
    """The loss (a graph output, of the scores' type) is declared float32."""
    try:
        return tensor_elem_type(model, loss) == TensorProto.FLOAT
    except KeyError:
        return False


def _matching_gradient(fwd: onnx.NodeProto, grad: onnx.NodeProto) -> bool:
    return (
        grad.op_type == "SoftmaxCrossEntropyLossGrad"
        and grad.domain == "com.microsoft"
        and len(grad.input) == 3
        and grad.input[1] == fwd.output[1]
        and grad.input[2] == fwd.input[1]
        and _attributes(grad) == _attributes(fwd)
    )


def _attributes(node: onnx.NodeProto) -> dict:
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = values.get("reduction", b"mean")
    return {
        "reduction": reduction.decode() if isinstance(reduction, bytes) else reduction,
        "ignore_index": values.get("ignore_index"),
    }


def _forward_nodes(fwd: onnx.NodeProto) -> list[onnx.NodeProto]:
    scores, labels = fwd.input
    loss, log_prob = fwd.output
    attrs = {k: v for k, v in _attributes(fwd).items() if v is not None}
    return [
        helper.make_node("LogSoftmax", [scores], [log_prob], name=f"{log_prob}/log_softmax", axis=1),
        helper.make_node("NegativeLogLikelihoodLoss", [log_prob, labels], [loss], name=f"{loss}/nll", **attrs),
    ]


def _gradient_nodes(ed: GraphEditor, grad: onnx.NodeProto, attrs: dict) -> list[onnx.NodeProto]:
    """The gradient subgraph (built at the end of the graph, then taken off it for the caller to place)."""
    dloss, log_prob, labels = grad.input
    start = len(ed.graph.node)
    axis1 = ed.constant([1], dtype="int64", hint="axis1")
    valid = None
    index = labels
    if attrs["ignore_index"] is not None:
        ignored = ed.op("Equal", [labels, ed.constant(attrs["ignore_index"], dtype="int64", hint="ignore")], "ignored")
        valid = ed.op("Cast", [ed.op("Not", [ignored], "kept")], "kept_f", to=TensorProto.FLOAT)
        index = ed.op("Where", [ignored, ed.constant(0, dtype="int64", hint="zero_i"), labels], "safe_labels")
    index = ed.op("Unsqueeze", [index, axis1], "label_index")
    minus_one = ed.op("Expand", [ed.constant(-1.0, hint="minus_one"), ed.op("Shape", [index], "index_shape")], "neg")
    probs = ed.op("Exp", [log_prob], "probs")
    shifted = ed.op("ScatterElements", [probs, index, minus_one], "minus_onehot", axis=1, reduction="add")
    scale = _scale(ed, dloss, valid, labels, attrs["reduction"])
    ed.op("Mul", [shifted, scale], "dscores", outputs=[grad.output[0]])
    added = list(ed.graph.node[start:])
    del ed.graph.node[start:]
    return added


def _scale(ed: GraphEditor, dloss: str, valid: str | None, labels: str, reduction: str) -> str:
    """The factor of each label's row: `dloss/count`, `dloss` or `dloss[i]`, zero for ignored labels; broadcast
    along the class axis (axis 1)."""
    scale = dloss
    if reduction == "mean":
        counted = valid or ed.op("Cast", [ed.op("Shape", [labels], "label_shape")], "label_dims", to=TensorProto.FLOAT)
        count = (
            ed.op("ReduceSum", [counted], "count", keepdims=0)
            if valid
            else ed.op("ReduceProd", [counted], "count", keepdims=0)
        )
        scale = ed.op("Div", [dloss, count], "mean_scale")
    if valid is not None:
        scale = ed.op("Mul", [valid, scale], "row_scale")
    if valid is not None or reduction == "none":
        scale = ed.op("Unsqueeze", [scale, ed.constant([1], dtype="int64", hint="axis1")], "row_scale_c")
    return scale


def _naming_problem(pairs: list[tuple[onnx.NodeProto, onnx.NodeProto]]) -> Problem:
    for fwd, grad in pairs:
        if not (all(fwd.input) and all(fwd.output) and all(grad.input) and grad.output[:1] and grad.output[0]):
            return f"SoftmaxCrossEntropyLoss {fwd.name!r} or its gradient has an unnamed input or output"
    return None


def _problem(model: onnx.ModelProto) -> Problem:
    return _naming_problem(_pairs(model))


CROSS_ENTROPY_AS_PLAIN_OPS = FunctionPass("cross_entropy_as_plain_ops", cross_entropy_as_plain_ops, _problem)
