"""Passes for a training graph with static shapes: the 'ort' builder's graph specialised to one input-shape signature
(runtime/static_graphs.py), and the torch builder's graphs, traced for one signature.

ONNX Runtime's gradient builder writes gradients for any input shape: each broadcasting op's gradient asks
`BroadcastGradientArgs(Shape(a), Shape(b))` at run time which axes to sum, and sums them with
`ReduceSum(dY, axes, noop_with_empty_axes=1)` — which copies `dY` when there is nothing to sum, the common case
(33 copies of up to 8 MB per transformer step). Once the data inputs declare static dims, ONNX Runtime's own
optimiser folds the `Shape` nodes into constants (the round trip in runtime/static_graphs.py); these passes do the
rest on its result:

- `static_inputs_pass(shapes)`: the named graph inputs declare the given dims;
- `FOLD_BROADCAST_GRADIENT_ARGS`: a `BroadcastGradientArgs` whose two shapes are constants becomes its constant
  reduction axes;
- `DROP_NOOP_REDUCTIONS`: a `ReduceSum` over a constant empty axes list with `noop_with_empty_axes=1`, a `Sum`
  of one input, and a reduction over axes of size 1 become `Identity` (which ONNX Runtime then removes) or
  `Squeeze`. It also runs on every gradient graph (graph/pipeline.py): the torch builder's LSTM traced step by step has
  such reductions;
- `SCATTER_SUM_TO_CONCAT`: the gradient of `x[0], x[1], ..., x[n-1]` (PyTorch's fused q/k/v projection: n Gather
  gradients, scattered into zeros and summed) becomes one `Concat` of the n slices' gradients;
- `WHERE_SUM_TO_CONCAT`: the same gradient as the torch builder's traced graph writes it (each slice's gradient
  broadcast, placed by a one-hot `Where` over zeros, and the n placements added) becomes one `Concat`. The torch
  builder's graphs have static shapes from the start, so it runs on its every graph (graph/pipeline.py);
- `WITHOUT_DEAD_NODES`: nodes whose outputs nothing reads, and unread initializers, are removed.

Each returns a new model and leaves its argument unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .editor import GraphEditor, copy_model, inferred_shapes, remove_unread
from .passes import (
    FunctionPass,
    Problem,
    first_problem,
    graph_input_names,
    not_among,
    repeated_output,
    require,
    unsorted_input,
)

_RUNTIME = "com.microsoft"


def with_static_inputs(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """Rule: the graph inputs named in `shapes` declare exactly those dims (a copy).

    Precondition: every name is a graph input whose declared rank is that of its shape and whose static dims, if
    any, agree with it."""
    require("static_inputs", _static_inputs_problem(model, shapes))
    result = copy_model(model)
    for value in result.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, shapes[value.name], strict=True):
                dim.Clear()
                dim.dim_value = int(size)
    return result


def _static_inputs_problem(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> Problem:
    missing = not_among(list(shapes), graph_input_names(model), "shaped inputs", "the graph inputs")
    if missing:
        return missing
    for value in model.graph.input:
        if value.name not in shapes:
            continue
        dims, wanted = value.type.tensor_type.shape.dim, list(shapes[value.name])
        if len(dims) != len(wanted):
            return f"input {value.name!r} has rank {len(dims)}, the shape {wanted} rank {len(wanted)}"
        if any(d.HasField("dim_value") and d.dim_value != w for d, w in zip(dims, wanted, strict=True)):
            return f"input {value.name!r} declares static dims that differ from {wanted}"
    return None


def static_inputs_pass(shapes: Mapping[str, Sequence[int]]) -> FunctionPass:
    shapes = {name: tuple(int(d) for d in dims) for name, dims in shapes.items()}
    return FunctionPass(
        "static_inputs", partial(with_static_inputs, shapes=shapes), partial(_static_inputs_problem, shapes=shapes)
    )


def broadcast_gradient_axes(a: Sequence[int], b: Sequence[int]) -> tuple[list[int], list[int]]:
    """The axes (of the broadcast result) along which `a`'s and `b`'s gradients are summed: right-aligned, an axis
    is summed for the operand that lacks it or has size 1 where the other does not. ValueError if the shapes do
    not broadcast."""
    rank = max(len(a), len(b))
    a_full, b_full = [1] * (rank - len(a)) + list(a), [1] * (rank - len(b)) + list(b)
    a_axes, b_axes = [], []
    for axis, (x, y) in enumerate(zip(a_full, b_full, strict=True)):
        if x == y:
            continue
        if x == 1:
            a_axes.append(axis)
        elif y == 1:
            b_axes.append(axis)
        else:
            raise ValueError(f"shapes {list(a)} and {list(b)} do not broadcast")
    return a_axes, b_axes


def fold_broadcast_gradient_args(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rule: each `com.microsoft.BroadcastGradientArgs(a_shape, b_shape)` whose inputs are both initializers is
    removed and its outputs become int64 initializers holding `broadcast_gradient_axes(a_shape, b_shape)`.

    Precondition: those shapes broadcast (`PassPreconditionError` naming the node otherwise)."""
    require("fold_broadcast_gradient_args", _broadcast_problem(model))
    result = copy_model(model)
    constants = _initializers(result)
    kept = []
    for node in result.graph.node:
        folded = _folded_axes(node, constants)
        if folded is None:
            kept.append(node)
            continue
        for name, axes in zip(node.output, folded, strict=False):
            if name:
                result.graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), name))
    del result.graph.node[:]
    result.graph.node.extend(kept)
    return result


