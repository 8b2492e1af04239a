"""A gradient summed over a weight's uses, as one op over the concatenated operands.

A tensor used at several places — an RNN's recurrent weight and biases at each of its time steps, a tied embedding —
gets as gradient one term per use, added: `dW = A_1·B_1 + ... + A_n·B_n` for a weight, `db = sum(dY_1) + ... +
sum(dY_n)` for a bias. The torch builder traced an LSTM over 64 steps (an nn.RNN, or an LSTM or GRU whose recurrence
is not one op: gradient/recurrent_layers.py, still is) into 64 products of [1024, 16]·[16, 256] and 63 additions
into a [1024, 256] accumulator, so the accumulator is read and written 64 times and each product has a contraction of
16 only; each bias gets 64 reductions of [16, 1024] and 63 additions. The same sums are one product of
the operands concatenated along the contracted axis, `[A_1 ... A_n]·[B_1; ...; B_n]`, and one reduction of the
concatenation (6.7 against 10.3 ms for those 64 products in ONNX Runtime, docs/engine.md §21).

Rule (`summed_uses_to_one`): a tree of `Add` and `Sum` nodes — every inner node read by the tree only and not a graph
output — whose leaves include n >= 2 small terms of one group, each term's nodes read by the tree only and not graph
outputs, becomes one op for the group; the root then writes it, or the `Sum` of it and the other leaves when the
tree has others. Small: where the chain's cost per term (a pass over the accumulator, ONNX Runtime's cost per node)
is of the order of the term's own work — a contraction of at most `MAX_CONTRACTION` (256) per product, an operand of
at most `MAX_REDUCED` (65,536) elements per reduction. Larger terms (a layer shared across a deep network) are left
as they are: the chain costs them little, and joining would keep every operand until the last use. The terms:

- a product `MatMul(A_k, B_k)` seen through a chain (possibly empty) of `Transpose(perm=[1, 0])` nodes, where shape
  inference gives A_k the shape [M, K_k] and B_k [K_k, N] with K_k known; a group has one element type, M, N and
  parity of transposes, and becomes `MatMul(Concat(A_k, axis=1), Concat(B_k, axis=0))`, transposed once when the
  parity is odd. Where every A_k is itself `Transpose(X_k, perm=[1, 0])`, the concatenation is `Transpose(Concat(X_k,
  axis=0))` (ONNX Runtime folds that transpose into the product; likewise for the B_k), so no transposed copy is
  made;
- a reduction `ReduceSum(X_k, axes)` over constant, non-empty axes, optionally seen through a `Reshape` to a constant
  shape; a group has one element type, the same axes, `keepdims` and `Reshape` target, and fully inferred shapes of
  X_k equal on every axis but `a`, the first reduced axis, and becomes `ReduceSum(Concat(X_k, axis=a), axes)` (then
  the `Reshape`): the sum along `a` of the concatenation along `a` is the sum of the sums.

The nodes this leaves unread are removed. What changes is the order of the additions, within float rounding; what
costs is memory: every operand is kept until the one op, where the chain freed each after its term.

Precondition: the nodes are in topological order (the replacement takes the root's place and reads the terms'
operands, produced before it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .editor import Dim, GraphEditor, copy_model, inferred_shapes, remove_unread
from .passes import FunctionPass, Problem, require, unsorted_input

_SUMS = ("Add", "Sum")
MAX_CONTRACTION = 256
MAX_REDUCED = 65536
_Shapes = dict[str, tuple[int, tuple[Dim, ...]]]


@dataclass(frozen=True)
class _Product:
    """A product term `MatMul(a, b)` seen through `transposes` transposes; `nodes`: those transposes, the MatMul."""

    a: str
    b: str
    transposes: int
    nodes: tuple[onnx.NodeProto, ...]


@dataclass(frozen=True)
class _Reduction:
    """A reduction term `ReduceSum(x, axes)` (the node `reduce`), reshaped to the constant `target` when not None;
    `nodes`: the Reshape if any, the ReduceSum."""

    x: str
    axes: tuple[int, ...]
    keepdims: int
    reduce: onnx.NodeProto
    target: str | None
    nodes: tuple[onnx.NodeProto, ...]


_Term = _Product | _Reduction


@dataclass(frozen=True)
class _Graph:
    """What the rule reads of a graph: each name's producer, how often it is read, its int64 constants."""

    producers: dict[str, onnx.NodeProto]
    readers: dict[str, int]
    constants: dict[str, np.ndarray]

    @classmethod
    def of(cls, graph: onnx.GraphProto) -> _Graph:
        constants = {
            i.name: numpy_helper.to_array(i)
            for i in graph.initializer
            if i.data_type == TensorProto.INT64 and not i.external_data
        }
        return cls({out: node for node in graph.node for out in node.output}, _reader_counts(graph), constants)


