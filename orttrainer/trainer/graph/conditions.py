"""Precondition checks shared by the graph passes.

Each check returns `None` when the condition holds, else one sentence saying what is wrong; `require` turns that
sentence into a `PassPreconditionError` naming the pass. Checks never modify the model.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from .errors import PassPreconditionError

Problem = str | None


def require(pass_name: str, *problems: Problem) -> None:
    """Raise `PassPreconditionError` for the first problem that is not None."""
    problem = first_problem(*problems)
    if problem:
        raise PassPreconditionError(pass_name, problem)


def first_problem(*problems: Problem) -> Problem:
    return next((p for p in problems if p), None)


def graph_input_names(model: onnx.ModelProto) -> set[str]:
    return {i.name for i in model.graph.input}


def graph_output_names(model: onnx.ModelProto) -> set[str]:
    return {o.name for o in model.graph.output}


def unsorted_input(graph: onnx.GraphProto) -> Problem:
    """Topological order: every node input is empty, a graph input, an initializer, or an output of an earlier node."""
    available = {v.name for v in graph.input} | {i.name for i in graph.initializer} | {""}
    for node in graph.node:
        missing = [name for name in node.input if name not in available]
        if missing:
            return f"node {node.name or node.op_type!r} reads {missing[0]!r} before any node produces it"
        available.update(node.output)
    return None


def unproduced_input(graph: onnx.GraphProto) -> Problem:
    """Every node input is produced by some node (in any order), or is a graph input or initializer."""
    available = {v.name for v in graph.input} | {i.name for i in graph.initializer} | {""}
    available.update(name for node in graph.node for name in node.output)
    for node in graph.node:
        missing = [name for name in node.input if name not in available]
        if missing:
            return f"node {node.name or node.op_type!r} reads {missing[0]!r}, which nothing produces"
    return None


def repeated_output(graph: onnx.GraphProto) -> Problem:
    """Single assignment: no tensor is the output of two nodes, or of a node and a graph input or initializer."""
    produced = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        for name in node.output:
            if name and name in produced:
                return f"tensor {name!r} is assigned twice (node {node.name or node.op_type!r} writes it again)"
            produced.add(name)
    return None


def not_among(names: Iterable[str], present: set[str], what: str, where: str = "the graph") -> Problem:
    """Every name in `names` is in `present`; `what` says what the names are, `where` what `present` is."""
    missing = sorted({n for n in names if n not in present})
    return f"{what} {missing} are missing from {where}" if missing else None


def dynamic_shape(model: onnx.ModelProto, names: Iterable[str], what: str = "trainable tensor") -> Problem:
    """Every graph input in `names` has a shape whose dimensions are all numbers (other names are not checked)."""
    by_name = {i.name: i for i in model.graph.input}
    for name in names:
        tensor_type = by_name[name].type.tensor_type if name in by_name else None
        if tensor_type is None:
            continue
        if not tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in tensor_type.shape.dim):
            return f"{what} {name!r} has a dynamic shape; parameters must have static shapes"
    return None


def default_opset(model: onnx.ModelProto) -> int:
    """The default-domain (`ai.onnx`) opset version the model imports; 0 when it imports none."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def opset_below(model: onnx.ModelProto, version: int, why: str) -> Problem:
    found = default_opset(model)
    if found >= version:
        return None
    return f"needs default-domain opset >= {version} ({why}); the model imports {found or 'none'}"


def repeated_initializer(graph: onnx.GraphProto) -> Problem:
    seen: set[str] = set()
    for init in graph.initializer:
        if init.name in seen:
            return f"initializer {init.name!r} is listed twice"
        seen.add(init.name)
    return None