def _folded_axes(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> tuple[list[int], list[int]] | None:
    if node.op_type != "BroadcastGradientArgs" or node.domain != _RUNTIME or len(node.input) < 2:
        return None
    if node.input[0] not in constants or node.input[1] not in constants:
        return None
    a, b = (constants[name].reshape(-1).tolist() for name in node.input[:2])
    return broadcast_gradient_axes(a, b)


def _broadcast_problem(model: onnx.ModelProto) -> Problem:
    constants = _initializers(model)
    for node in model.graph.node:
        try:
            _folded_axes(node, constants)
        except ValueError as err:
            return f"BroadcastGradientArgs {node.name!r}: {err}"
    return None


def drop_noop_reductions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rule: `ReduceSum(x, axes)` with `noop_with_empty_axes=1` whose `axes` is an empty initializer, and `Sum(x)`
    with one input, become `Identity(x)` (same output name); so does a `ReduceSum`, `ReduceMean`, `ReduceMax` or
    `ReduceMin` over constant axes that are all of size 1 in x's inferred shape (the sum, mean, max or min of one
    value is that value), or `Squeeze(x, axes)` when it drops them (`keepdims=0`). The torch builder's trace of an
    LSTM step by step has one such `ReduceSum` per time step (docs/engine.md §21)."""
    result = copy_model(model)
    constants = _initializers(result)
    shapes = inferred_shapes(result) if any(_reduced_axes(n, constants) for n in result.graph.node) else {}
    editor = GraphEditor(result.graph, "orttrainer/noop_reductions")
    for node in result.graph.node:
        if _is_noop_reduction(node, constants) or (node.op_type == "Sum" and len(node.input) == 1):
            node.CopyFrom(helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
            continue
        axes = _reduced_axes(node, constants)
        dims = shapes.get(node.input[0], (0, ()))[1] if axes else ()
        if not axes or not dims or any(not -len(dims) <= a < len(dims) or dims[a] != 1 for a in axes):
            continue
        if _attribute(node, "keepdims", 1):
            node.CopyFrom(helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
        else:
            dropped = editor.constant(sorted(a % len(dims) for a in axes), dtype=np.int64, hint="axes")
            node.CopyFrom(helper.make_node("Squeeze", [node.input[0], dropped], [node.output[0]], name=node.name))
    return result


_ONE_VALUE_REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin")


def _reduced_axes(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> list[int]:
    """The constant, non-empty axes a reduction of `_ONE_VALUE_REDUCTIONS` reduces (its `axes` input or attribute);
    [] when they are not known or empty (an empty list reduces every axis, or none)."""
    if node.op_type not in _ONE_VALUE_REDUCTIONS or node.domain not in ("", "ai.onnx") or not node.input:
        return []
    if len(node.input) > 1 and node.input[1]:
        axes = constants.get(node.input[1])
        return [int(a) for a in axes.reshape(-1)] if axes is not None and axes.dtype == np.int64 else []
    return [int(a) for a in _attribute(node, "axes", [])]


def _is_noop_reduction(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> bool:
    if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return False
    noop = _attribute(node, "noop_with_empty_axes", 0)
    return bool(noop) and node.input[1] in constants and constants[node.input[1]].size == 0


def _attribute(node: onnx.NodeProto, name: str, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def scatter_sum_to_concat(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rule: `Sum(s_0, ..., s_{n-1})` where each `s_k` is — through `Cast(to=FLOAT)`, `CastLike` or `Identity`
    nodes — `ScatterND(Z, [[i_k]], u_k)` (`reduction` none or add), `Z` a float32 zero tensor of shape [n, ...]
    (zero initializers, or `ConstantOfShape` of an initializer shape with value 0, all of that shape) and
    {i_k} = {0, ..., n-1},
    becomes `Concat(u for i = 0..n-1, axis=0)`: row i of the sum is `u_k` for the k with `i_k = i`, exactly.

    Precondition: the graph has no float16 tensors declared (so the casts passed through are float32 to float32)."""
    require("scatter_sum_to_concat", _float16_problem(model))
    result = copy_model(model)
    constants = _initializers(result)
    producers = {out: node for node in result.graph.node for out in node.output}
    for node in result.graph.node:
        parts = _scatter_parts(node, producers, constants) if node.op_type == "Sum" else None
        if parts is not None:
            concat = helper.make_node("Concat", parts, [node.output[0]], name=node.name or node.output[0], axis=0)
            node.CopyFrom(concat)
    return result


