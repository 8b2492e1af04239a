"""Cast propagation (`graph_transformer.propagate_cast_ops_config`), orttrainer's own pass: the legacy option's
semantics (ONNX Runtime's PropagateCastOps; README § Mixed precision) on the graphs the torch gradient builder makes,
which ONNX Runtime's pass never sees (it runs inside ONNX Runtime's own gradient builder, gradient/ort_options.py).

Terms. A *float16 cast* is `Cast(to=FLOAT16)` of a float32 tensor, a *float32 cast* `Cast(to=FLOAT)` of a float16
tensor. An op type is *allowed* at `level` when it is in `allow`, or `level` ≥ 1 and it is in `LEVEL1_OPS`, or
`level` ≥ 2 and it is in `LEVEL2_OPS` (ONNX Runtime's lists). A node's *relevant* tensors are its float tensors,
except for the op types in `RELEVANT`, where only the listed inputs and outputs count (the data, not a Dropout
ratio or a LayerNormalization's statistics). To *convert* a node is to compute it in float16: each relevant
float32 input is read through a new float16 cast, and each relevant float32 output is renamed, becomes float16, and
a new float32 cast writes the old name — so every reader (graph outputs included) sees the same tensor name and
type as before, and the graph's inputs and outputs never change.

Rules (`apply_cast_propagation`):
- Strategy NONE, or `level` -1: nothing changes (the legacy "no cast propagation").
- A graph without float16 tensors (no float16 input, output, initializer, value_info or float16 cast) is returned
  unchanged: the option moves the casts of mixed precision, so on a float32 model it is a no-op —
  INSERT_AND_REDUCE never brings float16 into a float32 model.
- FLOOD_FILL grows the float16 regions the existing casts mark, across allowed nodes, until nothing changes:
  *up*: an allowed node with relevant float32 outputs, each read only by float16 casts and none a graph output, is
  converted (at level 2 it is enough that one reader is a float16 cast; the others read a float32 cast);
  *down*: an allowed node whose relevant float32 inputs all come from float32 casts is converted (at level 2, one
  such input is enough; the others get a float16 cast); after every round of conversions, the reductions.
- INSERT_AND_REDUCE converts every allowed node that has a relevant float32 input or output, then the reductions.
- Reductions, each until nothing changes (a tensor that is a graph output is never renamed away):
  *back-to-back*: a float16 cast of a float32 cast's output is replaced by that cast's float16 input (float16 ->
  float32 -> float16 is exact; the lossy float32 -> float16 -> float32 stays);
  *siblings*: casts of one tensor to one type become one;
  *no-op*: a cast to its input's own type is replaced by its input;
  *dead*: a cast whose output nothing reads is removed.
Termination: a converted node has no relevant float32 output left, so no node is converted twice, and every
reduction removes a node.

Element types come from the graph's inputs, outputs, initializers and value_info, completed by ONNX shape
inference; a tensor of unknown type is never treated as float (its node is not converted, its cast not reduced).
Converting a node of an op type the user allows is the user's claim that it computes in float16 with one float type
for its data tensors, as with ONNX Runtime's `allow`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

import onnx
from onnx import TensorProto, helper

from .editor import copy_model, fresh_name, graph_value_names
from .passes import FunctionPass, Problem

__all__ = [
    "LEVEL1_OPS",
    "LEVEL2_OPS",
    "STRATEGIES",
    "CastPropagation",
    "apply_cast_propagation",
    "cast_propagation_pass",
    "count_casts",
]

STRATEGIES = ("NONE", "INSERT_AND_REDUCE", "FLOOD_FILL")
LEVEL1_OPS = frozenset({"Expand", "Transpose", "Relu", "Reshape", "Split", "Tanh", "Squeeze", "Unsqueeze"})
LEVEL2_OPS = frozenset({"Add", "BiasGelu", "Dropout", "FastGelu", "Gather", "Gelu", "LayerNormalization", "Where"})
# op type -> (relevant input indices, relevant output indices); other op types: every float tensor
RELEVANT: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "Gather": ((0,), (0,)),
    "Reshape": ((0,), (0,)),
    "Dropout": ((0,), (0,)),
    "Expand": ((0,), (0,)),
    "LayerNormalization": ((0, 1, 2), (0,)),
    "Squeeze": ((0,), (0,)),
    "Unsqueeze": ((0,), (0,)),
}
FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
_PREFIX = "orttrainer/cast_propagation"


@dataclass(frozen=True)
class CastPropagation:
    """The option's three values: `strategy` (a name in STRATEGIES), `level` (-1 turns the pass off) and `allow`."""

    strategy: str = "FLOOD_FILL"
    level: int = 1
    allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown cast propagation strategy {self.strategy!r}; expected one of {STRATEGIES}")

    @property
    def off(self) -> bool:
        return self.strategy == "NONE" or self.level < 0

    def allowed(self, op_type: str) -> bool:
        return (
            op_type in self.allow
            or (self.level >= 1 and op_type in LEVEL1_OPS)
            or (self.level >= 2 and op_type in LEVEL2_OPS)
        )


