"""Recompute on the torch builder: activation checkpointing of the traced joint graph by AOTAutograd's partitioner.

The legacy options (`graph_transformer.gelu_recompute`, `attn_dropout_recompute`, `transformer_layer_recompute`,
`number_recompute_layers`: `RecomputePlan`, graph/recompute.py) select forward nodes of the joint forward+backward
graph `torch_builder.py` traced; `recompute_joint` tags them as PyTorch's selective activation checkpointing does
(`torch_private/partitioning.py`), lets `default_partition` split the graph into a forward that saves every value
the backward reads except the tagged ones and a backward that recomputes those, and joins the two again into one
graph for ONNX. Rules:

- Selection (forward nodes only):
  - `gelu_recompute`: each `aten.gelu`, with the views and copies of its output: the GELU output is recomputed from
    the GELU input, which GELU's gradient keeps anyway;
  - `attn_dropout_recompute`: each dropout (`aten.native_dropout` in training mode) whose input comes from a
    softmax (through views, copies, the masking `where` of PyTorch's attention and the product by a row mask of
    the builder's own `_safe_softmax`, gradient/torch_decompositions.py) and whose output feeds a matmul:
    the attention probabilities after dropout;
  - `transformer_layer_recompute`: every node inside a layer of the model's transformer layers (`layer_nodes`: the
    nodes between the layer's input and its output, marked while tracing by `layer_boundaries`); the layer's output
    (the next layer's input) is saved. `number_recompute_layers` 0: all layers but the last; N: the first N (more
    than all but the last: all but the last, with a note).
- Dropout: a random op is never recomputed (a second draw would differ). A selected dropout's output is recomputed
  instead from its input and its kept mask as ONNX Runtime's Dropout computes it, `where(mask, x / (1 - p), 0)`
  (verified bit for bit on onnxruntime 1.19.2 and 1.32.0, docs/engine.md §17): the forward keeps reading the
  Dropout, the backward reads the recomputation.
- Placement: each group of recomputed nodes goes right before the first backward node that reads it, and its
  inputs from outside the group (kept activations) pass through `after(x, dep)` gates (`torch_private.custom_ops`),
  `dep` being that reader's latest-computed backward input: so in any order ONNX Runtime picks the copies run
  late, and neither torch.onnx's nor ONNX Runtime's common-subexpression elimination merges a copy back into its
  forward original (which would keep the activation alive again). A copy that reads only weights or constants is
  merged (it costs a weight-sized tensor at most).
- Notes (the caller warns): an option whose selection is empty, or none of whose selected values the backward
  reads (a GELU followed by a dropout: the backward keeps the dropout's output instead), recomputes nothing; a
  layer count above all but the last is clipped.

The graph's results are unchanged: the recomputation runs the same ops on the same values (the tests compare
trained weights with and without each option).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx

from ..graph.recompute import RecomputePlan
from .torch_private import custom_ops
from .torch_private.partitioning import is_forward, is_random, is_tagged, is_view, partition, tag_recompute

aten = torch.ops.aten

# ops recompute may pass through after a selected value: views, copies, and the trace's own markers
_PASSTHROUGH = (aten.clone.default, aten._unsafe_view.default, aten.alias.default, custom_ops.ACTIVATION_MARK)
_SOFTMAX = (aten._softmax.default, aten._safe_softmax.default)
_MATMUL = (aten.bmm.default, aten.mm.default, aten.matmul.default, aten.addmm.default)
_ATTENTION_PATH = (aten.where.self, aten._to_copy.default, aten.masked_fill.Scalar, aten.mul.Tensor)


@dataclass(frozen=True)
class Recomputed:
    """What `recompute_joint` did: the graph, how many nodes the backward recomputes, and notes to warn."""

    graph: fx.GraphModule
    count: int
    notes: list[str]


def recompute_joint(
    joint: fx.GraphModule, plan: RecomputePlan, forward_outputs: int, layers: list[list[fx.Node]]
) -> Recomputed:
    """Apply `plan` to `joint` (module docstring); its first `forward_outputs` outputs are the forward's. `layers`:
    the nodes of each transformer layer, in execution order (`layer_nodes`). `joint` is modified."""
    notes: list[str] = []
    chosen: dict[str, list[fx.Node]] = {}
    region = iter(range(1, 1 << 30))
    if plan.layers is not None:  # first: a GELU or dropout inside a recomputed layer belongs to the layer's region
        count = len(layers) - 1 if plan.layers == 0 else min(plan.layers, len(layers) - 1)
        if count < 1:
            notes.append(
                f"graph_transformer.transformer_layer_recompute: found {len(layers)} transformer layer(s) (the "
                "members of the model's largest torch.nn.ModuleList), and the last is never recomputed; nothing is "
                "recomputed for it"
            )
        elif plan.layers > count:
            notes.append(
                f"graph_transformer.number_recompute_layers={plan.layers} is more than the {len(layers) - 1} layers "
                f"that can be recomputed (all but the last); using {count}"
            )
        chosen["transformer_layer_recompute"] = [
            m for nodes in layers[: max(count, 0)] for m in _tag_layer(joint, nodes, next(region))
        ]
    if plan.gelu:
        gelus = [n for n in joint.graph.nodes if n.target is aten.gelu.default and is_forward(n)]
        chosen["gelu_recompute"] = [m for g in gelus for m in _tag_with_views(g, next(region))]
        if not gelus:
            notes.append("graph_transformer.gelu_recompute: the graph has no GELU; nothing is recomputed for it")
    if plan.attention_dropout:
        dropouts = [n for n in joint.graph.nodes if _is_attention_dropout(n)]
        chosen["attn_dropout_recompute"] = [m for d in dropouts for m in _recomputed_dropout(joint, d, next(region))]
        if not dropouts:
            notes.append(
                "graph_transformer.attn_dropout_recompute: the graph has no dropout between a softmax and a matmul "
                "(attention dropout with p > 0 in training mode); nothing is recomputed for it"
            )
    if not any(chosen.values()):
        return Recomputed(joint, 0, notes)
    fw, bw = partition(joint, forward_outputs)
    graph, groups = _join(joint, fw, bw, forward_outputs)
    recomputed = {origin for group, _ in groups for node in group for origin in [node.meta["orttrainer_recompute"]]}
    for option, nodes in chosen.items():
        if nodes and not recomputed.intersection(n.name for n in nodes):
            why = " (a dropout follows each GELU: its output is what the backward keeps)" if option[0] == "g" else ""
            notes.append(
                f"graph_transformer.{option}: the backward pass reads none of the activations it selects{why}; "
                "nothing is recomputed for it"
            )
    _gate(graph, groups)
    return Recomputed(graph, sum(len(group) for group, _ in groups), notes)


def _tag_with_views(node: fx.Node, region: int) -> list[fx.Node]:
    """Tag `node` and the forward views and copies of its output (what the backward reads of it)."""
    tagged, todo = [], [node]
    while todo:
        current = todo.pop()
        if is_tagged(current):
            continue
        tag_recompute(current, region)
        tagged.append(current)
        todo.extend(u for u in current.users if is_forward(u) and (is_view(u) or u.target in _PASSTHROUGH))
    return tagged


def _is_attention_dropout(node: fx.Node) -> bool:
    """A training-mode dropout fed by a softmax and read by a matmul (module docstring)."""
    if not (node.target is aten.native_dropout.default and is_forward(node) and _dropout_parameters(node)):
        return False
    source, steps = node.args[0], 0
    while isinstance(source, fx.Node) and source.target not in _SOFTMAX and steps < 8:
        if not (is_view(source) or source.target in _PASSTHROUGH or source.target in _ATTENTION_PATH):
            return False
        floats = [a for a in source.all_input_nodes if _floating(a) and not _mask_like(a)]
        if source.target is aten.mul.Tensor and len(floats) != 1:
            return False  # a product on the path only by a mask, as `_safe_softmax`'s
        source, steps = (floats[-1] if floats else None), steps + 1
    if not (isinstance(source, fx.Node) and source.target in _SOFTMAX):
        return False
    output = _getitem(node, 0)
    readers, seen = list(output.users) if output is not None else [], set()
    while readers:
        reader = readers.pop()
        if reader in seen or not is_forward(reader):
            continue
        seen.add(reader)
        if reader.target in _MATMUL:
            return True
        if is_view(reader) or reader.target in _PASSTHROUGH:
            readers.extend(reader.users)
    return False


def _dropout_parameters(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(input, p) of a training-mode `native_dropout` with 0 < p < 1, else None."""
    x, p, *rest = node.args
    train = rest[0] if rest else node.kwargs.get("train", True)
    if not isinstance(x, fx.Node) or not isinstance(p, float) or not 0.0 < p < 1.0 or train is False:
        return None
    return x, p


