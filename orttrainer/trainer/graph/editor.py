"""A small helper that appends nodes, constants, inputs and outputs to an ONNX graph under unique names.

Every pass that adds nodes goes through `GraphEditor`, so names never collide with the user's tensors and every
added node carries a readable name (`orttrainer/<pass>/<hint>`) that shows up in ORT profiles and graph dumps.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .passes import (
    FunctionPass,
    PassPreconditionError,
    Problem,
    default_opset,
    first_problem,
    repeated_output,
    require,
    unproduced_input,
)

Dim = int | str | None  # a dim as shape inference gives it: a size, a symbol, or unknown

__all__ = [
    "FLOAT_TYPES",
    "Dim",
    "TOPOLOGICALLY_SORTED",
    "GraphEditor",
    "can_raise_opset",
    "copy_model",
    "default_opset",
    "fresh_name",
    "graph_value_names",
    "inferred_shapes",
    "raise_opset",
    "raise_opset_problem",
    "raise_opset_pass",
    "raised_opset",
    "remove_unread",
    "tensor_elem_type",
    "topologically_sorted",
]


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A deep copy, so passes never mutate their argument."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    return result


def fresh_name(base: str, taken: set[str]) -> str:
    """`base`, or `base_<k>` for the first k that is not in `taken`; the result is added to `taken`."""
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def graph_value_names(graph: onnx.GraphProto) -> set[str]:
    """All tensor names that appear anywhere in `graph` (inputs, outputs, initializers, node inputs/outputs)."""
    names = {v.name for v in graph.input} | {v.name for v in graph.output} | {i.name for i in graph.initializer}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
    names.discard("")
    return names


class GraphEditor:
    """Appends to `graph` in place; `prefix` namespaces the names it invents."""

    def __init__(self, graph: onnx.GraphProto, prefix: str) -> None:
        self.graph = graph
        self.prefix = prefix
        self._taken = graph_value_names(graph) | {n.name for n in graph.node}
        self._constants: dict[tuple, str] = {}

    def fresh(self, hint: str) -> str:
        """A name based on `hint` that no tensor or node of the graph uses yet."""
        base = hint if hint.startswith("orttrainer/") else f"{self.prefix}/{hint}"
        return fresh_name(base, self._taken)

    def unused(self, name: str) -> str:
        """`name` itself if no tensor or node uses it yet, else `name_<k>`; reserved either way."""
        return fresh_name(name, self._taken)

    def claim(self, name: str) -> str:
        """Reserve an exact name (for graph inputs/outputs whose names are part of a contract)."""
        if name in self._taken:
            raise ValueError(f"tensor name {name!r} is already used in the graph")
        self._taken.add(name)
        return name

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        hint: str | None = None,
        outputs: Sequence[str] | None = None,
        domain: str = "",
        **attrs: Any,
    ) -> str:
        """Append one node with exactly one output; returns that output's name.

        `outputs`, when given, is the one explicit output name (reserved, so no later fresh name repeats it); nodes
        with several outputs go through `op_outputs`.
        """
        if outputs is not None and len(outputs) != 1:
            raise ValueError(f"GraphEditor.op appends a node with one output, got {list(outputs)}; use op_outputs")
        return self.op_outputs(op_type, inputs, hint, 1 if outputs is None else outputs, domain, **attrs)[0]

    def op_outputs(
        self,
        op_type: str,
        inputs: Sequence[str],
        hint: str | None = None,
        outputs: int | Sequence[str] = 1,
        domain: str = "",
        **attrs: Any,
    ) -> list[str]:
        """Append one node; returns the names of its outputs: `outputs` fresh ones (`<hint>` for one output,
        `<hint>_out<i>` for several), or the explicit names in `outputs`, which are reserved too."""
        hint = hint or op_type
        if isinstance(outputs, int):
            out_names = [self.fresh(hint if outputs == 1 else f"{hint}_out{i}") for i in range(outputs)]
        else:
            out_names = list(outputs)
            self._taken.update(out_names)
        node = helper.make_node(
            op_type, list(inputs), out_names, name=self.fresh(f"{hint}_node"), domain=domain, **attrs
        )
        self.graph.node.append(node)
        return out_names

    def constant(self, value, dtype=np.float32, hint: str = "const") -> str:
        """An initializer holding `value` (deduplicated by value, dtype and shape)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            name = self.fresh(hint)
            self.graph.initializer.append(numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]

    def add_input(self, name: str, elem_type: int, shape: Sequence[int | str] | None) -> str:
        self.graph.input.append(helper.make_tensor_value_info(self.claim(name), elem_type, shape))
        return name

    def add_output(self, name: str, elem_type: int, shape: Sequence[int | str] | None) -> str:
        self.graph.output.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def scalar_product(self, factors: Iterable[str | float], hint: str) -> str | float:
        """Multiply scalars: Python floats are folded on the host, tensor names become Mul nodes.

        Returns a float when every factor is a float, else the name of the product tensor.
        """
        folded = 1.0
        tensors: list[str] = []
        for f in factors:
            if isinstance(f, str):
                tensors.append(f)
            else:
                folded *= float(f)
        if not tensors:
            return folded
        result = tensors[0]
        for t in tensors[1:]:
            result = self.op("Mul", [result, t], hint)
        if folded != 1.0:
            result = self.op("Mul", [result, self.constant(folded, hint=f"{hint}_c")], hint)
        return result

    def as_tensor(self, value: str | float, hint: str = "const") -> str:
        return value if isinstance(value, str) else self.constant(value, hint=hint)


