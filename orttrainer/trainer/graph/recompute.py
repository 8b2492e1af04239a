"""Recompute: chosen forward activations are computed again in the backward pass instead of kept from the forward.

Rule (`recompute`): for each selected forward node whose output a backward node reads, the graph gets a copy of
the node, named `<node>_recompute` with outputs `<output>_recompute`. The copy reads the copies of selected
producers and the original tensors otherwise (kept activations, weights, constants); every backward node that read
a selected output reads the copy's instead. Copies no backward node needs (directly or through other copies) are
not made. The copies are placed in the node list right before the first backward node that needs them, and each such
group waits behind a gate: `com.microsoft.PassThrough(dep, x1, x2, ...)`, whose outputs alias its inputs (no copy)
and which cannot run before `dep`, the latest backward input of that first reader. The copies read `x1, x2, ...`
through the gate, so in any execution order ONNX Runtime picks they run late, the forward's tensors die after their
last forward reader, and no graph optimisation (CSE) can merge a copy back into its original.

- A node is *forward* if a forward output (the loss, the model's outputs) depends on it; every other node is
  *backward* (gradients, the gradient builder's shape helpers, the optimizer).
- `Shape`/`Size` readers are not redirected: they need no values, run early and would pull the copy into the
  forward pass.
- `Dropout` is recomputed from its kept mask, as ONNX Runtime's own recompute did: `DropoutGrad(x, mask, ratio,
  training_mode)` computes `x·mask/(1-ratio)`, the forward output, bit for bit. Without `training_mode` (or with a
  constant false one) Dropout is the identity and its copy an `Identity`. Only output 0 is recomputed; readers of
  the mask keep reading the forward's.
- Nodes that cannot be repeated exactly — random ops, a Dropout whose training mode or ratio is not a constant,
  nodes with subgraphs — are never copied: their outputs are kept.

Selections (the legacy `graph_transformer` options):
- `gelu_nodes`: Gelu / BiasGelu / FastGelu (after ONNX Runtime's fusions) — the GELU output is recomputed from its
  input, which GELU's gradient keeps anyway.
- `attention_dropout_nodes`: a Dropout fed by Softmax and read by a MatMul (attention probabilities) — recomputed
  from the softmax output, which SoftmaxGrad keeps anyway, and the mask.
- `transformer_layers`: the layers of the model's largest `ModuleList` of layers, found by the exporter's node-name
  scopes (`/model/encoder/layers.3/...`); a layer's interior is its forward nodes minus those whose outputs are read
  outside the layer (its output, kept as the next layer's input). A recomputed layer keeps its input, its output and
  its dropout masks.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import onnx
from onnx import helper, numpy_helper

from .editor import copy_model, fresh_name, graph_value_names
from .passes import FunctionPass, Problem, not_among, require, unsorted_input
from .recompute_select import (
    GELU_OPS,
    Layer,
    attention_dropout_nodes,
    forward_nodes,
    gelu_nodes,
    transformer_layers,
)

__all__ = [
    "GATE_PREFIX",
    "GELU_OPS",
    "RECOMPUTE_SUFFIX",
    "Layer",
    "RecomputePlan",
    "apply_plan",
    "attention_dropout_nodes",
    "count_recompute_nodes",
    "forward_nodes",
    "gelu_nodes",
    "recompute",
    "recompute_pass",
    "transformer_layers",
]

RECOMPUTE_SUFFIX = "_recompute"
GATE_PREFIX = "orttrainer/recompute_gate/"
_SHAPE_READERS = ("Shape", "Size")
_RANDOM_OPS = (
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "BiasDropout",
    "BitmaskDropout",
    "BitmaskBiasDropout",
)
_MS_DOMAIN = "com.microsoft"


def recompute(model: onnx.ModelProto, forward_outputs: list[str], selected: Iterable[int]) -> onnx.ModelProto:
    """Apply the rule above to the nodes at indices `selected` (forward nodes of `model`); returns a new model.

    Precondition: the node list is topologically sorted (as the gradient builder writes it), the forward outputs
    are tensors of the graph, and the selected nodes are forward nodes.
    """
    graph = model.graph
    require("recompute", _recompute_problem(model, forward_outputs))
    forward = forward_nodes(graph, forward_outputs)
    not_forward = sorted(set(selected) - forward)
    if not_forward:
        require("recompute", f"nodes {[graph.node[i].name for i in not_forward]} are not forward nodes")
    constants = _constant_values(graph)
    copies = {i: _recomputed_outputs(graph.node[i], constants) for i in sorted(selected)}
    copies = {i: outs for i, outs in copies.items() if outs}
    taken = graph_value_names(graph) | {n.name for n in graph.node}
    renamed = {out: fresh_name(f"{out}{RECOMPUTE_SUFFIX}", taken) for outs in copies.values() for out in outs}
    producer = {out: i for i, outs in copies.items() for out in outs}
    first_use = _first_uses(graph, forward, copies, producer)
    if not first_use:
        return model
    result = copy_model(model)
    nodes = list(result.graph.node)
    for position, node in enumerate(nodes):
        if position in forward or node.op_type in _SHAPE_READERS:
            continue
        for k, name in enumerate(node.input):
            if name in renamed and producer[name] in first_use:
                node.input[k] = renamed[name]
    groups: dict[int, list[onnx.NodeProto]] = {}
    for i in sorted(first_use):
        groups.setdefault(first_use[i], []).append(_copy_node(graph.node[i], renamed, taken, constants))
    made = {renamed[out] for i in first_use for out in copies[i]}
    ordered = []
    for position, node in enumerate(nodes):
        if position in groups:
            dep = _latest_backward_input(nodes, forward, position)
            ordered.extend(_gated(groups[position], dep, made, taken))
        ordered.append(node)
    del result.graph.node[:]
    result.graph.node.extend(ordered)
    _add_domain(result, _MS_DOMAIN)
    return result


def _gated(group: list[onnx.NodeProto], dep: str | None, made: set[str], taken: set[str]) -> list[onnx.NodeProto]:
    """`group` (copies placed together) behind a gate: a `PassThrough(dep, x1, x2, ...)` whose outputs alias its
    inputs (no copy) and which cannot run before `dep`, a backward tensor computed just before the copies' first
    reader. The copies read the gate's outputs instead of `x1, x2, ...` (every input that is not another copy), so
    no execution order can run them early and no graph optimisation can merge them with the forward originals.
    Constants pass the gate too: ONNX Runtime then cannot fold or fuse a copy differently from its original
    (measured: without that, recomputed layers changed gradients in the last bit)."""
    if dep is None:
        return group
    outer = list(dict.fromkeys(n for node in group for n in node.input if n and n not in made))
    gated = {n: fresh_name(f"{n}_gated", taken) for n in outer}
    gate = helper.make_node(
        "PassThrough",
        [dep, *outer],
        [fresh_name(f"{dep}_gated", taken), *gated.values()],
        name=fresh_name(f"{GATE_PREFIX}{group[0].name.removesuffix(RECOMPUTE_SUFFIX)}", taken),
        domain=_MS_DOMAIN,
    )
    for node in group:
        for k, name in enumerate(node.input):
            node.input[k] = gated.get(name, name)
    return [gate, *group]


def _latest_backward_input(nodes: list[onnx.NodeProto], forward: set[int], position: int) -> str | None:
    """The input of the node at `position` made last by a backward node (else the output of the last backward node
    before it): what the gate waits for."""
    producer = {out: i for i, node in enumerate(nodes[:position]) for out in node.output if out}
    made_by_backward = [(producer[n], n) for n in nodes[position].input if n in producer and producer[n] not in forward]
    if made_by_backward:
        return max(made_by_backward)[1]
    earlier = [i for i in range(position) if i not in forward and nodes[i].output and nodes[i].output[0]]
    return nodes[earlier[-1]].output[0] if earlier else None


def _first_uses(
    graph: onnx.GraphProto, forward: set[int], copies: dict[int, list[str]], producer: dict[str, int]
) -> dict[int, int]:
    """For each copy some backward node needs: the position of the first backward node that needs it (directly or
    through copies that read it)."""
    first_use: dict[int, int] = {}
    for position, node in enumerate(graph.node):
        if position in forward or node.op_type in _SHAPE_READERS:
            continue
        for name in node.input:
            i = producer.get(name)
            if i is not None:
                first_use[i] = min(first_use.get(i, position), position)
    for i in sorted(copies, reverse=True):  # readers before the copies they read: a copy precedes its first reader
        if i not in first_use:
            continue
        for name in _copied_inputs(graph.node[i]):
            j = producer.get(name)
            if j is not None:
                first_use[j] = min(first_use.get(j, first_use[i]), first_use[i])
    return first_use


def _copied_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs of `node` its copy reads through other copies (a Dropout copy reads only its data input)."""
    return [node.input[0]] if node.op_type == "Dropout" else [n for n in node.input if n]