def _getitem(node: fx.Node, index: int) -> fx.Node | None:
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == index), None)


def _recomputed_dropout(joint: fx.GraphModule, dropout: fx.Node, region: int) -> list[fx.Node]:
    """The backward's copy of a dropout's output: `where(mask, x / (1 - p), 0)` from the kept mask, and copies of
    the forward views of the output on top of it, all tagged for recomputation; the backward readers of the output
    and of its views read the copies instead (module docstring). Returns the tagged nodes."""
    parameters = _dropout_parameters(dropout)
    output, mask = _getitem(dropout, 0), _getitem(dropout, 1)
    if parameters is None or output is None or mask is None:
        return []
    x, p = parameters
    views = _forward_views(output)
    if not any(not is_forward(u) for node in [output, *views] for u in node.users):
        return []
    keep = float(torch.tensor(1.0, dtype=torch.float32) - torch.tensor(p, dtype=torch.float32))  # Dropout's 1 - p
    graph = joint.graph
    value = output.meta["val"]
    last = max([mask, output, *views], key=_position)
    following = last.next
    with graph.inserting_before(following):  # after the dropout's outputs and views, in this order
        scaled = graph.call_function(aten.div.Tensor, (x, keep))
        zero = graph.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": value.dtype, "device": value.device})
        copy = graph.call_function(aten.where.self, (mask, scaled, zero))
        scalar = _fake_like(torch.empty((), dtype=value.dtype, device=value.device), value)
        for node, val in ((scaled, value), (zero, scalar), (copy, value)):
            node.meta.update(partitioner_tag="is_forward", val=val)
        copies = {output: copy}
        for view in views:  # in graph order: a view's source is copied before it
            copies[view] = graph.node_copy(view, lambda n: copies.get(n, n))
    tagged = [scaled, zero, *copies.values()]
    for node in tagged:
        tag_recompute(node, region)
    for original, duplicate in copies.items():
        for reader in [u for u in original.users if not is_forward(u)]:
            reader.replace_input_with(original, duplicate)
    return tagged


