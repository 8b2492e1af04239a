"""A gradient summed over a weight's uses as one matrix product.

A weight used at several places — an RNN's recurrent weight at each of its time steps, a tied embedding — gets as
gradient one product per use, added: `dW = A_1·B_1 + A_2·B_2 + ... + A_n·B_n`. The torch builder traces an LSTM
over 64 steps into 64 products of [1024, 16]·[16, 256] and 63 additions into a [1024, 256] accumulator, so the
accumulator is read and written 64 times and each product has a contraction of 16 only. The same sum is one
product of the operands concatenated along the contracted axis, `[A_1 ... A_n]·[B_1; ...; B_n]`: one pass over the
output and one long contraction (6.7 against 10.3 ms for those 64 products in ONNX Runtime, docs/engine.md §21).

Rule (`summed_products_to_one`): a tree of `Add` and `Sum` nodes — every inner node read by the tree only and not a
graph output — whose leaves include n >= 2 products `MatMul(A_k, B_k)`, each read by the tree only, not a graph
output, and seen through a chain (possibly empty) of `Transpose(perm=[1, 0])` nodes read by the tree only, where
shape inference gives A_k the shape [M, K_k] and B_k [K_k, N] with the same element type, M and N for every k and
the same parity of transposes: the products become one, `MatMul(Concat(A_k, axis=1), Concat(B_k, axis=0))`,
transposed once when the parity is odd; the root then writes that product, or the `Sum` of it and the other leaves
when the tree has others. Where every A_k is itself `Transpose(X_k, perm=[1, 0])`, the concatenation is written as
`Transpose(Concat(X_k, axis=0))` (ONNX Runtime folds that transpose into the product; likewise for the B_k), so no
transposed copy is made. Products of different shapes form groups of their own. The nodes this leaves unread are
removed. What changes is the order of the additions, within float rounding; what costs is memory: every A_k and
B_k is kept until the one product, where the chain freed each A_k after its product.

Precondition: the nodes are in topological order (the replacement takes the root's place and reads the leaves'
operands, produced before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from .editor import GraphEditor, copy_model, remove_unread
from .passes import FunctionPass, Problem, require, unsorted_input

_SUMS = ("Add", "Sum")
_Dim = int | str | None


@dataclass(frozen=True)
class _Product:
    """One leaf of a tree: `MatMul(a, b)` seen through `transposes` transposes; `nodes` are those transposes and the
    MatMul."""

    a: str
    b: str
    transposes: int
    nodes: tuple[onnx.NodeProto, ...]


def summed_products_to_one(model: onnx.ModelProto) -> onnx.ModelProto:
    """Apply the rule above; returns a new model (the argument is not modified)."""
    require("summed_products_to_one", _unsorted_problem(model))
    trees = _trees(model.graph)
    if not trees:
        return model
    shapes = _inferred_shapes(model)
    result = copy_model(model)
    graph = result.graph
    producers = {out: node for node in graph.node for out in node.output}
    readers = _reader_counts(graph)
    editor = GraphEditor(graph, "orttrainer/summed_products")
    replacements: dict[str, list[onnx.NodeProto]] = {}
    orphaned: list[onnx.NodeProto] = []
    for root, leaves in trees.items():
        start = len(graph.node)
        replaced = _rewrite(editor, root, leaves, shapes, producers, readers)
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
    """The output of each tree's root -> the tree's leaves, for the trees with at least two product leaves."""
    producers = {out: node for node in graph.node for out in node.output}
    readers = _reader_counts(graph)
    inner: set[str] = set()
    trees: dict[str, list[str]] = {}
    for node in reversed(graph.node):  # a root comes after its tree's inner nodes
        if not _is_sum(node) or node.output[0] in inner:
            continue
        leaves: list[str] = []
        pending = list(reversed(node.input))
        while pending:
            name = pending.pop()
            producer = producers.get(name)
            if producer is not None and _is_sum(producer) and readers.get(name, 0) == 1:
                inner.add(name)
                pending.extend(reversed(producer.input))
            else:
                leaves.append(name)
        if sum(_product(name, producers, readers) is not None for name in leaves) >= 2:
            trees[node.output[0]] = leaves
    return trees


def _rewrite(
    editor: GraphEditor,
    root: str,
    leaves: list[str],
    shapes: dict[str, tuple[int, tuple[_Dim, ...]]],
    producers: dict[str, onnx.NodeProto],
    readers: dict[str, int],
) -> list[onnx.NodeProto] | None:
    """Append the nodes that compute `root` with each group of products as one product; returns the nodes they
    replace (the tree's and the products'), or None when no two products can be joined."""
    groups: dict[tuple, list[_Product]] = {}
    rest: list[str] = []
    for name in leaves:
        product = _product(name, producers, readers)
        key = None if product is None else _group_key(product, shapes)
        if product is None or key is None:
            rest.append(name)
        else:
            groups.setdefault(key, []).append(product)
    joined = [members for members in groups.values() if len(members) >= 2]
    if not joined:
        return None
    rest.extend(p.nodes[0].output[0] for members in groups.values() if len(members) < 2 for p in members)
    replaced = [producers[n] for n in _inner_names(root, leaves, producers)]
    terms: list[str] = []
    for index, members in enumerate(joined):
        last = len(joined) == 1 and not rest
        a, bypassed_a = _concatenated(editor, [p.a for p in members], 1, producers, "lhs")
        b, bypassed_b = _concatenated(editor, [p.b for p in members], 0, producers, "rhs")
        odd = members[0].transposes % 2 == 1
        out = [root] if last and not odd else None
        term = editor.op("MatMul", [a, b], f"product{index}", outputs=out)
        if odd:
            term = editor.op("Transpose", [term], f"product{index}_t", outputs=[root] if last else None, perm=[1, 0])
        terms.append(term)
        replaced.extend([*bypassed_a, *bypassed_b, *(n for p in members for n in p.nodes)])
    if len(terms) + len(rest) > 1:
        editor.op("Sum", [*terms, *rest], "sum", outputs=[root])
    return replaced


def _concatenated(
    editor: GraphEditor, names: list[str], axis: int, producers: dict[str, onnx.NodeProto], hint: str
) -> tuple[str, list[onnx.NodeProto]]:
    """`Concat(names, axis)` of 2-D tensors, or `Transpose(Concat(X, 1 - axis))` when every name is `Transpose(X)`
    (then also the transposes it reads around)."""
    transposes = [t for t in (producers.get(name) for name in names) if t is not None and _is_matrix_transpose(t)]
    if len(transposes) == len(names):
        joined = editor.op("Concat", [t.input[0] for t in transposes], f"{hint}_joined", axis=1 - axis)
        return editor.op("Transpose", [joined], hint, perm=[1, 0]), transposes
    return editor.op("Concat", names, hint, axis=axis), []


def _product(name: str, producers: dict[str, onnx.NodeProto], readers: dict[str, int]) -> _Product | None:
    """The leaf `name` as a product seen through transposes, each node read once, else None."""
    nodes: list[onnx.NodeProto] = []
    node = producers.get(name)
    while node is not None and readers.get(name, 0) == 1:
        nodes.append(node)
        if _is_matrix_transpose(node):
            name = node.input[0]
            node = producers.get(name)
        elif node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
            return _Product(node.input[0], node.input[1], len(nodes) - 1, tuple(nodes))
        else:
            return None
    return None


def _group_key(product: _Product, shapes: dict[str, tuple[int, tuple[_Dim, ...]]]) -> tuple | None:
    """(element type, M, N, parity of transposes) when A is [M, K] and B [K, N] of one element type with M and N
    known, else None."""
    a, b = shapes.get(product.a), shapes.get(product.b)
    if a is None or b is None or a[0] != b[0] or len(a[1]) != 2 or len(b[1]) != 2:
        return None
    m, n = a[1][0], b[1][1]
    if m is None or n is None:
        return None
    return a[0], m, n, product.transposes % 2


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


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[_Dim, ...]]]:
    """Element type and dims (an int, a symbol or None) of every tensor ONNX shape inference types, inferred on a
    copy that declares the float initializers as typed inputs instead of carrying their data."""
    graph = model.graph
    small = [i for i in graph.initializer if i.data_type == TensorProto.INT64 and not i.external_data]
    declared = {v.name for v in graph.input}
    typed = [
        helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
        for i in graph.initializer
        if i.name not in declared and i not in small
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
    shapes: dict[str, tuple[int, tuple[_Dim, ...]]] = {}
    g = inferred.graph
    for value in [*g.input, *g.output, *g.value_info]:
        tensor = value.type.tensor_type
        if tensor.elem_type and tensor.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
            shapes[value.name] = (tensor.elem_type, dims)
    for initializer in small:
        shapes[initializer.name] = (initializer.data_type, tuple(initializer.dims))
    return shapes


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
    return node.op_type in _SUMS and node.domain in ("", "ai.onnx") and len(node.output) == 1


def _is_matrix_transpose(node: onnx.NodeProto) -> bool:
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = next((list(helper.get_attribute_value(a)) for a in node.attribute if a.name == "perm"), None)
    return perm == [1, 0]


def _unsorted_problem(model: onnx.ModelProto) -> Problem:
    """The replacement takes the root's place: a node must come after the nodes it reads."""
    return unsorted_input(model.graph)


SUMMED_PRODUCTS_TO_ONE = FunctionPass("summed_products_to_one", summed_products_to_one, _unsorted_problem)
