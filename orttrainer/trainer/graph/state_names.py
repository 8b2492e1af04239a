"""Renaming a gradient model's state tensors: from the names a traced module gives them to the trainer's names.

The torch builder names the gradient model's state inputs after the module's parameters and buffers and their
gradients `<name>_grad`. For an ONNX model traced through `OnnxModule` those are module names made from the
initializer names (`onnx_module.module_name`: "fc1.weight" -> "fc1_weight"); the trainer's session, optimizer
graph and checkpoints use the initializer names. `rename_state_pass(names)` is the graph pass (contract:
`graph/passes.py`) that renames them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import onnx

from ..compile.contract import buffer_update_name, gradient_name
from .editor import copy_model, fresh_name
from .passes import FunctionPass, Problem, first_problem


def rename_state(model: onnx.ModelProto, names: Mapping[str, str]) -> onnx.ModelProto:
    """Rule: for each `old -> new` in `names`, the graph input `old` becomes `new` and the graph outputs `old_grad`
    and `old__updated` (when there are such) become `new_grad` and `new__updated`; every node input and output,
    value_info and initializer naming them follows, in subgraphs too. A tensor that already bears one of the new
    names without being renamed itself (an intermediate value of the traced graph) first gets a fresh name. Returns a
    new model.

    Precondition (`rename_state_problem`): every `old` is a graph input; the new names are distinct; no new name
    is a graph input or output that is not renamed itself."""
    mapping = _full_mapping(model.graph, names)
    targets = set(mapping.values())
    taken = _all_names(model.graph) | targets
    for name in sorted(_all_names(model.graph)):
        if name in targets and name not in mapping:
            mapping[name] = fresh_name(f"{name}_", taken)
    result = copy_model(model)
    _rename_graph(result.graph, mapping)
    return result


def rename_state_problem(model: onnx.ModelProto, names: Mapping[str, str]) -> Problem:
    """What makes `rename_state` inapplicable, or None (see its precondition)."""
    graph = model.graph
    inputs = {i.name for i in graph.input}
    mapping = _full_mapping(graph, names)
    ends = inputs | {o.name for o in graph.output}
    clash = sorted(n for n in mapping.values() if n in ends and n not in mapping)
    return first_problem(
        f"state tensors {sorted(n for n in names if n not in inputs)} are not graph inputs"
        if any(n not in inputs for n in names)
        else None,
        f"new names {sorted(names.values())} are not distinct" if len(set(names.values())) < len(names) else None,
        f"new names {clash} are graph inputs or outputs already" if clash else None,
    )


def rename_state_pass(names: Mapping[str, str]) -> FunctionPass:
    """`rename_state(model, names)` as a graph pass."""
    fixed = dict(names)
    return FunctionPass("rename_state", partial(rename_state, names=fixed), partial(rename_state_problem, names=fixed))


def _full_mapping(graph: onnx.GraphProto, names: Mapping[str, str]) -> dict[str, str]:
    """`names` plus `old_grad -> new_grad` for each gradient output and the same for each buffer-update output
    (compile/contract.buffer_update_name)."""
    outputs = {o.name for o in graph.output}
    mapping = {old: new for old, new in names.items() if old != new}
    for old, new in mapping.copy().items():
        for derived in (gradient_name, buffer_update_name):
            if derived(old) in outputs:
                mapping[derived(old)] = derived(new)
    return mapping


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in [*graph.input, *graph.output, *graph.value_info]}
    names |= {i.name for i in graph.initializer}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for subgraph in _subgraphs(node):
            names |= _all_names(subgraph)
    names.discard("")
    return names


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    found: list[onnx.GraphProto] = []
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            found.append(attribute.g)
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            found.extend(attribute.graphs)
    return found


def _rename_graph(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> None:
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = mapping.get(value.name, value.name)
    for initializer in graph.initializer:
        initializer.name = mapping.get(initializer.name, initializer.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = mapping.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = mapping.get(name, name)
        for subgraph in _subgraphs(node):
            _rename_graph(subgraph, mapping)