def count_casts(model: onnx.ModelProto) -> int:
    """The number of float16<->float32 `Cast` nodes (to FLOAT or FLOAT16) in the main graph."""
    return sum(n.op_type == "Cast" and _cast_to(n) in (FLOAT, HALF) for n in model.graph.node)


def apply_cast_propagation(model: onnx.ModelProto, config: CastPropagation) -> onnx.ModelProto:
    """The rules of the module docstring; returns a new model (or `model` itself when nothing applies) and leaves
    `model` unchanged.

    Precondition: none beyond a valid graph; a graph without float16 tensors is returned as it is."""
    if config.off or not has_float16(model):
        return model
    result = copy_model(model)
    state = _State.of(result)
    if config.strategy == "INSERT_AND_REDUCE":
        state.convert([n for n in state.nodes if config.allowed(n.op_type) and state.has_float32(n)])
        state.reduce()
    else:
        state.reduce()
        while state.convert(_flood_candidates(state, config)):
            state.reduce()
    state.write_back()
    return result


def has_float16(model: onnx.ModelProto) -> bool:
    """Whether the main graph has a float16 tensor or a cast to float16."""
    graph = model.graph
    declared = [*graph.input, *graph.output, *graph.value_info]
    return (
        any(v.type.tensor_type.elem_type == HALF for v in declared)
        or any(i.data_type == HALF for i in graph.initializer)
        or any(n.op_type == "Cast" and _cast_to(n) == HALF for n in graph.node)
    )


def cast_propagation_pass(config: CastPropagation) -> FunctionPass:
    return FunctionPass("cast_propagation", partial(apply_cast_propagation, config=config), _no_problem)


def _no_problem(model: onnx.ModelProto) -> Problem:
    return None


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _flood_candidates(state: _State, config: CastPropagation) -> list[onnx.NodeProto]:
    """FLOOD_FILL's *up* and *down* nodes in the current graph (module docstring)."""
    wide = config.level >= 2
    chosen = []
    for node in state.nodes:
        if not config.allowed(node.op_type) or node.op_type == "Cast":
            continue
        outputs = state.relevant_outputs(node)
        readers = [state.consumers.get(name, []) for name in outputs]
        casts = [[state.is_cast(r, HALF) for r in rs] for rs in readers]
        pinned = any(name in state.pinned for name in outputs)
        up = bool(outputs) and (
            any(any(c) for c in casts) if wide else (not pinned and all(c and all(c) for c in casts))
        )
        inputs = state.relevant_inputs(node)
        from_casts = [state.is_cast(state.producer.get(name), FLOAT) for name in inputs]
        down = bool(inputs) and (any(from_casts) if wide else all(from_casts))
        if up or down:
            chosen.append(node)
    return chosen


