"""Checks on an ONNX model from outside, before anything reads its tensors and before ONNX Runtime sees it.

`check_model(model, source)` is pure: it reads the ModelProto and raises `InvalidModelError` (a ValueError) whose
message names `source` (the file, or the model) and the tensor, function or nodes at fault. Rules
(docs/reliability.md §1.2–1.4):

1. Declared sizes. Every tensor — initializers, the values and indices of sparse initializers, tensor attributes
   of nodes, in the main graph, its subgraphs and the local functions — declares non-negative dims whose element
   count and byte size fit in int64, and holds exactly that many values: `raw_data` of count x item-size bytes
   (4-bit types: half a byte each, rounded up), or that many entries in its typed field (`float_data`, ...; two
   per complex element). A tensor whose data is in an external file is checked by `external_data` when it is read;
   here only its dims. A sparse initializer's dense shape may not exceed `MAX_SPARSE_DENSE_BYTES` (ONNX Runtime
   makes it dense). Without these checks a tensor declaring 10^12 elements fails deep inside numpy or ONNX
   Runtime with an error that names nothing, or makes them try to allocate terabytes.
2. No recursion. No local function calls itself, directly or through other local functions: ONNX Runtime's
   function inliner recurses without end and the process dies (SIGSEGV, measured on onnxruntime-training 1.19.2).
3. No cycles. The nodes of every graph (the main graph, each subgraph, each function body) can be ordered so that
   each reads only values from outside the graph (inputs, initializers, an enclosing graph's values) or from
   earlier nodes; a subgraph's reads of enclosing values count as reads of the node that holds it. A cycle is
   reported with the values that form it. (Undefined names are not this check's business: ONNX Runtime names
   them.)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import pairwise

import onnx
from onnx import AttributeProto, TensorProto

__all__ = ["MAX_SPARSE_DENSE_BYTES", "InvalidModelError", "check_model", "declared_bytes", "describe", "tensors"]

_INT64_MAX = 2**63 - 1
# A sparse initializer becomes a dense tensor in ONNX Runtime; it may not be larger than a dense tensor can be
# inside a model (protobuf's 2 GiB).
MAX_SPARSE_DENSE_BYTES = 2**31 - 1

# Bytes per element in `raw_data` (ONNX's TensorProto.DataType; 4-bit types are packed two to a byte).
_ITEM_BYTES: dict[int, int] = {
    TensorProto.FLOAT: 4,
    TensorProto.UINT8: 1,
    TensorProto.INT8: 1,
    TensorProto.UINT16: 2,
    TensorProto.INT16: 2,
    TensorProto.INT32: 4,
    TensorProto.INT64: 8,
    TensorProto.BOOL: 1,
    TensorProto.FLOAT16: 2,
    TensorProto.DOUBLE: 8,
    TensorProto.UINT32: 4,
    TensorProto.UINT64: 8,
    TensorProto.COMPLEX64: 8,
    TensorProto.COMPLEX128: 16,
    TensorProto.BFLOAT16: 2,
    TensorProto.FLOAT8E4M3FN: 1,
    TensorProto.FLOAT8E4M3FNUZ: 1,
    TensorProto.FLOAT8E5M2: 1,
    TensorProto.FLOAT8E5M2FNUZ: 1,
}
_HALF_BYTE = {TensorProto.INT4, TensorProto.UINT4}
# The typed field that holds a tensor's values when it has no raw_data, and how many entries one element takes.
_INT32_FIELD = {
    TensorProto.INT32,
    TensorProto.INT16,
    TensorProto.INT8,
    TensorProto.UINT16,
    TensorProto.UINT8,
    TensorProto.BOOL,
    TensorProto.FLOAT16,
    TensorProto.BFLOAT16,
    TensorProto.FLOAT8E4M3FN,
    TensorProto.FLOAT8E4M3FNUZ,
    TensorProto.FLOAT8E5M2,
    TensorProto.FLOAT8E5M2FNUZ,
}


class InvalidModelError(ValueError):
    """The model breaks one of `check_model`'s rules; the message names the model and what is at fault."""


def describe(model: onnx.ModelProto) -> str:
    """How errors name a model that came without a file name."""
    return f"the ONNX model (graph {model.graph.name!r})"


