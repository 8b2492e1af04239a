"""Output selection: which graph outputs a model keeps.

Every pass returns a new model (the argument is untouched) and checks its precondition first
(`PassPreconditionError`). `keep_outputs` and `without_outputs` change only the output list: nodes stay, and a
session that runs with `only_execute_path_to_fetches` (or ONNX Runtime's graph optimizer) skips the work nothing
reads any more. `prune_to_outputs` also removes the nodes and graph inputs the kept outputs do not need — ONNX
Runtime requires a feed for every graph input, used or not — and `outputs_reading` says which outputs need an input.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import onnx

from .editor import copy_model
from .passes import FunctionPass, Problem, graph_output_names, not_among, require

__all__ = [
    "keep_outputs",
    "keep_outputs_pass",
    "outputs_reading",
    "prune_to_outputs",
    "without_outputs",
    "without_outputs_pass",
]


def without_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """Rule: the graph outputs named in `names` are removed; the other outputs keep their order.

    Precondition: every name in `names` is a graph output."""
    dropped = set(names)
    require("without_outputs", _outputs_problem(model, dropped))
    return _select(model, lambda name: name not in dropped)


def keep_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """Rule: only the graph outputs named in `names` remain, in the graph's order (not the order of `names`).

    Precondition: every name in `names` is a graph output."""
    kept = set(names)
    require("keep_outputs", _outputs_problem(model, kept))
    return _select(model, lambda name: name in kept)


def _select(model: onnx.ModelProto, keep) -> onnx.ModelProto:
    result = copy_model(model)
    kept = [o for o in result.graph.output if keep(o.name)]
    del result.graph.output[:]
    result.graph.output.extend(kept)
    return result


def _outputs_problem(model: onnx.ModelProto, names: set[str]) -> Problem:
    return not_among(names, graph_output_names(model), "outputs", "the graph outputs")


def without_outputs_pass(names: Iterable[str]) -> FunctionPass:
    dropped = set(names)
    return FunctionPass(
        "without_outputs", partial(without_outputs, names=dropped), partial(_outputs_problem, names=dropped)
    )


def keep_outputs_pass(names: Iterable[str]) -> FunctionPass:
    kept = set(names)
    return FunctionPass("keep_outputs", partial(keep_outputs, names=kept), partial(_outputs_problem, names=kept))


def outputs_reading(model: onnx.ModelProto, inputs: Iterable[str]) -> set[str]:
    """The graph outputs whose value depends on any of `inputs` (graph input names), through the nodes of the main
    graph (a node whose subgraph reads an outer name counts as reading it)."""
    tainted = set(inputs)
    for node in model.graph.node:
        if tainted & (set(node.input) | _outer_names(node)):
            tainted.update(node.output)
    return {o.name for o in model.graph.output if o.name in tainted}


def prune_to_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """Rule: only the graph outputs in `names` remain (in the graph's order), only the nodes they need, and only
    the graph inputs and initializers those nodes (or the outputs themselves) read.

    Precondition: every name in `names` is a graph output."""
    kept = set(names)
    require("prune_to_outputs", _outputs_problem(model, kept))
    result = keep_outputs(model, kept)
    graph = result.graph
    needed = set(kept)
    nodes = []
    for node in reversed(graph.node):
        if needed & set(node.output):
            nodes.append(node)
            needed.update(name for name in node.input if name)
            needed.update(_outer_names(node))
    nodes.reverse()
    del graph.node[:]
    graph.node.extend(nodes)
    inputs = [i for i in graph.input if i.name in needed]
    del graph.input[:]
    graph.input.extend(inputs)
    initializers = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return result


def _outer_names(node: onnx.NodeProto) -> set[str]:
    """Names the subgraphs of `node` read (they may come from the outer graph)."""
    names: set[str] = set()
    for attribute in node.attribute:
        bodies = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for body in bodies:
            for inner in body.node:
                names.update(inner.input)
                names |= _outer_names(inner)
    return names
