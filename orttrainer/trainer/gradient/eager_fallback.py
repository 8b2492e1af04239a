"""The torch builder's eager fallback: aten ops that torch.onnx cannot translate run in PyTorch inside the graph.

Rule: a node of the traced joint graph (forward or backward) runs eagerly when torch.onnx has no ONNX translation
for its op (`torch_private.has_translation`: most of `torch.linalg` — solve, inv, cholesky, eigh, svd, qr, lu,
det —, Bessel functions, `cdist`...), when its translation is known to be wrong (`BROKEN_TRANSLATIONS`, and on
onnxruntime-training 1.19 `BROKEN_ON_TRAINING_BUILD`), or when its translation fails on it (the exporter names
the node; the export is tried again with that node eager, up to `MAX_RETRIES` times). Every other node stays
plain ONNX: a graph that translates has no eager node.

How (`export_with_eager_fallback`): the eager nodes are cut out of the fx graph — each output becomes a new graph
input, each computed tensor input a new graph output placed before the contract's outputs — the rest is exported
by torch.onnx as usual, and the ONNX graph is stitched back: the new inputs and outputs go, and one custom node per
cut node (`runtime/eager_ops.py`: its op, arguments and dtypes in an attribute, float64 across the boundary with
Cast nodes either side) connects them; the node list is sorted topologically again. ONNX Runtime runs the node
through onnxruntime-extensions' Python custom ops, which calls `torch.ops.<op>` on the CPU. The eval-mode forward,
which torch.onnx exports from the module, gets the same nodes through a translation of each op it fails on
(`with_eager_translations`). What this rests on is in docs/engine.md §18.

Limits (clear errors): in the joint graph the eager nodes' output shapes must be static (a dynamic-shape trace
falls back to the shapes of the sample, `torch_builder.build_torch_gradient_graph`); every output of such an op
is a tensor, read through `getitem`; at most `eager_ops.MAX_INPUTS` tensor inputs and `eager_ops.MAX_OUTPUTS`
outputs; non-tensor arguments are plain values, dtypes, devices, layouts or memory formats. The cost: each eager
node copies its inputs and outputs through host memory (as float64) and ONNX Runtime cannot fuse or plan across it.
"""

from __future__ import annotations

import copy
import logging
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import onnx
import torch

from ...dtypes import onnx_to_torch, torch_to_onnx
from ..runtime import eager_ops
from . import torch_private

_logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_RETRIES = 32  # exports tried again after a translation fails on a node (each makes one more node eager)

# Value checks that raise on bad input in eager PyTorch and return nothing: left out of the graph. The trace leaves
# `_linalg_check_errors` out already (`torch_private.linalg_checks_untraced`), unless a trace before it ran with the
# check effectful (seen in one process after such a trace).
DROPPED_CHECKS = {"aten._linalg_check_errors.default"}

# Ops whose torch.onnx translation exists but writes a graph ONNX Runtime refuses, so no retry can see it fail.
BROKEN_TRANSLATIONS = {
    "aten._linalg_det.default": "torchlib returns one value for its three outputs: its getitems become SequenceAt "
    "on a tensor, which ONNX Runtime refuses at session creation (torch.linalg.det, onnxscript 0.7.2)",
    "aten.special_erfcx.default": "torchlib computes exp(x²)·(1 − erf(x)): 1 − erf cancels to 0 from x ≈ 4 in "
    "float32 and the product is inf · 0 = NaN past x ≈ 9, where erfcx is about 1/(x√π); torch.special.log_ndtr, "
    "which PyTorch decomposes through erfcx, gave a NaN loss for an argument below about −5 (onnxscript 0.7.2)",
}


# Ops whose translation onnxruntime-training 1.19 (the training build) cannot run, though newer runtimes do.
BROKEN_ON_TRAINING_BUILD = {
    "aten._fft_c2r.default": "its DFT node has `onesided` and `inverse` set, which ONNX Runtime 1.19's shape "
    "inference refuses (irfft, hfft; the maintained runtime runs it)",
}


def _broken() -> set[str]:
    from ..runtime.ort import has_training_build

    return set(BROKEN_TRANSLATIONS) | (set(BROKEN_ON_TRAINING_BUILD) if has_training_build() else set())