def check_model(model: onnx.ModelProto, source: str | None = None) -> None:
    """Apply the module's rules to `model`; `source` names it in errors (its file; default: `describe`)."""
    shown = source or describe(model)
    for where, tensor in _dense_tensors(model):
        _check_tensor(tensor, where, shown)
    for where, sparse in _sparse_tensors(model):
        _check_sparse(sparse, where, shown)
    _check_no_recursion(model, shown)
    for where, nodes, outside in _graphs(model):
        _check_no_cycle(nodes, outside, where, shown)


# --- 1. declared sizes --------------------------------------------------------------------------------------------


def declared_bytes(tensor: TensorProto, where: str, source: str) -> int:
    """The bytes `tensor` declares (its dims' product times its item size), checked to be non-negative and to fit
    in int64; `InvalidModelError` otherwise, or for an element type without a fixed size."""
    name = _tensor_name(tensor, where)
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        raise InvalidModelError(f"{source}: {name} declares a negative dimension: {dims}")
    count = math.prod(dims)
    if tensor.data_type in _HALF_BYTE:
        size = (count + 1) // 2
    elif tensor.data_type in _ITEM_BYTES:
        size = count * _ITEM_BYTES[tensor.data_type]
    else:
        kind = TensorProto.DataType.Name(tensor.data_type) if tensor.data_type in TensorProto.DataType.values() else ""
        raise InvalidModelError(
            f"{source}: {name} has element type {kind or tensor.data_type}, which has no fixed size in bytes"
        )
    if count > _INT64_MAX or size > _INT64_MAX:
        raise InvalidModelError(
            f"{source}: {name} declares dims {dims}: {count} elements, more than an int64 can count"
        )
    return size


def _check_tensor(tensor: TensorProto, where: str, source: str) -> None:
    name = _tensor_name(tensor, where)
    if tensor.data_type == TensorProto.STRING:
        dims = list(tensor.dims)
        if any(d < 0 for d in dims):
            raise InvalidModelError(f"{source}: {name} declares a negative dimension: {dims}")
        _require_count(len(tensor.string_data), math.prod(dims), "strings", name, dims, source)
        return
    size = declared_bytes(tensor, where, source)
    if tensor.data_location == TensorProto.EXTERNAL:
        return  # its data is checked against the file when it is read (external_data.py)
    count = math.prod(tensor.dims)
    if tensor.HasField("raw_data"):
        _require_count(len(tensor.raw_data), size, "bytes", name, list(tensor.dims), source)
        return
    field, per_element = _typed_field(tensor.data_type)
    expected = (count + 1) // 2 if tensor.data_type in _HALF_BYTE else count * per_element
    _require_count(len(getattr(tensor, field)), expected, f"values in {field}", name, list(tensor.dims), source)


def _typed_field(data_type: int) -> tuple[str, int]:
    if data_type in _INT32_FIELD or data_type in _HALF_BYTE:
        return "int32_data", 1
    fields: dict[int, tuple[str, int]] = {
        TensorProto.FLOAT: ("float_data", 1),
        TensorProto.COMPLEX64: ("float_data", 2),
        TensorProto.INT64: ("int64_data", 1),
        TensorProto.DOUBLE: ("double_data", 1),
        TensorProto.COMPLEX128: ("double_data", 2),
        TensorProto.UINT32: ("uint64_data", 1),
        TensorProto.UINT64: ("uint64_data", 1),
    }
    return fields[data_type]


def _require_count(held: int, expected: int, unit: str, name: str, dims: list[int], source: str) -> None:
    if held != expected:
        raise InvalidModelError(f"{source}: {name} declares dims {dims} ({expected} {unit}) but holds {held} {unit}")


def _check_sparse(sparse: onnx.SparseTensorProto, where: str, source: str) -> None:
    values = sparse.values
    name = _tensor_name(values, where)
    dense = TensorProto(data_type=values.data_type, dims=list(sparse.dims), name=values.name)
    size = declared_bytes(dense, where, source)
    if size > MAX_SPARSE_DENSE_BYTES:
        raise InvalidModelError(
            f"{source}: sparse {name} declares dense dims {list(sparse.dims)} ({size} bytes), more than "
            f"{MAX_SPARSE_DENSE_BYTES} bytes; ONNX Runtime would make it dense"
        )
    _check_tensor(values, f"{where} values", source)
    _check_tensor(sparse.indices, f"{where} indices", source)