@dataclass
class _State:
    """The graph being rewritten: its nodes, every tensor's element type and value_info, the names that must keep
    their producer (graph outputs and names read inside subgraphs), and producer/consumer maps (`index`)."""

    graph: onnx.GraphProto
    nodes: list[onnx.NodeProto]
    types: dict[str, int]
    infos: dict[str, onnx.ValueInfoProto]
    pinned: set[str]
    taken: set[str]
    producer: dict[str, onnx.NodeProto] = field(default_factory=dict)
    consumers: dict[str, list[onnx.NodeProto]] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> _State:
        graph = model.graph
        types = _element_types(model)
        infos = {v.name: v for v in graph.value_info}
        pinned = {o.name for o in graph.output} | _names_in_subgraphs(graph)
        taken = graph_value_names(graph) | {n.name for n in graph.node if n.name}
        state = cls(graph, list(graph.node), types, infos, pinned, taken)
        state.index()
        return state

    def index(self) -> None:
        self.producer, consumers = {}, defaultdict(list)
        for node in self.nodes:
            for name in node.output:
                if name:
                    self.producer[name] = node
            for name in dict.fromkeys(node.input):
                if name:
                    consumers[name].append(node)
        self.consumers = dict(consumers)

    # --- what a node is ------------------------------------------------------------------------------------------
    def is_cast(self, node: onnx.NodeProto | None, to: int) -> bool:
        """`node` is a float16 cast (`to`=FLOAT16) or a float32 cast (`to`=FLOAT) by the module's terms."""
        if node is None or node.op_type != "Cast" or _cast_to(node) != to:
            return False
        return self.types.get(node.input[0]) == (FLOAT if to == HALF else HALF)

    def relevant_inputs(self, node: onnx.NodeProto) -> list[str]:
        return self._relevant(node.input, RELEVANT.get(node.op_type, (None, None))[0], FLOAT)

    def relevant_outputs(self, node: onnx.NodeProto) -> list[str]:
        return self._relevant(node.output, RELEVANT.get(node.op_type, (None, None))[1], FLOAT)

    def _relevant(self, names: Iterable[str], positions: tuple[int, ...] | None, elem: int) -> list[str]:
        return [
            name
            for k, name in enumerate(names)
            if name and (positions is None or k in positions) and self.types.get(name) == elem
        ]

    def has_float32(self, node: onnx.NodeProto) -> bool:
        return bool(self.relevant_inputs(node) or self.relevant_outputs(node))

    # --- conversion ----------------------------------------------------------------------------------------------
    def convert(self, chosen: list[onnx.NodeProto]) -> bool:
        """Convert every node in `chosen` (module docstring); True when any was."""
        if not chosen:
            return False
        selected = {id(n) for n in chosen}
        nodes: list[onnx.NodeProto] = []
        for node in self.nodes:
            if id(node) not in selected:
                nodes.append(node)
                continue
            inputs, outputs = self.relevant_inputs(node), self.relevant_outputs(node)
            for name in dict.fromkeys(inputs):
                half = self._fresh_tensor(f"{name}_fp16", name, HALF)
                nodes.append(self._cast(name, half, HALF))
                node.input[:] = [half if value == name else value for value in node.input]
            after = []
            for name in outputs:
                half = self._fresh_tensor(f"{name}_fp16", name, HALF)
                node.output[:] = [half if value == name else value for value in node.output]
                after.append(self._cast(half, name, FLOAT))
            nodes.append(node)
            nodes.extend(after)
        self.nodes = nodes
        self.index()
        return True

    def _fresh_tensor(self, hint: str, like: str, elem: int) -> str:
        name = fresh_name(f"{_PREFIX}/{hint}", self.taken)
        self.types[name] = elem
        source = self.infos.get(like)
        if source is not None:
            info = onnx.ValueInfoProto()
            info.CopyFrom(source)
            info.name = name
            info.type.tensor_type.elem_type = elem
            self.infos[name] = info
        return name

    def _cast(self, source: str, target: str, to: int) -> onnx.NodeProto:
        name = fresh_name(f"{_PREFIX}/{target.rsplit('/', 1)[-1]}_cast", self.taken)
        return helper.make_node("Cast", [source], [target], name=name, to=to)

    # --- reductions ----------------------------------------------------------------------------------------------
    def reduce(self) -> None:
        """The four reductions, each until it changes nothing, repeated until none does."""
        rules = (self._back_to_back, self._siblings, self._no_op, self._dead)
        changed = True
        while changed:
            changed = False
            for rule in rules:
                while self._replace(rule()):
                    changed = True

    def _back_to_back(self) -> dict[int, str]:
        replaced = {}
        for node in self.nodes:
            if self.is_cast(node, HALF):
                parent = self.producer.get(node.input[0])
                if self.is_cast(parent, FLOAT) and parent is not None:
                    replaced[id(node)] = parent.input[0]
        return replaced

    def _siblings(self) -> dict[int, str]:
        first: dict[tuple[str, int | None], str] = {}
        replaced = {}
        for node in self.nodes:
            if node.op_type != "Cast" or self.types.get(node.input[0]) not in (FLOAT, HALF):
                continue
            key = (node.input[0], _cast_to(node))
            if key in first:
                replaced[id(node)] = first[key]
            else:
                first[key] = node.output[0]
        return replaced

    def _no_op(self) -> dict[int, str]:
        return {
            id(n): n.input[0]
            for n in self.nodes
            if n.op_type == "Cast" and _cast_to(n) in (FLOAT, HALF) and self.types.get(n.input[0]) == _cast_to(n)
        }

    def _dead(self) -> dict[int, str]:
        return {
            id(n): ""
            for n in self.nodes
            if n.op_type == "Cast" and _cast_to(n) in (FLOAT, HALF) and not self.consumers.get(n.output[0])
        }

    def _replace(self, replaced: dict[int, str]) -> bool:
        """Remove the cast nodes in `replaced` (by id); their readers read the mapped name instead. A cast whose
        output is pinned stays. True when any node was removed."""
        renames: dict[str, str] = {}
        removed = set()
        for node in self.nodes:
            target = replaced.get(id(node))
            if target is None or node.output[0] in self.pinned:
                continue
            removed.add(id(node))
            if target:
                renames[node.output[0]] = target
        if not removed:
            return False

        def resolve(name: str) -> str:
            while name in renames:
                name = renames[name]
            return name

        kept = [n for n in self.nodes if id(n) not in removed]
        for node in kept:
            node.input[:] = [resolve(name) if name else name for name in node.input]
        self.nodes = kept
        self.index()
        return True

    def write_back(self) -> None:
        """The node list and value_info into the graph: value_info of the tensors that still exist."""
        del self.graph.node[:]
        self.graph.node.extend(self.nodes)
        present = {name for node in self.nodes for name in [*node.input, *node.output]}
        del self.graph.value_info[:]
        self.graph.value_info.extend(info for name, info in self.infos.items() if name in present)


def _element_types(model: onnx.ModelProto) -> dict[str, int]:
    """Every tensor's element type the model declares, completed by ONNX shape inference where it knows more."""
    graph = model.graph
    types: dict[str, int] = {}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    types.update({i.name: i.data_type for i in graph.initializer})
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model shape inference cannot read: the declared types only
        inferred = None
    if inferred is not None:
        for value in inferred.graph.value_info:
            if value.type.tensor_type.elem_type:
                types.setdefault(value.name, value.type.tensor_type.elem_type)
    for node in graph.node:  # a Cast's output type is its `to`, whatever else is declared
        if node.op_type == "Cast" and node.output and _cast_to(node):
            types[node.output[0]] = int(_cast_to(node) or 0)
    return types


def _names_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Names the subgraphs of `graph`'s nodes read (an outer-scope tensor must keep its name)."""
    names: set[str] = set()
    for node in graph.node:
        for attribute in node.attribute:
            bodies = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
            for body in bodies:
                for inner in body.node:
                    names.update(inner.input)
                names |= _names_in_subgraphs(body)
    return names