def export_with_eager_fallback(
    graph: torch.fx.GraphModule,
    args: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    opset_version: int,
    dynamic_dims: Sequence[Sequence[int]] | None = None,
) -> onnx.ModelProto:
    """`torch_private.export_graph_to_onnx` of `graph`, with the nodes it cannot translate run eagerly (module
    docstring). Raises the exporter's error when a failing node cannot be found or made eager."""
    torch_private.views_as_reshapes(graph)  # as the export does, so that the exporter's node names match ours
    _drop_checks(graph)
    broken = _broken()
    eager = [
        n.name
        for n in graph.graph.nodes
        if n.op == "call_function"
        and (str(n.target) in broken or not torch_private.has_translation(n.target, opset_version))
    ]
    for _ in range(MAX_RETRIES + 1):
        try:
            if not eager:
                return torch_private.export_graph_to_onnx(
                    graph, args, input_names, output_names, opset_version, dynamic_dims
                )
            return _export_cut(graph, eager, args, input_names, output_names, opset_version, dynamic_dims)
        except Exception as err:
            failed = torch_private.failed_node(err)
            found = [] if failed is None else _exported_node(graph, eager, *failed)
            if not found:
                raise
            _logger.info("torch.onnx could not translate %s (%s): it runs eagerly", found, failed)
            eager += found
    raise RuntimeError(f"torch.onnx failed on more than {MAX_RETRIES} nodes of the graph")


def _drop_checks(graph: torch.fx.GraphModule) -> None:
    """Rule: `DROPPED_CHECKS` nodes go (in place). Why: they return nothing, and ONNX Runtime would prune an eager
    node whose outputs nothing reads; the graph then behaves as the `_ex` variants do (README: Gradient builders)."""
    dropped = [n for n in graph.graph.nodes if n.op == "call_function" and str(n.target) in DROPPED_CHECKS]
    for node in dropped:
        if not node.users:
            graph.graph.erase_node(node)
    if dropped:
        graph.recompile()


def _exported_node(graph: torch.fx.GraphModule, eager: list[str], name: str, op: str) -> list[str]:
    """Our names for the node the exporter calls `name` (`torch_private.failed_node`): the k-th node of `op`'s
    name among the nodes not yet eager for `<opname>_k`; every such node of `op` when that one is not `op`."""
    base = op.split(".")[1]
    suffix = name.removeprefix(base).removeprefix("_")
    index = int(suffix) if suffix.isdigit() else 0
    candidates = [
        n
        for n in graph.graph.nodes
        if n.op == "call_function" and n.name not in eager and str(n.target).split(".")[1:2] == [base]
    ]
    if index < len(candidates) and str(candidates[index].target) == op:
        return [candidates[index].name]
    return [n.name for n in candidates if str(n.target) == op]


@dataclass
class _EagerNode:
    """A node cut out of the fx graph: its op, the fx names of its tensor inputs (one per use), its outputs' new
    placeholder names, their dtypes and the `eager_ops` call attribute."""

    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    output_dtypes: list[torch.dtype]
    call: str


def _export_cut(
    graph: torch.fx.GraphModule,
    eager: list[str],
    args: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    opset_version: int,
    dynamic_dims: Sequence[Sequence[int]] | None,
) -> onnx.ModelProto:
    with warnings.catch_warnings():  # torch 2.13 deprecates a pytree spec check that deepcopy runs
        warnings.simplefilter("ignore", FutureWarning)
        cut = copy.deepcopy(graph)
    placeholders = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
    cut_nodes, samples, extra = _cut(cut, eager)
    new_placeholders = [o for node in cut_nodes for o in node.outputs]
    ops = sorted({node.op for node in cut_nodes})
    _logger.info("ops without an ONNX translation run eagerly in PyTorch: %s", ", ".join(ops))
    model = torch_private.export_graph_to_onnx(
        cut,
        [*args, *samples],
        [*input_names, *new_placeholders],
        [*(f"{name}__eager_input" for name in extra), *output_names],
        opset_version,
        None if dynamic_dims is None else [*dynamic_dims, *([] for _ in samples)],
    )
    fx_names = dict(zip(placeholders, input_names, strict=True))  # fx placeholder -> ONNX input name
    regular_outputs = [getattr(v, "name", None) for v in torch_private.output_values(cut.graph)][len(extra) :]
    inputs = {i.name for i in model.graph.input}
    for name in new_placeholders:
        if name in inputs:
            fx_names[name] = name
        elif name in regular_outputs:  # the value is a contract output: it carries that output's name
            last = max(k for k, o in enumerate(regular_outputs) if o == name)
            fx_names[name] = model.graph.output[len(extra) + last].name
        else:
            fx_names[name] = name
    for k, name in enumerate(extra):
        fx_names[name] = model.graph.output[k].name
    _stitch(model, cut_nodes, fx_names, len(extra), {fx_names[n] for n in new_placeholders}, graph)
    return model