def _tensor_name(tensor: TensorProto, where: str) -> str:
    return f"tensor {tensor.name!r} ({where})" if tensor.name else f"a tensor ({where})"


def tensors(model: onnx.ModelProto) -> Iterator[tuple[str, TensorProto]]:
    """Every TensorProto of the model with where it is: initializers, tensor attributes and the values and indices
    of sparse tensors, in every graph and function body (those whose data may be external)."""
    yield from _dense_tensors(model)
    for where, sparse in _sparse_tensors(model):
        yield f"{where} values", sparse.values
        yield f"{where} indices", sparse.indices


def _dense_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, TensorProto]]:
    """Every TensorProto of the model with where it is: initializers and tensor attributes, everywhere."""
    for where, graph in _all_graphs(model):
        for tensor in graph.initializer:
            yield f"initializer of {where}", tensor
        yield from _attribute_tensors(graph.node, where)
    for function in model.functions:
        yield from _attribute_tensors(function.node, f"function {_function_key(function)}")


def _attribute_tensors(nodes: Iterable[onnx.NodeProto], where: str) -> Iterator[tuple[str, TensorProto]]:
    for node in nodes:
        for attribute in node.attribute:
            at = f"attribute {attribute.name!r} of node {node.name or node.op_type!r} in {where}"
            if attribute.type == AttributeProto.TENSOR:
                yield at, attribute.t
            elif attribute.type == AttributeProto.TENSORS:
                yield from ((at, t) for t in attribute.tensors)


def _sparse_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.SparseTensorProto]]:
    for where, graph in _all_graphs(model):
        for sparse in graph.sparse_initializer:
            yield f"sparse initializer of {where}", sparse
        for node in graph.node:
            for attribute in node.attribute:
                at = f"attribute {attribute.name!r} of node {node.name or node.op_type!r} in {where}"
                if attribute.type == AttributeProto.SPARSE_TENSOR:
                    yield at, attribute.sparse_tensor
                elif attribute.type == AttributeProto.SPARSE_TENSORS:
                    yield from ((at, s) for s in attribute.sparse_tensors)