def summed_uses_to_one(model: onnx.ModelProto) -> onnx.ModelProto:
    """Apply the rule above; returns a new model (the argument is not modified)."""
    require("summed_uses_to_one", _unsorted_problem(model))
    trees = _trees(model.graph)
    if not trees:
        return model
    shapes = inferred_shapes(model)
    result = copy_model(model)
    graph = result.graph
    seen = _Graph.of(graph)
    editor = GraphEditor(graph, "orttrainer/summed_uses")
    replacements: dict[str, list[onnx.NodeProto]] = {}
    orphaned: list[onnx.NodeProto] = []
    for root, leaves in trees.items():
        start = len(graph.node)
        replaced = _rewrite(editor, root, leaves, shapes, seen)
        added = list(graph.node[start:])
        del graph.node[start:]
        if replaced is not None:
            replacements[root] = added
            orphaned.extend(replaced)
    if not replacements:
        return model
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.extend(replacements.get(node.output[0], [node]) if node.output else [node])
    del graph.node[:]
    graph.node.extend(nodes)
    remove_unread(result, orphaned)
    return result


def _trees(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """The output of each tree's root -> the tree's leaves, for the trees with at least two terms."""
    seen = _Graph.of(graph)
    inner: set[str] = set()
    trees: dict[str, list[str]] = {}
    for node in reversed(graph.node):  # a root comes after its tree's inner nodes
        if not _is_sum(node) or node.output[0] in inner:
            continue
        leaves: list[str] = []
        pending = list(reversed(node.input))
        while pending:
            name = pending.pop()
            producer = seen.producers.get(name)
            if producer is not None and _is_sum(producer) and seen.readers.get(name, 0) == 1:
                inner.add(name)
                pending.extend(reversed(producer.input))
            else:
                leaves.append(name)
        if sum(_term(name, seen) is not None for name in leaves) >= 2:
            trees[node.output[0]] = leaves
    return trees


def _rewrite(
    editor: GraphEditor, root: str, leaves: list[str], shapes: _Shapes, seen: _Graph
) -> list[onnx.NodeProto] | None:
    """Append the nodes that compute `root` with each group of terms as one op; returns the nodes they replace (the
    tree's and the terms'), or None when no two terms can be joined."""
    groups: dict[tuple, list[_Term]] = {}
    rest: list[str] = []
    for name in leaves:
        term = _term(name, seen)
        key = None if term is None else _group_key(term, shapes, seen)
        if term is None or key is None:
            rest.append(name)
        else:
            groups.setdefault(key, []).append(term)
    joined = [members for members in groups.values() if len(members) >= 2]
    if not joined:
        return None
    rest.extend(t.nodes[0].output[0] for members in groups.values() if len(members) < 2 for t in members)
    replaced = [seen.producers[n] for n in _inner_names(root, leaves, seen.producers)]
    outputs: list[str] = []
    for index, members in enumerate(joined):
        output = root if len(joined) == 1 and not rest else None
        if isinstance(members[0], _Product):
            products = [m for m in members if isinstance(m, _Product)]
            out, bypassed = _joined_product(editor, products, index, seen, output)
        else:
            reductions = [m for m in members if isinstance(m, _Reduction)]
            out, bypassed = _joined_reduction(editor, reductions, index, output), []
        outputs.append(out)
        replaced.extend([*bypassed, *(n for m in members for n in m.nodes)])
    if len(outputs) + len(rest) > 1:
        editor.op("Sum", [*outputs, *rest], "sum", outputs=[root])
    return replaced


def _joined_product(
    editor: GraphEditor, members: list[_Product], index: int, seen: _Graph, output: str | None
) -> tuple[str, list[onnx.NodeProto]]:
    """The one product of a group (written to `output` when given) and the operand transposes it reads around."""
    a, bypassed_a = _concatenated(editor, [p.a for p in members], 1, seen, "lhs")
    b, bypassed_b = _concatenated(editor, [p.b for p in members], 0, seen, "rhs")
    odd = members[0].transposes % 2 == 1
    product = editor.op("MatMul", [a, b], f"product{index}", outputs=[output] if output and not odd else None)
    if odd:
        product = editor.op(
            "Transpose", [product], f"product{index}_t", outputs=[output] if output else None, perm=[1, 0]
        )
    return product, [*bypassed_a, *bypassed_b]


def _joined_reduction(editor: GraphEditor, members: list[_Reduction], index: int, output: str | None) -> str:
    """The one reduction of a group, written to `output` when given."""
    first = members[0]
    joined = editor.op("Concat", [m.x for m in members], f"terms{index}", axis=first.axes[0])
    attributes = {a.name: helper.get_attribute_value(a) for a in first.reduce.attribute}
    last = output if output and first.target is None else None
    summed = editor.op(
        "ReduceSum", [joined, *first.reduce.input[1:]], f"sum{index}", outputs=[last] if last else None, **attributes
    )
    if first.target is None:
        return summed
    return editor.op("Reshape", [summed, first.target], f"sum{index}_shaped", outputs=[output] if output else None)


def _concatenated(
    editor: GraphEditor, names: list[str], axis: int, seen: _Graph, hint: str
) -> tuple[str, list[onnx.NodeProto]]:
    """`Concat(names, axis)` of 2-D tensors, or `Transpose(Concat(X, 1 - axis))` when every name is `Transpose(X)`
    (then also the transposes it reads around)."""
    transposes = [t for t in (seen.producers.get(name) for name in names) if t is not None and _is_matrix_transpose(t)]
    if len(transposes) == len(names):
        joined = editor.op("Concat", [t.input[0] for t in transposes], f"{hint}_joined", axis=1 - axis)
        return editor.op("Transpose", [joined], hint, perm=[1, 0]), transposes
    return editor.op("Concat", names, hint, axis=axis), []


def _term(name: str, seen: _Graph) -> _Term | None:
    """The leaf `name` as a product or a reduction term, each of its nodes read once, else None."""
    return _product(name, seen) or _reduction(name, seen)


def _product(name: str, seen: _Graph) -> _Product | None:
    nodes: list[onnx.NodeProto] = []
    node = seen.producers.get(name)
    while node is not None and seen.readers.get(name, 0) == 1:
        nodes.append(node)
        if _is_matrix_transpose(node):
            name = node.input[0]
            node = seen.producers.get(name)
        elif node.op_type == "MatMul" and _default_domain(node):
            return _Product(node.input[0], node.input[1], len(nodes) - 1, tuple(nodes))
        else:
            return None
    return None


def _reduction(name: str, seen: _Graph) -> _Reduction | None:
    node = seen.producers.get(name)
    if node is None or seen.readers.get(name, 0) != 1:
        return None
    target = None
    nodes = [node]
    if node.op_type == "Reshape" and _default_domain(node) and node.input[1] in seen.constants:
        target, name = node.input[1], node.input[0]
        node = seen.producers.get(name)
        if node is None or seen.readers.get(name, 0) != 1:
            return None
        nodes.append(node)
    if node.op_type != "ReduceSum" or not _default_domain(node):
        return None
    if len(node.input) > 1 and node.input[1]:
        constant = seen.constants.get(node.input[1])
        axes = [] if constant is None else [int(a) for a in constant.reshape(-1)]
    else:
        axes = [int(a) for a in _attribute(node, "axes", [])]
    if not axes:
        return None
    keepdims = int(_attribute(node, "keepdims", 1))
    return _Reduction(node.input[0], tuple(axes), keepdims, node, target, tuple(nodes))


def _group_key(term: _Term, shapes: _Shapes, seen: _Graph) -> tuple | None:
    """The terms that can be joined share a key: for products (element type, M, N, parity of transposes) when A is
    [M, K] and B [K, N] with M and N known and K at most MAX_CONTRACTION; for reductions (element type, X's dims
    but the first reduced one, the axes, keepdims, the Reshape's target) when X's dims are known and it has at most
    MAX_REDUCED elements. None: the term joins nothing."""
    if isinstance(term, _Product):
        a, b = shapes.get(term.a), shapes.get(term.b)
        if a is None or b is None or a[0] != b[0] or len(a[1]) != 2 or len(b[1]) != 2:
            return None
        m, n, k = a[1][0], b[1][1], a[1][1]
        if m is None or n is None or not isinstance(k, int) or k > MAX_CONTRACTION:
            return None
        return "product", a[0], m, n, term.transposes % 2
    x = shapes.get(term.x)
    sizes = [d for d in x[1] if isinstance(d, int)] if x is not None else []
    if x is None or not x[1] or len(sizes) != len(x[1]) or math.prod(sizes) > MAX_REDUCED:
        return None
    rank = len(x[1])
    if any(not -rank <= a < rank for a in term.axes):
        return None
    target = None if term.target is None else seen.constants[term.target].tobytes()
    axes = tuple(sorted({a % rank for a in term.axes}))
    joined_axis = term.axes[0] % rank  # the Concat's axis: any size there
    dims = tuple("any" if i == joined_axis else d for i, d in enumerate(x[1]))
    return "reduction", x[0], dims, joined_axis, axes, term.keepdims, target


def _inner_names(root: str, leaves: list[str], producers: dict[str, onnx.NodeProto]) -> list[str]:
    """The outputs of the tree's inner nodes below `root` (the root excluded: the replacement writes it)."""
    stop = set(leaves)
    names: list[str] = []
    pending = list(producers[root].input)
    while pending:
        name = pending.pop()
        if name in stop or name in names:
            continue
        names.append(name)
        pending.extend(producers[name].input)
    return names


def _reader_counts(graph: onnx.GraphProto) -> dict[str, int]:
    """How often each name is read: by a node, a subgraph's node (outer-scope reads) or as a graph output."""
    counts: dict[str, int] = {}
    names = [o.name for o in graph.output]
    for node in graph.node:
        names.extend(node.input)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names.extend(n for sub in attribute.g.node for n in sub.input)
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts


def _is_sum(node: onnx.NodeProto) -> bool:
    return node.op_type in _SUMS and _default_domain(node) and len(node.output) == 1


def _is_matrix_transpose(node: onnx.NodeProto) -> bool:
    return node.op_type == "Transpose" and _default_domain(node) and list(_attribute(node, "perm", [])) == [1, 0]


def _default_domain(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


def _attribute(node: onnx.NodeProto, name: str, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _unsorted_problem(model: onnx.ModelProto) -> Problem:
    """The replacement takes the root's place: a node must come after the nodes it reads."""
    return unsorted_input(model.graph)


SUMMED_USES_TO_ONE = FunctionPass("summed_uses_to_one", summed_uses_to_one, _unsorted_problem)