def tensor_elem_type(model: onnx.ModelProto, name: str) -> int:
    """The element type of a graph input, output, initializer or value_info entry called `name`."""
    graph = model.graph
    for init in graph.initializer:
        if init.name == name:
            return init.data_type
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi.type.tensor_type.elem_type
    raise KeyError(f"no type information for tensor {name!r}")


def can_raise_opset(model: onnx.ModelProto) -> bool:
    """From opset 14 on, raising the default-domain opset to 16 changes the meaning of no op but RoiAlign (its
    default coordinate mode); the ops whose versions change in between only gain types or attributes."""
    return default_opset(model) >= 14 and not any(n.op_type == "RoiAlign" for n in model.graph.node)


def raise_opset(model: onnx.ModelProto, version: int) -> None:
    """Rule: set the default-domain opset to at least `version` (<= 16), in place (`model` is mutated).

    Precondition: the model imports the default domain, and where its opset is below `version` it can be raised
    without changing the meaning of any node (`can_raise_opset`)."""
    require("raise_opset", raise_opset_problem(model, version))
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, version)


def raised_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """Rule: a copy of `model` whose default-domain opset is at least `version` (`raise_opset` on a copy; the
    argument is not modified). Precondition: as `raise_opset`'s."""
    require("raise_opset", raise_opset_problem(model, version))
    result = copy_model(model)
    raise_opset(result, version)
    return result


def raise_opset_pass(version: int) -> FunctionPass:
    return FunctionPass(
        "raise_opset", partial(raised_opset, version=version), partial(raise_opset_problem, version=version)
    )


def raise_opset_problem(model: onnx.ModelProto, version: int) -> Problem:
    """Why `raise_opset(model, version)` would be refused, or None."""
    current = default_opset(model)
    if not current:
        return "the model imports no default-domain (ai.onnx) opset"
    if version > 16 or (current < version and not can_raise_opset(model)):
        return (
            f"cannot raise this graph's opset {current} to {version} safely "
            "(only from opset 14 on, to at most 16, and without RoiAlign nodes)"
        )
    return None