def _forward_views(node: fx.Node) -> list[fx.Node]:
    """The forward views and copies of `node`'s value (transitively), in graph order."""
    found: set[fx.Node] = set()
    todo = list(node.users)
    while todo:
        user = todo.pop()
        if user in found or not is_forward(user) or not (is_view(user) or user.target in _PASSTHROUGH):
            continue
        found.add(user)
        todo.extend(user.users)
    return sorted(found, key=_position)


def _fake_like(value: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """A value of `value`'s shape and dtype in `fake`'s fake mode (a node's `meta["val"]`)."""
    if value.shape == fake.shape:
        return fake
    mode = getattr(fake, "fake_mode", None)
    if mode is None:
        return value
    with mode:
        return torch.empty(value.shape, dtype=value.dtype, device=fake.device)


def _tag_layer(joint: fx.GraphModule, nodes: list[fx.Node], region: int) -> list[fx.Node]:
    """Tag the layer's recomputable nodes (tensor values, not random, not mutating); its dropouts get a copy
    from their masks. Returns the tagged nodes."""
    tagged: list[fx.Node] = []
    for node in nodes:
        if node.target is aten.native_dropout.default:
            tagged += _recomputed_dropout(joint, node, region)
        elif _recomputable(node):
            tag_recompute(node, region)
            tagged.append(node)
    return tagged


def _recomputable(node: fx.Node) -> bool:
    if node.op != "call_function" or is_random(node) or is_tagged(node):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and not is_random(source)
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):  # a multi-output op (layer norm): its outputs are read through getitems
        return all(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def _mask_like(node: fx.Node) -> bool:
    """A constant fill, or a bool tensor cast to a float: a select's or a product's mask, not the value it masks."""
    if node.target is aten.full_like.default:
        return True
    source = node.args[0] if node.target is aten._to_copy.default and node.args else None
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _floating(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _position(node: fx.Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)


Group = tuple[list[fx.Node], fx.Node | None]  # recomputed nodes placed together, and the value they wait for


def _join(
    joint: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule, forward_outputs: int
) -> tuple[fx.GraphModule, list[Group]]:
    """One graph computing `fw` then `bw` (the partitioner's graphs), each recomputed node of `bw` placed right
    before its first reader; returns it with the groups of recomputed nodes and what each group waits for."""
    graph = fx.Graph()
    by_name: dict[str, fx.Node] = {}
    forward_env: dict[fx.Node, fx.Node] = {}
    saved: list = []
    for node in fw.graph.nodes:
        if node.op == "output":
            saved = list(node.args[0])
            continue
        forward_env[node] = by_name[node.name] = graph.node_copy(node, lambda n: forward_env[n])

    def recomputed(node: fx.Node) -> bool:  # a forward node of the joint graph, copied into the backward
        return node.op == "call_function" and is_forward(node)

    env: dict[fx.Node, fx.Node] = {}
    order: dict[fx.Node, int] = {}  # position of each backward node made so far
    groups: list[Group] = []
    last_backward: fx.Node | None = None
    gradients: list = []

    def realize(node: fx.Node, group: list[fx.Node]) -> None:
        for source in node.all_input_nodes:
            if source not in env:
                realize(source, group)
        env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].meta["orttrainer_recompute"] = node.name
        env[node].meta["partitioner_tag"] = "is_backward"
        group.append(env[node])

    for node in bw.graph.nodes:
        if node.op == "placeholder":
            env[node] = by_name[node.name]
        elif node.op == "output":
            gradients = [env[a] if isinstance(a, fx.Node) else a for a in node.args[0]]
        elif not recomputed(node):
            group: list[fx.Node] = []
            for source in node.all_input_nodes:
                if source not in env:
                    realize(source, group)
            if group:
                made = [env[s] for s in node.all_input_nodes if env[s] in order]
                groups.append((group, max(made, key=order.__getitem__) if made else last_backward))
            env[node] = graph.node_copy(node, lambda n: env[n])
            order[env[node]] = len(order)
            if isinstance(node.meta.get("val"), torch.Tensor):
                last_backward = env[node]
    outputs = [forward_env[o] for o in saved[:forward_outputs]]
    loss = outputs[0] if outputs else None
    graph.output((*outputs, *gradients))
    groups = [(group, dep if dep is not None else loss) for group, dep in groups]
    return fx.GraphModule(joint, graph), groups


def _gate(module: fx.GraphModule, groups: list[Group]) -> None:
    """Route each group's inputs from outside it (tensors that are not weights or constants) through
    `after(x, dep)`, inserted before the group (module docstring)."""
    graph = module.graph
    for group, dep in groups:
        if dep is None:
            continue
        members, gated = set(group), {}
        with graph.inserting_before(group[0]):
            for node in group:
                if not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
                    continue  # a size read: no data, nothing to keep late
                for source in node.all_input_nodes:
                    if source in members or source.op in ("placeholder", "get_attr"):
                        continue
                    if not isinstance(source.meta.get("val"), torch.Tensor):
                        continue
                    if source not in gated:
                        gated[source] = graph.call_function(custom_ops.AFTER, (source, dep))
                        gated[source].meta.update(val=source.meta["val"], partitioner_tag="is_backward")
                    node.replace_input_with(source, gated[source])
    graph.lint()


def transformer_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer layers: the members of its largest `torch.nn.ModuleList` (by parameter count) of at
    least two modules of one class, in list order."""
    best: list[torch.nn.Module] = []
    best_size = -1
    for child in module.modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) < 2:
            continue
        if len({type(m) for m in child}) != 1:
            continue
        size = sum(p.numel() for p in child.parameters())
        if size > best_size:
            best, best_size = list(child), size
    return best


@contextlib.contextmanager
def layer_boundaries(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, each transformer layer's tensor inputs and outputs pass through `layer_boundary` marks
    ('in:<k>' / 'out:<k>'), so a trace records where each layer starts and ends (`layer_nodes`)."""
    handles = []
    for k, layer in enumerate(transformer_layers(module)):

        def before(mod, args, kwargs, k=k):
            return _map(args, f"in:{k}"), _map(kwargs, f"in:{k}")

        def after_(mod, args, kwargs, output, k=k):
            return _map(output, f"out:{k}")

        handles.append(layer.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(layer.register_forward_hook(after_, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _map(value, tag: str):
    if isinstance(value, torch.Tensor):
        return custom_ops.layer_boundary(value, tag)
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_map(v, tag) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, tag) for k, v in value.items()}
    return value


def layer_nodes(joint: fx.GraphModule) -> list[list[fx.Node]]:
    """The nodes inside each layer marked by `layer_boundaries`, in layer order: forward nodes that depend on one of
    the layer's inputs and that one of its outputs depends on, the outputs themselves excluded, and the layer's side
    values — forward nodes computed from those alone (and from values outside the layer) that no output depends on,
    such as the aliases and layer-norm statistics only the backward reads, which would otherwise be saved. Removes
    the marks (each reader reads the marked value). A layer whose marks are missing is left out."""
    marks: dict[int, dict[str, list[fx.Node]]] = {}
    for node in joint.graph.nodes:
        if node.target is custom_ops.LAYER_BOUNDARY:
            side, index = str(node.args[1]).split(":")
            marks.setdefault(int(index), {"in": [], "out": []})[side].append(node)
    layers: list[list[fx.Node]] = []
    for k in sorted(marks):
        inputs, outputs = marks[k]["in"], marks[k]["out"]
        below = _descendants(inputs)
        ends = {o.args[0] for o in outputs if isinstance(o.args[0], fx.Node)}
        above = _ancestors(list(ends))
        members = {n for n in below if n in above and n not in ends and is_forward(n)}
        for node in joint.graph.nodes:  # the side values, in graph order: their sources come first
            if node in below and node not in members and node not in ends and is_forward(node):
                if all(s in members or s in inputs or s not in below for s in node.all_input_nodes):
                    members.add(node)
        layers.append([n for n in joint.graph.nodes if n in members and n.target is not custom_ops.LAYER_BOUNDARY])
    for node in [n for n in joint.graph.nodes if n.target is custom_ops.LAYER_BOUNDARY]:
        source = node.args[0]
        assert isinstance(source, fx.Node)
        node.replace_all_uses_with(source)
        joint.graph.erase_node(node)
    return [nodes for nodes in layers if nodes]


def _descendants(start: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(start)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(u for u in node.users if is_forward(u) or u.target is custom_ops.LAYER_BOUNDARY)
    return seen


def _ancestors(start: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(start)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return seen