def _scatter_parts(
    node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], constants: dict[str, np.ndarray]
) -> list[str] | None:
    """The updates `u` in row order when `node` (a Sum) matches the rule, else None."""
    rows: dict[int, str] = {}
    shapes = set()
    for name in node.input:
        scatter = _through_casts(name, producers)
        if scatter is None or scatter.op_type != "ScatterND" or len(scatter.input) != 3:
            return None
        index = constants.get(scatter.input[1])
        if index is None or index.shape != (1, 1) or int(index[0, 0]) in rows:
            return None
        rows[int(index[0, 0])] = scatter.input[2]
        shapes.add(_zeros_shape(scatter.input[0], producers, constants))
    if len(shapes) != 1 or sorted(rows) != list(range(len(rows))):
        return None
    shape = shapes.pop()
    if shape is None or not shape or shape[0] != len(rows):
        return None
    return [rows[i] for i in range(len(rows))]


def _through_casts(name: str, producers: dict[str, onnx.NodeProto]) -> onnx.NodeProto | None:
    node = producers.get(name)
    while node is not None and node.op_type in ("Cast", "CastLike", "Identity"):
        if node.op_type == "Cast" and helper.get_attribute_value(node.attribute[0]) != TensorProto.FLOAT:
            return None
        node = producers.get(node.input[0])
    return node


def _zeros_shape(
    name: str, producers: dict[str, onnx.NodeProto], constants: dict[str, np.ndarray]
) -> tuple[int, ...] | None:
    """The shape of `name` when it is an all-zero float32 constant or ConstantOfShape(constant shape, 0.0)."""
    if name in constants:
        value = constants[name]
        return tuple(value.shape) if value.dtype == np.float32 and not value.any() else None
    node = producers.get(name)
    if node is None or node.op_type != "ConstantOfShape" or node.input[0] not in constants:
        return None
    fill = next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), np.zeros(1, np.float32))
    if fill.dtype != np.float32 or fill.any():
        return None
    return tuple(int(d) for d in constants[node.input[0]].reshape(-1))


