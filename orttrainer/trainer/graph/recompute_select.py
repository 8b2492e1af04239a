"""Which forward nodes recompute selects: GELU outputs, attention dropouts, transformer layers (see the
`recompute` module docstring for the options that choose them)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx

GELU_OPS = ("Gelu", "BiasGelu", "FastGelu")


@dataclass(frozen=True)
class Layer:
    """One transformer layer: its scope prefix and the indices of its interior forward nodes."""

    scope: str
    interior: list[int]


def forward_nodes(graph: onnx.GraphProto, forward_outputs: Iterable[str]) -> set[int]:
    """Indices of the nodes some tensor in `forward_outputs` depends on."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    wanted = [name for name in forward_outputs if name in producer]
    seen: set[int] = set()
    while wanted:
        i = producer.get(wanted.pop())
        if i is None or i in seen:
            continue
        seen.add(i)
        wanted.extend(name for name in graph.node[i].input if name)
    return seen


def gelu_nodes(graph: onnx.GraphProto, forward: set[int]) -> list[int]:
    return [i for i in sorted(forward) if graph.node[i].op_type in GELU_OPS]


def attention_dropout_nodes(graph: onnx.GraphProto, forward: set[int]) -> list[int]:
    """Forward Dropout nodes whose data input comes from a Softmax and whose output a MatMul reads."""
    producer = {out: graph.node[i] for i in forward for out in graph.node[i].output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for i in forward:
        for name in graph.node[i].input:
            readers.setdefault(name, []).append(graph.node[i])
    found = []
    for i in sorted(forward):
        node = graph.node[i]
        if node.op_type != "Dropout" or node.input[0] not in producer:
            continue
        if producer[node.input[0]].op_type == "Softmax" and any(
            r.op_type in ("MatMul", "FusedMatMul") for r in readers.get(node.output[0], [])
        ):
            found.append(i)
    return found


def transformer_layers(graph: onnx.GraphProto, forward: set[int]) -> list[Layer]:
    """The layers of the largest family of `<list>.<k>/` scopes (at least two members) among forward nodes, in
    execution order. A node belongs to a scope by its name or, for nodes ONNX Runtime fused and renamed, by its
    first output's name."""
    families: dict[str, dict[str, list[int]]] = {}
    for i in sorted(forward):
        node = graph.node[i]
        for text in (node.name, node.output[0] if node.output else ""):
            for match in _all_scopes(text):
                family, scope = match
                members = families.setdefault(family, {})
                if i not in members.setdefault(scope, []):
                    members[scope].append(i)
    candidates = [(sum(len(v) for v in m.values()), f) for f, m in families.items() if len(m) >= 2]
    if not candidates:
        return []
    _, family = max(candidates, key=lambda c: c[0])
    # execution order by the median position: the exporter names a constant or shape computation that several layers
    # share after one of them, which may sit anywhere
    scopes = sorted(families[family].items(), key=lambda item: sorted(item[1])[len(item[1]) // 2])
    return [Layer(scope, _interior(graph, forward, set(nodes))) for scope, nodes in scopes]


def _all_scopes(text: str) -> list[tuple[str, str]]:
    """Every `(family, scope)` pair of a slash-separated name: `/a/layers.1/b` -> [('/a/layers.', '/a/layers.1/')]."""
    found = []
    parts = text.split("/")
    for k in range(1, len(parts) - 1):
        head, dot, index = parts[k].rpartition(".")
        if dot and head and index.isdigit():
            prefix = "/".join(parts[:k]) + "/"
            found.append((f"{prefix}{head}.", f"{prefix}{parts[k]}/"))
    return found


def _interior(graph: onnx.GraphProto, forward: set[int], members: set[int]) -> list[int]:
    """`members` minus the nodes whose outputs a forward node outside `members` (or the graph output) reads."""
    outside_reads = {name for i in forward - members for name in graph.node[i].input}
    outside_reads |= {o.name for o in graph.output}
    return sorted(i for i in members if not outside_reads.intersection(graph.node[i].output))