def _recomputed_outputs(node: onnx.NodeProto, constants: dict[str, object]) -> list[str]:
    """The outputs the copy of `node` recomputes; empty when the node cannot be repeated exactly."""
    subgraphs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if node.op_type in _RANDOM_OPS or node.op_type == "Constant" or any(a.type in subgraphs for a in node.attribute):
        return []
    if node.op_type == "Dropout":
        return [node.output[0]] if _dropout_mode(node, constants) is not None else []
    return [out for out in node.output if out]


def _dropout_mode(node: onnx.NodeProto, constants: dict[str, object]) -> bool | None:
    """True/False: a constant training mode (with a constant ratio when True); None: not known before running."""
    mode = node.input[2] if len(node.input) > 2 else ""
    if not mode:
        return False
    if mode not in constants:
        return None
    training = bool(constants[mode])
    ratio = node.input[1] if len(node.input) > 1 else ""
    if training and not ratio:
        return None  # DropoutGrad's default ratio need not be Dropout's
    return training


def _copy_node(
    node: onnx.NodeProto, renamed: dict[str, str], taken: set[str], constants: dict[str, object]
) -> onnx.NodeProto:
    name = fresh_name(f"{node.name or node.op_type}{RECOMPUTE_SUFFIX}", taken)
    inputs = [renamed.get(n, n) for n in node.input]
    if node.op_type == "Dropout":
        output = renamed[node.output[0]]
        if not _dropout_mode(node, constants):
            return helper.make_node("Identity", [inputs[0]], [output], name=name)
        return helper.make_node(
            "DropoutGrad",
            [inputs[0], node.output[1], node.input[1], node.input[2]],
            [output],
            name=name,
            domain=_MS_DOMAIN,
        )
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = name
    del copy.input[:]
    copy.input.extend(inputs)
    del copy.output[:]
    copy.output.extend(renamed.get(n, n) for n in node.output)
    return copy