def _all_graphs(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    """The main graph and every subgraph (also those inside function bodies), each with where it is."""
    pending: deque[tuple[str, onnx.GraphProto]] = deque([("the main graph", model.graph)])
    for function in model.functions:
        for node in function.node:
            pending.extend(_subgraphs(node, f"function {_function_key(function)}"))
    while pending:
        where, graph = pending.popleft()
        yield where, graph
        for node in graph.node:
            pending.extend(_subgraphs(node, where))


def _subgraphs(node: onnx.NodeProto, where: str) -> Iterator[tuple[str, onnx.GraphProto]]:
    for attribute in node.attribute:
        at = f"subgraph {attribute.name!r} of node {node.name or node.op_type!r} in {where}"
        if attribute.type == AttributeProto.GRAPH:
            yield at, attribute.g
        elif attribute.type == AttributeProto.GRAPHS:
            yield from ((f"{at} #{i}", g) for i, g in enumerate(attribute.graphs))


# --- 2. no recursion ----------------------------------------------------------------------------------------------

_FunctionKey = tuple[str, str, str]  # domain, name, overload


def _function_key(function: onnx.FunctionProto) -> str:
    overload = getattr(function, "overload", "")
    return f"{function.domain}.{function.name}" + (f":{overload}" if overload else "")


def _check_no_recursion(model: onnx.ModelProto, source: str) -> None:
    """Depth-first over the call graph of the local functions, without Python recursion (a hostile model may nest
    as deep as it likes)."""
    functions = {(f.domain, f.name, getattr(f, "overload", "")): f for f in model.functions}
    calls = {key: sorted(_called(function.node, functions)) for key, function in functions.items()}
    state: dict[_FunctionKey, int] = {}  # 1: on the current path, 2: done
    for root in functions:
        if root in state:
            continue
        path: list[_FunctionKey] = [root]
        iterators = [iter(calls[root])]
        state[root] = 1
        while iterators:
            callee = next(iterators[-1], None)
            if callee is None:
                state[path.pop()] = 2
                iterators.pop()
            elif state.get(callee) == 1:
                cycle = [*path[path.index(callee) :], callee]
                shown = " -> ".join(_function_key(functions[key]) for key in cycle)
                raise InvalidModelError(
                    f"{source}: local function {_function_key(functions[callee])} calls itself ({shown}); ONNX "
                    "Runtime cannot inline a recursive function (it crashes the process)"
                )
            elif callee not in state:
                state[callee] = 1
                path.append(callee)
                iterators.append(iter(calls[callee]))


def _called(nodes: Iterable[onnx.NodeProto], functions: dict[_FunctionKey, onnx.FunctionProto]) -> set[_FunctionKey]:
    """The local functions that `nodes` (and the subgraphs inside them) call."""
    called = set()
    pending = deque(nodes)
    while pending:
        node = pending.popleft()
        key = (node.domain, node.op_type, getattr(node, "overload", ""))
        if key in functions:
            called.add(key)
        for _, graph in _subgraphs(node, ""):
            pending.extend(graph.node)
    return called


# --- 3. no cycles -------------------------------------------------------------------------------------------------


def _graphs(model: onnx.ModelProto) -> Iterator[tuple[str, list[onnx.NodeProto], set[str]]]:
    """Every graph as (where, nodes, the names its own inputs and initializers define)."""
    for where, graph in _all_graphs(model):
        defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
        defined |= {s.values.name for s in graph.sparse_initializer}
        yield where, list(graph.node), defined
    for function in model.functions:
        yield f"function {_function_key(function)}", list(function.node), set(function.input)


def _reads(node: onnx.NodeProto) -> set[str]:
    """What `node` reads: its inputs and what its subgraphs read from enclosing graphs."""
    reads = {name for name in node.input if name}
    for _, graph in _subgraphs(node, ""):
        reads |= _free_names(graph)
    return reads


def _free_names(graph: onnx.GraphProto) -> set[str]:
    """The names `graph` (with its own subgraphs) reads but does not define."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    free = set()
    for node in graph.node:
        free |= _reads(node) - defined
        defined.update(node.output)
    return free | ({o.name for o in graph.output} - defined)


def _check_no_cycle(nodes: list[onnx.NodeProto], outside: set[str], where: str, source: str) -> None:
    """Kahn's algorithm over the nodes' reads of values other nodes of this graph produce."""
    producer: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in node.output:
            if name and name not in outside:
                producer.setdefault(name, index)
    needs = [{producer[r] for r in _reads(node) if r in producer} for node in nodes]
    readers: list[list[int]] = [[] for _ in nodes]
    for index, needed in enumerate(needs):
        for other in needed:
            readers[other].append(index)
    waiting = [len(needed) for needed in needs]
    ready = deque(i for i, count in enumerate(waiting) if count == 0)
    ordered = 0
    while ready:
        index = ready.popleft()
        ordered += 1
        for reader in readers[index]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    if ordered == len(nodes):
        return
    cycle = _one_cycle([i for i, count in enumerate(waiting) if count > 0], needs)
    values = [next(r for r in _reads(nodes[b]) if producer.get(r) == a) for a, b in pairwise(cycle)]
    shown = " -> ".join(values + values[:1])
    names = ", ".join(repr(nodes[i].name or nodes[i].op_type) for i in cycle[:-1])
    raise InvalidModelError(f"{source}: {where} has a cycle: {shown} (nodes {names}); an ONNX graph must be acyclic")


def _one_cycle(stuck: list[int], needs: list[set[int]]) -> list[int]:
    """A cycle among the nodes that could not be ordered, as producer indices [a, b, ..., a] where each feeds the
    next. Every stuck node needs a stuck node, so walking those needs must come back to a node already seen."""
    stuck_set = set(stuck)
    walk, seen = [stuck[0]], {stuck[0]: 0}
    while True:
        nxt = min(needs[walk[-1]] & stuck_set)
        if nxt in seen:
            loop = walk[seen[nxt] :] + [nxt]
            return loop[::-1]  # needs point from reader to producer; the cycle reads producer -> reader
        seen[nxt] = len(walk)
        walk.append(nxt)