def _cut(graph: torch.fx.GraphModule, eager: list[str]) -> tuple[list[_EagerNode], list[torch.Tensor], list[str]]:
    """Cut the `eager` nodes out of `graph` (in place): returns them, sample values of their new placeholders (in
    graph order, after the others) and the fx names of the computed tensors they read, now the first outputs."""
    fx = graph.graph
    nodes = {n.name: n for n in fx.nodes}
    order = {n.name: k for k, n in enumerate(fx.nodes)}
    last = [n for n in fx.nodes if n.op == "placeholder"][-1]
    cut_nodes: list[_EagerNode] = []
    samples: list[torch.Tensor] = []
    for name in sorted(eager, key=order.__getitem__):
        node = nodes[name]
        cut_node, outputs = _describe(node, len(cut_nodes))
        placeholders = []
        for out_name, value in zip(cut_node.outputs, outputs, strict=True):
            with fx.inserting_after(last):
                last = fx.placeholder(out_name)
            last.meta["val"] = value
            placeholders.append(last)
            samples.append(torch.zeros(value.shape, dtype=value.dtype))
        if isinstance(node.meta["val"], torch.Tensor):
            node.replace_all_uses_with(placeholders[0])
        else:
            for user in list(node.users):
                if user.target is not operator.getitem:
                    raise ValueError(f"{cut_node.op} runs eagerly, but {user.name} reads its outputs as one tuple")
                user.replace_all_uses_with(placeholders[user.args[1]])
                fx.erase_node(user)
        fx.erase_node(node)
        cut_nodes.append(cut_node)
    computed = {i: None for c in cut_nodes for i in c.inputs if nodes.get(i) is None or nodes[i].op != "placeholder"}
    extra = [i for i in computed if i not in {o for c in cut_nodes for o in c.outputs}]
    out = fx.output_node()
    by_name = {n.name: n for n in fx.nodes}
    out.args = (tuple([*(by_name[i] for i in extra), *torch_private.output_values(fx)]),)
    fx.lint()
    graph.recompile()
    return cut_nodes, samples, extra


def _describe(node: torch.fx.Node, index: int) -> tuple[_EagerNode, list[torch.Tensor]]:
    """The eager node for fx `node` and its output values (fake tensors); ValueError when it cannot be one."""
    op = str(node.target)
    inputs: list[str] = []
    dtypes: list[torch.dtype] = []

    def encoded(value: object) -> object:
        """`value` with each tensor argument (an fx node) as `{"input": k}`, recording it as the k-th input."""
        if isinstance(value, torch.fx.Node):
            meta = value.meta.get("val")
            if not isinstance(meta, torch.Tensor):
                raise ValueError(f"{op} runs eagerly, but its argument {value.name} is not a tensor ({meta!r})")
            inputs.append(value.name)
            dtypes.append(meta.dtype)
            return {"input": len(inputs) - 1}
        if isinstance(value, (list, tuple)):
            return [encoded(v) for v in value]
        if isinstance(value, dict):
            return {k: encoded(v) for k, v in value.items()}
        return value

    arguments = (encoded(list(node.args)), encoded(dict(node.kwargs)))
    val = node.meta.get("val")
    outputs = [val] if isinstance(val, torch.Tensor) else list(val) if isinstance(val, (tuple, list)) else []
    if not outputs or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise ValueError(f"{op} runs eagerly, which needs tensor outputs; it returns {val!r}")
    if not all(isinstance(d, int) for o in outputs for d in o.shape):
        shapes = [list(o.shape) for o in outputs]
        raise ValueError(f"{op} runs eagerly, which needs static output shapes; it returns {shapes}")
    eager_ops.op_type(len(inputs), len(outputs))  # within the limits
    call = eager_ops.encode_call(op, arguments, dtypes, [o.dtype for o in outputs])
    names = [f"{node.name}__eager_{index}_{k}" for k in range(len(outputs))]
    return _EagerNode(node.name, op, inputs, names, [o.dtype for o in outputs], call), outputs