def _constant_values(graph: onnx.GraphProto) -> dict[str, object]:
    """Scalar values of initializers and Constant nodes (what a Dropout's training mode can be)."""
    values = {}
    for init in graph.initializer:
        if all(d == 1 for d in init.dims):
            values[init.name] = numpy_helper.to_array(init).reshape(-1)[0]
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            array = numpy_helper.to_array(node.attribute[0].t)
            if array.size == 1:
                values[node.output[0]] = array.reshape(-1)[0]
    return values


def _recompute_problem(model: onnx.ModelProto, forward_outputs: list[str]) -> Problem:
    unsorted = unsorted_input(model.graph)
    if unsorted:
        return f"needs a topologically sorted graph: {unsorted}"
    return not_among(forward_outputs, graph_value_names(model.graph), "forward outputs")


def _add_domain(model: onnx.ModelProto, domain: str) -> None:
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))


def count_recompute_nodes(model: onnx.ModelProto) -> dict[str, int]:
    """Recompute copies by op type (for tests and the memory benchmark)."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if RECOMPUTE_SUFFIX in node.name and not node.name.startswith(GATE_PREFIX):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


@dataclass(frozen=True)
class RecomputePlan:
    """The legacy options: `layers` is None (off), 0 (every layer but the last) or the number of first layers."""

    gelu: bool = False
    attention_dropout: bool = False
    layers: int | None = None

    def __bool__(self) -> bool:
        return self.gelu or self.attention_dropout or self.layers is not None


def apply_plan(
    model: onnx.ModelProto, forward_outputs: list[str], plan: RecomputePlan
) -> tuple[onnx.ModelProto, list[str]]:
    """Select nodes per `plan` and recompute them. Returns the model and a message for each option that recomputes
    nothing in this graph, or whose layer count was clipped (the caller warns). Precondition: as `recompute`'s."""
    require("recompute", _recompute_problem(model, forward_outputs))
    graph = model.graph
    forward = forward_nodes(graph, forward_outputs)
    chosen: dict[str, list[int]] = {}
    notes = []
    nothing = "nothing is recomputed for it"
    if plan.gelu:
        chosen["gelu_recompute"] = gelu_nodes(graph, forward)
        if not chosen["gelu_recompute"]:
            notes.append(f"graph_transformer.gelu_recompute: the graph has no Gelu/BiasGelu/FastGelu node; {nothing}")
    if plan.attention_dropout:
        chosen["attn_dropout_recompute"] = attention_dropout_nodes(graph, forward)
        if not chosen["attn_dropout_recompute"]:
            notes.append(
                "graph_transformer.attn_dropout_recompute: the graph has no Dropout between a Softmax and a "
                f"MatMul (attention dropout with p > 0 in training mode); {nothing}"
            )
    if plan.layers is not None:
        layers = transformer_layers(graph, forward)
        count = len(layers) - 1 if plan.layers == 0 else min(plan.layers, len(layers) - 1)
        if count < 1:
            notes.append(
                f"graph_transformer.transformer_layer_recompute: found {len(layers)} transformer layer(s) "
                f"(node-name scopes like '/model/encoder/layers.0/'), and the last is never recomputed; "
                f"{nothing}"
            )
        elif plan.layers > count:
            notes.append(
                f"graph_transformer.number_recompute_layers={plan.layers} is more than the "
                f"{len(layers) - 1} layers that can be recomputed (all but the last); using {count}"
            )
        chosen["transformer_layer_recompute"] = [i for layer in layers[: max(count, 0)] for i in layer.interior]
    selected = {i for found in chosen.values() for i in found}
    result = recompute(model, forward_outputs, selected) if selected else model
    copied = {n.name.removesuffix(RECOMPUTE_SUFFIX) for n in result.graph.node if n.name.endswith(RECOMPUTE_SUFFIX)}
    for option, found in chosen.items():
        if found and not copied.intersection(graph.node[i].name or graph.node[i].op_type for i in found):
            why = ""
            if option == "gelu_recompute":
                why = " (a dropout follows each GELU: its output is what the backward pass keeps)"
            notes.append(
                f"graph_transformer.{option}: the backward pass reads none of the {len(found)} activations "
                f"it selects{why}; {nothing}"
            )
    return result, notes


def recompute_pass(forward_outputs: list[str], plan: RecomputePlan) -> FunctionPass:
    """`apply_plan` as a pass: its notes become warnings (`UserWarning`, prefixed `options `, as the compiler's)."""

    def rule(model: onnx.ModelProto) -> onnx.ModelProto:
        result, notes = apply_plan(model, forward_outputs, plan)
        for note in notes:
            warnings.warn(f"options {note}", stacklevel=2)
        return result

    rule.__doc__ = apply_plan.__doc__
    return FunctionPass("recompute", rule, partial(_recompute_problem, forward_outputs=forward_outputs))