def topologically_sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rule: a copy whose nodes are in topological order (Kahn's algorithm, stable: ready nodes keep their relative
    order).

    Precondition: every tensor is assigned once, every node input is produced by some node, a graph input or an
    initializer, and the graph has no cycle (`PassPreconditionError` otherwise)."""
    require("topologically_sorted", _sort_problem(model))
    result = copy_model(model)
    graph = result.graph
    available = {v.name for v in graph.input} | {i.name for i in graph.initializer} | {""}
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    waiting_on = [0] * len(graph.node)
    consumers: dict[int, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in set(node.input) - available:
            waiting_on[i] += 1
            consumers.setdefault(producer[name], []).append(i)
    ready = [i for i, count in enumerate(waiting_on) if count == 0]
    heapq.heapify(ready)  # the smallest index first: nodes keep their original order where they can
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in consumers.get(i, []):
            waiting_on[j] -= 1
            if waiting_on[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(graph.node):
        raise PassPreconditionError("topologically_sorted", "the graph has a cycle")
    nodes = [graph.node[i] for i in order]
    del graph.node[:]
    graph.node.extend(nodes)
    return result


def remove_unread(model: onnx.ModelProto, candidates: list[onnx.NodeProto] | None = None) -> None:
    """In place, walking back from the outputs (the nodes in topological order): remove every node — of the
    `candidates` (known by their outputs), or any when None — none of whose outputs is a graph output or read by a
    kept node or its subgraphs; then the initializers nothing kept reads — with `candidates`, only those a removed
    node read."""
    graph = model.graph
    removable = None if candidates is None else {out for node in candidates for out in node.output}
    needed = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    removed_reads: set[str] = set()
    for node in reversed(graph.node):
        if not any(name in needed for name in node.output) and (
            removable is None or any(name in removable for name in node.output)
        ):
            removed_reads.update(node.input)
            continue
        kept.append(node)
        needed.update(name for name in node.input if name)
        for graph_attr in (a for a in node.attribute if a.type == onnx.AttributeProto.GRAPH):
            needed.update(_subgraph_reads(graph_attr.g))
    del graph.node[:]
    graph.node.extend(reversed(kept))
    if removable is None:
        initializers = [i for i in graph.initializer if i.name in needed]
    else:  # a graph input's initializer is its default: kept
        needed.update(i.name for i in graph.input)
        initializers = [i for i in graph.initializer if i.name in needed or i.name not in removed_reads]
    del graph.initializer[:]
    graph.initializer.extend(initializers)


def _subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads (outer-scope values included, conservatively every input of its nodes)."""
    return {name for node in graph.node for name in node.input if name}


def inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[Dim, ...]]]:
    """Element type and dims (an int, a symbol or None) of every tensor ONNX shape inference types, inferred on a
    copy that declares the float initializers as typed inputs instead of carrying their data."""
    graph = model.graph
    small = [i for i in graph.initializer if i.data_type == TensorProto.INT64 and not i.external_data]
    skipped = {v.name for v in graph.input} | {i.name for i in small}
    typed = [
        helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
        for i in graph.initializer
        if i.name not in skipped
    ]
    light = helper.make_model(
        helper.make_graph(
            list(graph.node), graph.name, [*graph.input, *typed], list(graph.output), small, value_info=graph.value_info
        ),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
        functions=list(model.functions),
    )
    try:
        inferred = onnx.shape_inference.infer_shapes(light)
    except Exception:  # a graph shape inference cannot read: nothing is joined
        return {}
    shapes: dict[str, tuple[int, tuple[Dim, ...]]] = {}
    g = inferred.graph
    for value in [*g.input, *g.output, *g.value_info]:
        tensor = value.type.tensor_type
        if tensor.elem_type and tensor.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
            shapes[value.name] = (tensor.elem_type, dims)
    for initializer in small:
        shapes[initializer.name] = (initializer.data_type, tuple(initializer.dims))
    return shapes


def _sort_problem(model: onnx.ModelProto) -> Problem:
    return first_problem(repeated_output(model.graph), unproduced_input(model.graph))


TOPOLOGICALLY_SORTED = FunctionPass("topologically_sorted", topologically_sorted, _sort_problem)


FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