def _stitch(
    model: onnx.ModelProto,
    cut_nodes: list[_EagerNode],
    names: dict[str, str],
    n_extra: int,
    removed_inputs: set[str],
    graph: torch.fx.GraphModule,
) -> None:
    """Rule: the first `n_extra` outputs and the inputs `removed_inputs` of `model` go (the latter become value
    infos); each cut node becomes Casts to float64, the eager node and Casts back; nodes end in topological order."""
    g = model.graph
    del g.output[:n_extra]
    outputs = {o.name for o in g.output}
    kept = [i for i in g.input if i.name not in removed_inputs]
    g.value_info.extend(i for i in g.input if i.name in removed_inputs and i.name not in outputs)
    del g.input[:]
    g.input.extend(kept)
    known = {i.name for i in g.input} | {i.name for i in g.initializer}
    fx_nodes = {n.name: n for n in graph.graph.nodes}
    for name in {i for c in cut_nodes for i in c.inputs}:  # an input only an eager node reads may have been dropped
        node = fx_nodes.get(name)
        if node is not None and node.op == "placeholder" and names[name] not in known:
            value = node.meta["val"]
            g.input.append(onnx.helper.make_tensor_value_info(names[name], _onnx_type(value.dtype), list(value.shape)))
            known.add(names[name])
    _real_view_constants(model, {names[i] for c in cut_nodes for i in c.inputs})
    new_nodes = []
    for c in cut_nodes:
        to_double = [f"{c.name}__eager_in{k}" for k in range(len(c.inputs))]
        from_double = [f"{o}__f64" for o in c.outputs]
        for source, target in zip(c.inputs, to_double, strict=True):
            new_nodes.append(onnx.helper.make_node("Cast", [names[source]], [target], to=onnx.TensorProto.DOUBLE))
        new_nodes.append(
            onnx.helper.make_node(
                eager_ops.op_type(len(c.inputs), len(c.outputs)),
                to_double,
                from_double,
                name=f"{c.name}__eager",
                domain=eager_ops.DOMAIN,
                **{eager_ops.CALL_ATTRIBUTE: c.call},
            )
        )
        for source, target, dtype in zip(from_double, c.outputs, c.output_dtypes, strict=True):
            new_nodes.append(onnx.helper.make_node("Cast", [source], [names[target]], to=_onnx_type(dtype)))
    nodes = [*g.node, *new_nodes]
    del g.node[:]
    g.node.extend(topological(nodes, known))
    if all(o.domain != eager_ops.DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(eager_ops.DOMAIN, 1))


def _real_view_constants(model: onnx.ModelProto, read: set[str]) -> None:
    """Rule: a complex initializer that eager nodes read becomes its real view (a trailing dim of 2), the form
    torch.onnx gives complex values elsewhere and eager nodes read. Why: the exporter's constant folding writes a
    complex `aten.full` as a complex initializer, which no ONNX op (Cast included) converts."""
    from onnx import numpy_helper

    complex_types = (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128)
    for initializer in model.graph.initializer:
        if initializer.name in read and initializer.data_type in complex_types:
            array = numpy_helper.to_array(initializer)
            real = np.stack([array.real, array.imag], axis=-1)
            initializer.CopyFrom(numpy_helper.from_array(real, initializer.name))


def _onnx_type(dtype: torch.dtype) -> int:
    """The ONNX element type a tensor of `dtype` has in torch.onnx's graphs (a complex one: its real view)."""
    return torch_to_onnx(dtype.to_real() if dtype.is_complex else dtype)


def topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """`nodes` in an order where every node follows the producers of its inputs (those of its subgraphs' nodes
    included), keeping the given order where it already is one. `available`: the graph's inputs and initializers."""
    producer = {out: k for k, n in enumerate(nodes) for out in n.output if out}
    placed: list[bool] = [False] * len(nodes)
    ordered: list[onnx.NodeProto] = []

    def reads(node: onnx.NodeProto) -> list[str]:
        names = list(node.input)
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                names += [i for n in sub.node for i in reads(n)]
        return names

    for start in range(len(nodes)):
        stack = [(start, False)]
        while stack:
            k, expanded = stack.pop()
            if placed[k]:
                continue
            if expanded:
                placed[k] = True
                ordered.append(nodes[k])
                continue
            stack.append((k, True))
            for name in reversed(reads(nodes[k])):
                j = producer.get(name)
                if j is not None and not placed[j] and name not in available:
                    stack.append((j, False))
    return ordered


def eager_translation(op: str) -> tuple[object, object]:
    """(the op overload, a torch.onnx translation of it that writes the eager node), for a module export
    (`torch_private.export_module_to_onnx`'s `translations`: the eval-mode forward, build/torch_route.py). The
    output count and dtypes come from running the op on meta tensors of the inputs' shapes (dynamic dims: any
    size), the exporter sets the outputs' shapes; complex tensors are not told apart from their real views there,
    so ops on them stay unsupported on this path."""
    namespace, name, overload = op.split(".")
    target = getattr(getattr(getattr(torch.ops, namespace), name), overload)

    def translate(*args: object, **kwargs: object) -> object:
        import onnx_ir as ir

        if op in DROPPED_CHECKS:  # see there
            return None

        values: list = []
        metas: list[torch.Tensor] = []

        def encoded(value: object) -> object:
            if isinstance(value, ir.Value):
                if value.shape is None or value.dtype is None:
                    raise ValueError(f"{op} runs eagerly, which needs inputs of known rank and dtype")
                # only the outputs' count and dtypes are read: a dynamic dim may take any size (2)
                dims = [d if isinstance(d, int) else 2 for d in value.shape]
                values.append(value)
                metas.append(torch.empty(dims, dtype=onnx_to_torch(int(value.dtype)), device="meta"))
                return {"input": len(values) - 1}
            if isinstance(value, (list, tuple)):
                return [encoded(v) for v in value]
            return value

        arguments = (encoded(list(args)), encoded(dict(kwargs)))
        call_args, call_kwargs = eager_ops._decode(eager_ops._encode(arguments), metas)
        result = target(*call_args, **call_kwargs)
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        call = eager_ops.encode_call(op, arguments, [m.dtype for m in metas], [o.dtype for o in outputs])
        doubles = [torch_private.record_node("", "Cast", [v], {"to": onnx.TensorProto.DOUBLE}, 1)[0] for v in values]
        kernel = eager_ops.op_type(len(values), len(outputs))
        results = torch_private.record_node(
            eager_ops.DOMAIN, kernel, doubles, {eager_ops.CALL_ATTRIBUTE: call}, len(outputs)
        )
        cast = [
            torch_private.record_node("", "Cast", [r], {"to": _onnx_type(o.dtype)}, 1)[0]
            for r, o in zip(results, outputs, strict=True)
        ]
        return cast[0] if len(cast) == 1 else tuple(cast)

    return target, translate


def with_eager_translations(export: Callable[[dict], T]) -> T:
    """`export(translations)` (a module export, `eager_translation`), tried again with an eager translation for
    each op torch.onnx names in its error, up to `MAX_RETRIES` times; other errors are raised."""
    translations: dict = {}
    for _ in range(MAX_RETRIES + 1):
        try:
            return export(translations)
        except Exception as err:
            op = torch_private.untranslated_op(err)
            if op is None or op.split(".")[0] not in ("aten", "prims"):
                raise
            target, translate = eager_translation(op)
            if target in translations:
                raise
            _logger.info("torch.onnx could not translate %s: it runs eagerly in the eval-mode forward", op)
            translations[target] = translate
    raise RuntimeError(f"torch.onnx failed on more than {MAX_RETRIES} ops of the module")