def where_sum_to_concat(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rule: a tree of `Add` nodes (each inner `Add` read by the tree only, not a graph output) whose n >= 2 leaves are
    `Where(C_k, Expand(X_k, S), Z)` — `S` a constant shape, `C_k` a bool constant whose shape, right-aligned to
    `S`, is 1 on every axis but one axis `a` where it is n = S[a], true at exactly one index i_k; `Z` a zero
    constant, or `ConstantOfShape(S, 0)`; `X_k` of a known shape (a graph input or output, a declared value, or a
    `Reshape` to a constant shape without -1 or 0) equal to `S` but 1 at axis `a` — with {i_k} = {0, ..., n-1},
    becomes `Concat(X for i = 0..n-1, axis=a)`: at index i of axis `a` exactly one leaf is `X_k`, broadcast, and
    the others are zero, so the sum is `X_k` (a zero's sign aside). Then the nodes this leaves unread, and the
    initializers only they read, are removed.

    Precondition: the nodes are in topological order (the removal walks back from the outputs)."""
    require("where_sum_to_concat", _unsorted_problem(model))
    result = copy_model(model)
    graph = result.graph
    constants = _constants(result)
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for name in [n for node in graph.node for n in node.input] + [o.name for o in graph.output]:
        readers[name] = readers.get(name, 0) + 1
    shapes = _declared_shapes(graph, producers, constants)
    orphaned: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "Add":
            continue
        found = _where_tree(node, producers, readers, constants, shapes)
        if found is not None:
            parts, axis, replaced = found
            orphaned.extend(replaced)
            node.CopyFrom(helper.make_node("Concat", parts, [node.output[0]], name=node.name, axis=axis))
    if orphaned:
        remove_unread(result, orphaned)
    return result


def _where_tree(
    root: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    readers: dict[str, int],
    constants: dict[str, np.ndarray],
    shapes: dict[str, tuple[int, ...]],
) -> tuple[list[str], int, list[onnx.NodeProto]] | None:
    """(the `X` in index order, the axis, the nodes the Concat replaces) when `root` matches the rule."""
    leaves: list[onnx.NodeProto] = []
    inner: list[onnx.NodeProto] = []
    pending = list(root.input)
    while pending:
        node = producers.get(pending.pop())
        if node is None:
            return None
        if node.op_type == "Add" and readers.get(node.output[0], 0) == 1:
            inner.append(node)
            pending.extend(node.input)
        elif node.op_type == "Where":
            leaves.append(node)
        else:
            return None
    if len(leaves) < 2:
        return None
    rows: dict[int, str] = {}
    axes, replaced = set(), [*inner]
    for where in leaves:
        leaf = _where_leaf(where, producers, constants, shapes)
        if leaf is None or leaf[1] in rows:
            return None
        x, index, axis, size = leaf
        if size != len(leaves):
            return None
        rows[index] = x
        axes.add(axis)
        replaced.extend(n for n in (where, producers[where.input[1]], producers.get(where.input[2])) if n is not None)
    if len(axes) != 1 or sorted(rows) != list(range(len(leaves))):
        return None
    return [rows[i] for i in range(len(leaves))], axes.pop(), replaced


def _where_leaf(
    where: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    constants: dict[str, np.ndarray],
    shapes: dict[str, tuple[int, ...]],
) -> tuple[str, int, int, int] | None:
    """(X, its index i, the axis a, n) of one `Where(C, Expand(X, S), Z)` leaf of the rule, else None."""
    condition, expand = constants.get(where.input[0]), producers.get(where.input[1])
    if condition is None or condition.dtype != np.bool_ or expand is None or expand.op_type != "Expand":
        return None
    target = constants.get(expand.input[1])
    if target is None or target.dtype != np.int64 or target.ndim != 1:
        return None
    full = tuple(int(d) for d in target)
    if condition.ndim > len(full) or _zeros_shape(where.input[2], producers, constants) not in (full, ()):
        return None
    spread = [i for i, d in enumerate(condition.shape) if d != 1]
    if len(spread) != 1 or int(np.count_nonzero(condition)) != 1:
        return None
    axis = len(full) - condition.ndim + spread[0]
    size = condition.shape[spread[0]]
    x = expand.input[0]
    if size != full[axis] or shapes.get(x) != full[:axis] + (1,) + full[axis + 1 :]:
        return None
    return x, int(np.flatnonzero(condition.reshape(-1))[0]), axis, size


def _declared_shapes(
    graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto], constants: dict[str, np.ndarray]
) -> dict[str, tuple[int, ...]]:
    """Static shapes known without inference: declared values, and `Reshape`s to a constant shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        dims = value.type.tensor_type.shape.dim if value.type.tensor_type.HasField("shape") else None
        if dims is not None and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(int(d.dim_value) for d in dims)
    for name, node in producers.items():
        target = constants.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        if target is not None and target.dtype == np.int64 and target.ndim == 1 and (target > 0).all():
            shapes.setdefault(name, tuple(int(d) for d in target))
    return shapes


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """`_initializers`, and the bool initializers (one-hot conditions)."""
    return _initializers(model) | {
        i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == TensorProto.BOOL
    }


def _float16_problem(model: onnx.ModelProto) -> Problem:
    declared = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    if any(v.type.tensor_type.elem_type == TensorProto.FLOAT16 for v in declared) or any(
        i.data_type == TensorProto.FLOAT16 for i in model.graph.initializer
    ):
        return "the graph has float16 tensors; the rule passes through casts only for float32 graphs"
    return None


def without_dead_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rule: remove, repeatedly, every node none of whose outputs is a graph output or read by another node, then
    every initializer no node reads (a copy)."""
    result = copy_model(model)
    remove_unread(result)
    return result


def _single_assignment_problem(model: onnx.ModelProto) -> Problem:
    """The rule replaces a node by the node writing the same output name: every name must have one writer."""
    return repeated_output(model.graph)


def _unsorted_problem(model: onnx.ModelProto) -> Problem:
    """The rule walks the nodes backwards from the outputs: a node must come after the nodes it reads."""
    return unsorted_input(model.graph)


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == TensorProto.INT64} | {
        i.name: numpy_helper.to_array(i)
        for i in model.graph.initializer
        if i.data_type == TensorProto.FLOAT and _small_or_zero(i)
    }


def _small_or_zero(initializer: onnx.TensorProto) -> bool:
    """Float initializers worth reading here: zero tensors (ScatterND's base) — decoded only when their raw bytes are
    all zero, so weights are never copied."""
    data = initializer.raw_data
    return bool(data) and not np.frombuffer(data, np.uint8).any()


FOLD_BROADCAST_GRADIENT_ARGS = FunctionPass(
    "fold_broadcast_gradient_args", fold_broadcast_gradient_args, _broadcast_problem
)
DROP_NOOP_REDUCTIONS = FunctionPass("drop_noop_reductions", drop_noop_reductions, _single_assignment_problem)
SCATTER_SUM_TO_CONCAT = FunctionPass("scatter_sum_to_concat", scatter_sum_to_concat, _float16_problem)
WHERE_SUM_TO_CONCAT = FunctionPass("where_sum_to_concat", where_sum_to_concat, _unsorted_problem)
WITHOUT_DEAD_NODES = FunctionPass("without_dead_nodes", without_dead_nodes, _unsorted_problem)
STATIC_SHAPE_PASSES = [FOLD_BROADCAST_GRADIENT_ARGS, DROP_NOOP_REDUCTIONS, SCATTER_SUM_TO_CONCAT, WITHOUT_DEAD_NODES]


def static_shape_problem(model: onnx.ModelProto, data_inputs: Sequence[str]) -> Problem:
    """Why a training graph should not be specialised: no dynamic data input dims (nothing to gain)."""
    dynamic = [
        v.name
        for v in model.graph.input
        if v.name in data_inputs and any(not d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)
    ]
    return first_problem(None if dynamic else "the data inputs have static shapes already")
