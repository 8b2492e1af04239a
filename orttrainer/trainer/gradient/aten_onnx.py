"""A traced aten graph with static shapes, translated to ONNX directly: the torch builder's fast translation.

Rule: `translate(graph, input_names, output_names, opset)` returns an ONNX model computing what `graph` (a
functional aten graph from AOTAutograd, every value's shape and dtype static in `node.meta["val"]`) computes: graph
input i is placeholder i named `input_names[i]`, graph output i is output value i named `output_names[i]`. It
raises `UntranslatableGraph` naming the first node it has no translation for (another op, a symbolic shape, an
unsupported argument); the caller then goes through torch.onnx (gradient/torch_private/exporting.py).

How: one ONNX node (or a few) per aten node, by the aten op's documented semantics:
- elementwise ops compute in the dtype PyTorch's type promotion gives (`torch.result_type` of the arguments), each
  tensor argument cast to it and each Python scalar written as a constant of it; the result is the node's dtype;
- view-like ops (view, reshape, squeeze, unsqueeze, flatten) are a Reshape to the node's static shape, `expand` an
  Expand to it, copies (clone, alias, contiguous) no node at all;
- a node whose tensor arguments are all constants (the graph's `get_attr` tensors, `full`, `arange`, or results of
  such nodes) and whose result has at most `FOLD_LIMIT` elements is computed once by PyTorch and becomes an
  initializer (random ops excepted); larger fills are `ConstantOfShape`;
- `native_dropout` is ONNX Dropout in training mode (outputs: the result and the mask), as torch.onnx writes it, so
  the trainer seeds it like any Dropout (graph/dropout_seeds.py);
- `convolution` is Conv or ConvTranspose with its attributes (the weight gradients of gradient/torch_decompositions.py
  are products, pads and slices), so a CNN's graph needs no second trace for torch.onnx (docs/engine.md §20);
- an LSTM's or GRU's layer's recurrence and its backward (`orttrainer::lstm_recurrence[_backward]`,
  `orttrainer::gru_recurrence[_backward]`, gradient/recurrent_ops.py) are unrolled, feature-major as the ops are: each
  time step's cell as plain ops, the steps' results concatenated where an op other than the backward reads them; the
  forward also computes, per step, the factors the backward multiplies by, so that the backward's step is 8 ops (7
  for a GRU); these ops are looked up by name (`_CUSTOM_TRANSLATIONS`), so that importing this module does not
  register them;
- BatchNorm on its running statistics (`_native_batch_norm_legit_no_training`, which only an eval-mode forward traced
  without a backward keeps) is ONNX BatchNormalization in inference mode, which ONNX Runtime folds into the Conv
  before it;
- a convolution's weight gradient traced as one op (`orttrainer::conv_weight_gradient`, gradient/conv_ops.py) is
  the per-position products its decomposition translates to;
- orttrainer's ordering gate `after(x, dep)` (recompute and `utils.memory_efficient_gradient`) and activation marker
  (`orttrainer.debug` statistics) are the nodes their torch.onnx translations write (gradient/torch_private/
  custom_ops.py), so those options keep the direct translation;
- pooling is ONNX pooling: `avg_pool{2,3}d` AveragePool with aten's divisors, `max_pool{2,3}d_with_indices`
  MaxPool with aten's per-plane indices; GroupNorm (`native_group_norm`) and InstanceNorm
  (`_native_batch_norm_legit.no_stats`) are reductions, advanced indexing (`index.Tensor`, and `index_put` with
  several indices, its backward) Gather, GatherND or ScatterND, `repeat` Tile, `div` with a rounding mode Div and
  Floor, `remainder`/`fmod` Mod, `flip` a backwards Slice, `empty` zeros, `rand`/`randn` ONNX's random ops, as
  torch.onnx writes them (docs/engine.md §30), and `randint` a float64 uniform draw floored (§43);
- what transformers' models meet (docs/engine.md §31): `topk` TopK, `argmax`/`argmin` ArgMax/ArgMin, `slice_scatter`
  with a step ScatterElements, `as_strided` of a tensor that fills its storage (transposed to the storage's order
  first, §34) a Reshape or a Gather at constant positions,
  `bernoulli.p` a uniform draw below p; and (§32) `sort` TopK of every element, `diagonal` a Gather at constant
  positions, logical ops of numbers a Cast to bool first, `scatter_reduce` ScatterElements with ONNX's reductions,
  `log2`/`log10` a Log divided by the base's, `isinf` IsInf, `max`/`min` of every element a reduction, `unfold`
  a Gather of the windows and its backward a ScatterElements adding them, `linalg_vector_norm` of every order;
- a view to its input's own shape is that input's value (no node);
- a complex value is the pair of reals `view_as_real` gives, and each node that reads or makes one is translated by
  gradient/aten_onnx_complex.py (docs/engine.md §35).

Why: torch.onnx re-traces the graph with torch.export, needs onnxscript's table of translations (built from the
source of ~500 functions on first use) and runs a general optimiser; on the benchmark transformer's joint graph
that was 5-10 s of the torch builder's first step against about 0.1 s here (docs/engine.md §19). Values are the
same: tests/test_aten_onnx.py runs both translations of the same graphs through ONNX Runtime.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ...dtypes import torch_to_onnx
from ..graph.statistics import MARK_DOMAIN, MARK_OP

FOLD_LIMIT = 1 << 16  # elements of a constant result computed at translation time
GATHER_LIMIT = 1 << 20  # positions of an `as_strided` written as a constant (8 MB)
# torch dtypes without a numpy dtype: a constant of one leaves the graph to torch.onnx, which writes it itself
_NO_NUMPY_FORM = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}

aten = torch.ops.aten


class UntranslatableGraph(NotImplementedError):
    """The graph has a node `translate` has no translation for (the message names it)."""


Value = str  # an ONNX value name
Translation = Callable[["_Graph", torch.fx.Node], "Value | tuple[Value, ...] | None"]


def translate(
    graph: torch.fx.GraphModule, input_names: Sequence[str], output_names: Sequence[str], opset: int
) -> onnx.ModelProto:
    """The ONNX model of `graph` (module docstring)."""
    g = _Graph(graph, opset)
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(input_names):
        raise ValueError(f"{len(placeholders)} graph inputs, {len(input_names)} names")
    for node, name in zip(placeholders, input_names, strict=True):
        if g.is_complex(node):
            raise UntranslatableGraph(f"graph input {node.name} is complex (ONNX Runtime's kernels take none)")
        g.inputs.append(_value_info(name, _meta(node)))
        g.values[node] = name
    for node in graph.graph.nodes:
        if node.op in ("call_function", "get_attr"):
            g.visit(node)
    results = list(graph.graph.output_node().args[0])  # type: ignore[arg-type]
    if len(results) != len(output_names):
        raise ValueError(f"{len(results)} graph outputs, {len(output_names)} names")
    for value, name in zip(results, output_names, strict=True):
        if g.is_complex(value):
            raise UntranslatableGraph(f"graph output {value} is complex (ONNX Runtime's kernels take none)")
        g.output(value, name)
    return g.model()


def _meta(node: Any) -> torch.Tensor:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
    if not isinstance(value, torch.Tensor):
        raise UntranslatableGraph(f"node {node} has no tensor value to read its shape and dtype from")
    if any(not isinstance(d, int) for d in value.shape):
        raise UntranslatableGraph(f"node {node} has a symbolic shape {tuple(value.shape)}")
    return value


def _value_info(name: str, value: torch.Tensor) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, torch_to_onnx(value.dtype), list(value.shape))


def _np(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


class _Graph:
    """The ONNX graph under construction and the value of every translated fx node."""

    def __init__(self, module: torch.fx.GraphModule, opset: int) -> None:
        self.module, self.opset = module, opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.values: dict[torch.fx.Node, Value | tuple[Value, ...]] = {}
        self.constants: dict[torch.fx.Node, torch.Tensor] = {}  # nodes whose value is known now
        self._emitted: dict[tuple, Value] = {}  # constant tensors already written, by content
        self._count = 0
        # unrolled recurrences by the output only their backward reads (`_lstm_recurrence`, `_gru_recurrence`)
        self.recurrences: dict[Value, _UnrolledRecurrence | _UnrolledGRU] = {}
        # values whose type the model states (value_info): what reads the graph by name needs it
        self.stated_types: dict[Value, torch.Tensor] = {}

    # -- building blocks --------------------------------------------------------------------------------------
    def fresh(self, base: str) -> Value:
        self._count += 1
        return f"aten/{base}/{self._count}"

    def emit(self, op: str, inputs: Sequence[Value], outputs: int = 1, name: str = "", **attrs: Any) -> list[Value]:
        outs = [self.fresh(name or op) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=outs[0], **attrs))
        return outs

    def one(self, op: str, inputs: Sequence[Value], **attrs: Any) -> Value:
        return self.emit(op, inputs, **attrs)[0]

    def const(self, value: torch.Tensor | np.ndarray) -> Value:
        if isinstance(value, torch.Tensor) and value.dtype in _NO_NUMPY_FORM:
            raise UntranslatableGraph(f"a constant of dtype {value.dtype}, which numpy cannot hold")
        if isinstance(value, torch.Tensor) and value.dtype.is_complex:  # its pair form (gradient/aten_onnx_complex.py)
            value = torch.view_as_real(value.resolve_conj())
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._emitted:
            name = self.fresh("const")
            self.initializers.append(numpy_helper.from_array(np.array(array, order="C"), name))  # keeps 0-d arrays 0-d
            self._emitted[key] = name
        return self._emitted[key]

    def ints(self, values: Sequence[int]) -> Value:
        return self.const(np.asarray(list(values), dtype=np.int64))

    def scalar(self, value: Any, dtype: torch.dtype) -> Value:
        if isinstance(value, int) and not isinstance(value, bool) and not dtype.is_floating_point:
            return self.const(np.asarray(value).astype(_np(dtype)))  # wrapped as aten's (`uint8 * -1` is `* 255`)
        return self.const(np.asarray(value, dtype=_np(dtype)))

    def cast(self, name: Value, source: torch.dtype, target: torch.dtype) -> Value:
        return name if source == target else self.one("Cast", [name], to=torch_to_onnx(target))

    # -- arguments --------------------------------------------------------------------------------------------
    def tensor(self, arg: Any) -> Value:
        """The ONNX value of a tensor argument (a constant is written as an initializer on first use)."""
        if isinstance(arg, torch.fx.Node):
            if arg in self.values:
                value = self.values[arg]
                if isinstance(value, tuple):
                    raise UntranslatableGraph(f"node {arg} has several outputs and is used as one tensor")
                return value
            if arg in self.constants:
                name = self.const(self.constants[arg])
                self.values[arg] = name
                return name
        raise UntranslatableGraph(f"argument {arg!r} is not a translated tensor")

    def typed(self, arg: Any, dtype: torch.dtype) -> Value:
        """A tensor argument cast to `dtype`, or a Python scalar as a constant of `dtype`."""
        if isinstance(arg, torch.fx.Node):
            return self.cast(self.tensor(arg), self.meta(arg).dtype, dtype)
        if isinstance(arg, (bool, int, float)):
            return self.scalar(arg, dtype)
        raise UntranslatableGraph(f"argument {arg!r} is neither a tensor nor a number")

    def meta(self, arg: torch.fx.Node) -> torch.Tensor:
        return self.constants[arg] if arg in self.constants else _meta(arg)

    def is_complex(self, arg: Any) -> bool:
        """Whether `arg` is a node with a complex value (any of its values; a constant's own): such a value is
        translated as a pair of reals (gradient/aten_onnx_complex.py)."""
        if not isinstance(arg, torch.fx.Node):
            return False
        value = self.constants[arg] if arg in self.constants else arg.meta.get("val")
        values = value if isinstance(value, (tuple, list)) else [value]
        return any(isinstance(v, torch.Tensor) and v.dtype.is_complex for v in values)

    def promoted(self, a: Any, b: Any) -> torch.dtype:
        """PyTorch's result dtype of an elementwise op on `a` and `b` (tensors or Python numbers)."""
        left, right = self._probe(a), self._probe(b)
        if not isinstance(left, torch.Tensor) and not isinstance(right, torch.Tensor):
            return torch.result_type(torch.tensor(left), right)
        return torch.result_type(left, right)

    def _probe(self, arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):  # a meta tensor of the same shape: 0-dim tensors promote like scalars
            value = self.meta(arg)
            return torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
        if isinstance(arg, (bool, int, float)):
            return arg
        raise UntranslatableGraph(f"argument {arg!r} is neither a tensor nor a number")

    # -- nodes ------------------------------------------------------------------------------------------------
    def visit(self, node: torch.fx.Node) -> None:
        if node.op == "get_attr":
            value = getattr(self.module, str(node.target), None)
            if not isinstance(value, torch.Tensor):
                raise UntranslatableGraph(f"get_attr node {node.name} is not a tensor")
            self.constants[node] = value.detach()
            return
        if node.target is operator.getitem:
            source, index = node.args
            if source in self.constants or source not in self.values:
                raise UntranslatableGraph(f"getitem of {source}")
            values = self.values[source]  # type: ignore[index]
            if not isinstance(values, tuple):
                raise UntranslatableGraph(f"getitem of the single-output node {source}")
            self.values[node] = values[index]  # type: ignore[index]
            return
        complex_values = self.is_complex(node) or any(self.is_complex(a) for a in node.all_input_nodes)
        table = _complex_translations() if complex_values else _TRANSLATIONS
        if self._fold(node, table):
            return
        translation = table.get(node.target)
        if translation is None and not complex_values:
            translation = _CUSTOM_TRANSLATIONS.get(_custom_op_name(node.target))
        if translation is None:
            on = " on complex values" if complex_values else ""
            raise UntranslatableGraph(f"no direct ONNX translation for {node.target}{on} (node {node.name})")
        result = translation(self, node)
        if result is None:
            raise UntranslatableGraph(f"{node.target} (node {node.name}) with arguments {node.args} {node.kwargs}")
        self.values[node] = result

    def _fold(self, node: torch.fx.Node, table: dict[Any, Translation]) -> bool:
        """Compute a node whose tensor arguments are all known constants (module docstring)."""
        if node.target not in table or node.target in _RANDOM or node.target in _UNSPECIFIED:
            return False
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.numel() > FOLD_LIMIT:
            return False
        inputs = [a for a in node.all_input_nodes]
        if not all(a in self.constants for a in inputs):
            return False
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: self.constants[a])
        result = node.target(*args, **kwargs)  # type: ignore[operator]
        if not isinstance(result, torch.Tensor):
            return False
        self.constants[node] = result.detach()
        return True

    def output(self, arg: Any, name: str) -> None:
        value = self.tensor(arg)
        produced = {o for n in self.nodes for o in n.output}
        taken = {o.name for o in self.outputs}
        if value in produced and value not in taken and value.startswith("aten/"):
            for n in self.nodes:
                for i, o in enumerate(n.output):
                    if o == value:
                        n.output[i] = name
                for i, o in enumerate(n.input):
                    if o == value:
                        n.input[i] = name
            for other in self.outputs:  # an earlier output that read it has its name already
                if other.name == value:
                    other.name = name
            self.values = {k: (name if v == value else v) for k, v in self.values.items()}
        else:
            self.nodes.append(helper.make_node("Identity", [value], [name], name=f"aten/output/{name}"))
        self.outputs.append(_value_info(name, self.meta(arg)))

    def model(self) -> onnx.ModelProto:
        produced = {o for n in self.nodes for o in n.output} - {o.name for o in self.outputs}
        value_info = [_value_info(name, meta) for name, meta in self.stated_types.items() if name in produced]
        graph = helper.make_graph(
            self.nodes, "main_graph", self.inputs, self.outputs, self.initializers, value_info=value_info
        )
        opsets = [helper.make_opsetid("", self.opset)]
        opsets += [helper.make_opsetid(d, 1) for d in sorted({n.domain for n in self.nodes if n.domain})]
        return helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets[:1]))


# -- translations -------------------------------------------------------------------------------------------------
def _rank(g: _Graph, arg: torch.fx.Node) -> int:
    return g.meta(arg).dim()


def _axis(dim: int, rank: int) -> int:
    return dim % max(rank, 1) if dim < 0 else dim


def _reshape(g: _Graph, node: torch.fx.Node) -> Value:
    shape = list(_meta(node).shape)
    if _same_shape_view(node):
        return g.tensor(node.args[0])
    attrs = {"allowzero": 1} if 0 in shape else {}
    return g.one("Reshape", [g.tensor(node.args[0]), g.ints(shape)], **attrs)


def _as_strided(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.as_strided(x, size, stride, offset)` of an x that fills its storage with no offset of its own: element
    i of the result is the storage's element offset + sum(i_k * stride_k). The storage is x itself when x is
    contiguous, else x transposed to the order of its strides (Longformer chunks a transposed tensor so,
    `_storage_order`). A Reshape where the positions are the storage's own order (adaptive pooling's decomposition
    writes its mean so, Swin's pooler), else a Gather of the storage's elements at those positions, which static
    shapes make a constant (overlapping windows included) of at most `GATHER_LIMIT` elements. Other inputs:
    untranslated."""
    x, size, stride = node.args[:3]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0)
    source = g.meta(x)  # type: ignore[arg-type]
    order = _storage_order(source)
    if order is None or source.storage_offset() != 0 or not isinstance(offset, int):
        return None  # type: ignore[return-value]
    storage = g.tensor(x) if order == sorted(order) else g.one("Transpose", [g.tensor(x)], perm=order)
    shape: list[int] = list(size)  # type: ignore[arg-type]
    steps: list[int] = list(stride)  # type: ignore[arg-type]
    count = math.prod(shape)
    own_order = all(step == math.prod(shape[d + 1 :]) for d, step in enumerate(steps) if shape[d] != 1)
    if offset == 0 and count == source.numel() and own_order:
        return g.one("Reshape", [storage, g.ints(shape)], allowzero=1)
    if count > GATHER_LIMIT:
        return None  # type: ignore[return-value]
    positions = np.full(shape, offset, dtype=np.int64)
    for dim, (length, step) in enumerate(zip(shape, steps, strict=True)):
        positions += (np.arange(length, dtype=np.int64) * step).reshape(
            [-1 if d == dim else 1 for d in range(len(shape))]
        )
    if count and (positions.min() < 0 or positions.max() >= source.numel()):
        return None  # type: ignore[return-value]
    flattened = g.one("Reshape", [storage, g.ints([-1])])
    return g.one("Gather", [flattened, g.const(positions)], axis=0)


def _storage_order(value: torch.Tensor) -> list[int] | None:
    """The permutation of `value`'s dims that makes it its storage's contiguous order (the dims by decreasing
    stride), or None when `value` does not fill its storage exactly (gaps or overlaps). A contiguous value's own
    dims, in order."""
    strides = value.stride()
    dims = sorted(range(value.dim()), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(dims):
        if value.shape[d] != 1 and strides[d] != expected:
            return None
        expected *= value.shape[d]
    return dims


def _diagonal(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.diagonal(x, offset=0, dim1=0, dim2=1)` (`torch.diagonal`; `trace` and `diag` decompose to it): the
    other dims, then the diagonal's elements x[..., i + max(-offset, 0), ..., i + max(offset, 0), ...] as the last
    dim. dim1 and dim2 move last (a Transpose), flatten to one dim of n1 * n2 (a Reshape), and a Gather at the
    constant positions of the diagonal's elements reads them. An empty diagonal is left to torch.onnx."""
    x = node.args[0]
    given: list[Any] = [*node.args[1:], *[0, 0, 1][len(node.args) - 1 :]]
    offset, dim1, dim2 = (int(a) for a in given[:3])
    source = g.meta(x)  # type: ignore[arg-type]
    rank = source.dim()
    first, second = _axis(dim1, rank), _axis(dim2, rank)
    rows, columns = int(source.shape[first]), int(source.shape[second])
    start_row, start_column = max(-offset, 0), max(offset, 0)
    length = max(0, min(rows - start_row, columns - start_column))
    if first == second or length == 0:
        return None  # type: ignore[return-value]
    others = [d for d in range(rank) if d not in (first, second)]
    moved = g.one("Transpose", [g.tensor(x)], perm=[*others, first, second])
    flat = g.one("Reshape", [moved, g.ints([*(source.shape[d] for d in others), rows * columns])])
    positions = (np.arange(length, dtype=np.int64) + start_row) * columns + np.arange(length) + start_column
    return g.one("Gather", [flat, g.const(positions)], axis=len(others))


def _window_positions(length: int, size: int, step: int) -> np.ndarray:
    """[windows, size]: the positions along a dim of `length` that `Tensor.unfold(dim, size, step)`'s windows read."""
    windows = (length - size) // step + 1
    return np.arange(windows, dtype=np.int64)[:, None] * step + np.arange(size, dtype=np.int64)[None, :]


def _unfold(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.unfold(x, dim, size, step)` (`Tensor.unfold`: PatchTST's patches): dim becomes the windows and a last
    dim of `size` is added. A Gather along dim at the windows' constant positions gives [..., windows, size, ...];
    a Transpose moves `size` last."""
    given: list[Any] = list(node.args[:4])
    x, dim, size, step = given
    source = g.meta(x)
    if source.dim() == 0:
        return None  # type: ignore[return-value]
    axis = _axis(dim, source.dim())
    positions = _window_positions(int(source.shape[axis]), size, step)
    gathered = g.one("Gather", [g.tensor(x), g.const(positions)], axis=axis)
    if axis == source.dim() - 1:
        return gathered
    rank = source.dim() + 1
    return g.one("Transpose", [gathered], perm=[d for d in range(rank) if d != axis + 1] + [axis + 1])


def _unfold_backward(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.unfold_backward(grad, input_sizes, dim, size, step)`: zeros of the input's size, and each window's
    gradient added at the positions it read (ScatterElements with reduction add: windows overlap when step <
    size). The gradient's last dim moves back next to the windows and both flatten into one dim, whose positions
    are `_window_positions` flattened, the same along every other dim (an Expand)."""
    given: list[Any] = list(node.args[:5])
    grad, _, dim, size, step = given
    out = _meta(node)
    if out.dim() == 0:
        return None  # type: ignore[return-value]
    axis = _axis(dim, out.dim())
    positions = _window_positions(int(out.shape[axis]), size, step).reshape(-1)
    rank = out.dim() + 1
    moved = g.tensor(grad)
    if axis != out.dim() - 1:
        moved = g.one("Transpose", [moved], perm=[*range(axis + 1), rank - 1, *range(axis + 1, rank - 1)])
    flat_shape = [*out.shape[:axis], len(positions), *out.shape[axis + 1 :]]
    updates = g.one("Reshape", [moved, g.ints(flat_shape)])
    along = positions.reshape([-1 if d == axis else 1 for d in range(out.dim())])
    index = g.one("Expand", [g.const(along), g.ints(flat_shape)])
    zeros = g.one(
        "ConstantOfShape", [g.ints(list(out.shape))], value=numpy_helper.from_array(np.zeros([1], _np(out.dtype)))
    )
    return g.one("ScatterElements", [zeros, index, updates], axis=axis, reduction="add")


def _same(g: _Graph, node: torch.fx.Node) -> Value:
    return g.tensor(node.args[0])


def _to_copy(g: _Graph, node: torch.fx.Node) -> Value:
    source = node.args[0]
    return g.cast(g.tensor(source), g.meta(source).dtype, _meta(node).dtype)  # type: ignore[arg-type]


def _permute(g: _Graph, node: torch.fx.Node) -> Value:
    x, dims = node.args[0], node.args[1]
    rank = _rank(g, x)  # type: ignore[arg-type]
    perm = [_axis(d, rank) for d in dims]  # type: ignore[union-attr, arg-type]
    if perm == list(range(rank)):
        return g.tensor(x)
    return g.one("Transpose", [g.tensor(x)], perm=perm)


def _transpose(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    rank = _rank(g, x)  # type: ignore[arg-type]
    if node.target == aten.t.default:
        a, b = (0, 1) if rank == 2 else (0, 0)
    else:
        a, b = _axis(node.args[1], rank), _axis(node.args[2], rank)  # type: ignore[arg-type]
    perm = list(range(rank))
    perm[a], perm[b] = perm[b], perm[a]
    return g.tensor(x) if a == b else g.one("Transpose", [g.tensor(x)], perm=perm)


def _expand(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    shape = list(_meta(node).shape)
    if list(g.meta(x).shape) == shape:  # type: ignore[arg-type]
        return g.tensor(x)
    return g.one("Expand", [g.tensor(x), g.ints(shape)])


def _repeat(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.repeat(x, repeats)`: ONNX Tile, after a Reshape that prepends the 1s aten prepends when `repeats` is
    longer than x's rank; x itself where every repeat is 1."""
    x, repeats = node.args[:2]
    source = list(g.meta(x).shape)  # type: ignore[arg-type]
    times: list[int] = list(repeats)  # type: ignore[arg-type]
    value = g.tensor(x)
    if len(times) == len(source) and all(t == 1 for t in times):
        return value  # a 0-d x repeated (): onnxruntime 1.19's Tile takes no 0-d tensor
    if len(times) > len(source):
        value = g.one("Reshape", [value, g.ints([1] * (len(times) - len(source)) + source)], allowzero=1)
    return g.one("Tile", [value, g.ints(times)])


def _select(g: _Graph, node: torch.fx.Node) -> Value:
    x, dim, index = node.args
    rank = _rank(g, x)  # type: ignore[arg-type]
    axis = _axis(dim, rank)  # type: ignore[arg-type]
    size = g.meta(x).shape[axis]  # type: ignore[arg-type]
    return g.one("Gather", [g.tensor(x), g.const(np.asarray(index % size, dtype=np.int64))], axis=axis)  # type: ignore[operator]


def _slice(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    if node.kwargs:
        return None  # type: ignore[return-value]
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1 :])[:4]
    rank = _rank(g, x)  # type: ignore[arg-type]
    axis = _axis(dim, rank)  # type: ignore[arg-type]
    size = g.meta(x).shape[axis]  # type: ignore[arg-type]
    s, e, st = slice(start, end, step).indices(size)
    if (s, e, st) == (0, size, 1):
        return g.tensor(x)
    e = max(e, s)  # an empty slice
    return g.one("Slice", [g.tensor(x), g.ints([s]), g.ints([e]), g.ints([axis]), g.ints([st])])


def _slice_scatter(g: _Graph, node: torch.fx.Node) -> Value:
    """`base` with `src` written into `base[start:end:step]` along `dim`: with step 1, base's parts before and
    after the slice concatenated around `src`; with a larger step (the backward of `x[..., ::2]`, GPT-J's rotary
    embedding), ScatterElements of `src` along `dim` at start, start + step, ..."""
    base, src = node.args[:2]
    dim, start, end, step = (list(node.args[2:]) + [0, None, None, 1][len(node.args) - 2 :])[:4]
    if node.kwargs:
        return None  # type: ignore[return-value]
    out = _meta(node)
    axis = _axis(dim, out.dim())  # type: ignore[arg-type]
    size = out.shape[axis]
    s, e, st = slice(start, end, step).indices(size)
    if st != 1:
        shape = list(g.meta(src).shape)  # type: ignore[arg-type]
        positions = np.arange(s, e, st, dtype=np.int64).reshape([-1 if d == axis else 1 for d in range(out.dim())])
        index = g.one("Expand", [g.const(positions), g.ints(shape)])
        return g.one("ScatterElements", [g.typed(base, out.dtype), index, g.typed(src, out.dtype)], axis=axis)
    parts = []
    if s > 0:
        parts.append(g.one("Slice", [g.typed(base, out.dtype), g.ints([0]), g.ints([s]), g.ints([axis])]))
    parts.append(g.typed(src, out.dtype))
    if e < size:
        parts.append(g.one("Slice", [g.typed(base, out.dtype), g.ints([e]), g.ints([size]), g.ints([axis])]))
    return parts[0] if len(parts) == 1 else g.one("Concat", parts, axis=axis)


def _cat(g: _Graph, node: torch.fx.Node) -> Value:
    tensors = list(node.args[0])  # type: ignore[arg-type]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    out = _meta(node)
    kept = [t for t in tensors if not (g.meta(t).dim() == 1 and g.meta(t).shape[0] == 0 and out.dim() != 1)]
    names = [g.typed(t, out.dtype) for t in kept]
    if len(names) == 1:
        return names[0]
    return g.one("Concat", names, axis=_axis(dim, out.dim()))  # type: ignore[arg-type]


def _split(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    x = node.args[0]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    rank = _rank(g, x)  # type: ignore[arg-type]
    axis = _axis(dim, rank)  # type: ignore[arg-type]
    parts = node.meta["val"]
    sizes = [int(p.shape[axis]) for p in parts]
    if len(sizes) == 1:
        return (g.tensor(x),)
    return tuple(g.emit("Split", [g.tensor(x), g.ints(sizes)], outputs=len(sizes), axis=axis))


def _elementwise(op: str, compute: str = "promoted") -> Translation:
    """`op` on the promoted dtype of the arguments ("promoted"), or on floats ("float": int inputs become the result's
    float dtype, as `div` and the float functions do), with the result cast to the node's dtype."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        args = [a for a in node.args if isinstance(a, (torch.fx.Node, bool, int, float))]
        if len(args) != len(node.args) or node.kwargs:
            return None  # type: ignore[return-value]
        out = _meta(node).dtype
        dtype = out if compute == "float" else g.promoted(*args)
        if compute == "float" and not dtype.is_floating_point:
            return None  # type: ignore[return-value]
        if dtype == torch.bool and op in _ON_BOOLS:
            return g.cast(g.one(_ON_BOOLS[op], [g.typed(a, dtype) for a in args]), dtype, out)
        if dtype == torch.bool and op != "Equal":
            dtype = torch.int32  # ONNX Runtime's order comparisons take no bools; False < True as 0 < 1
        if dtype in (torch.int8, torch.int16) and op in ("Max", "Min"):
            dtype = torch.int32  # `_NARROW_INTEGERS`
        result = g.one(op, [g.typed(a, dtype) for a in args])
        return g.cast(result, dtype if op not in _BOOL_RESULT else torch.bool, out)

    return translate_node


_BOOL_RESULT = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor"}
# PyTorch's arithmetic on two bools is logic, and ONNX's arithmetic ops take no bools
_ON_BOOLS = {"Mul": "And", "Max": "Or", "Min": "And", "Add": "Or"}


def _with_alpha(op: str) -> Translation:
    """add/sub: `a op alpha * b`."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        a, b = node.args[:2]
        alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
        out = _meta(node).dtype
        dtype = g.promoted(a, b)
        if dtype == torch.bool:  # PyTorch refuses sub of bools; add's alpha is True (1) or False
            if op not in _ON_BOOLS or alpha != 1:
                return None  # type: ignore[return-value]
            return g.cast(g.one(_ON_BOOLS[op], [g.typed(a, dtype), g.typed(b, dtype)]), dtype, out)
        right = g.typed(b, dtype)
        if alpha != 1:
            right = g.one("Mul", [right, g.scalar(alpha, dtype)])
        return g.cast(g.one(op, [g.typed(a, dtype), right]), dtype, out)

    return translate_node


def _rsub(g: _Graph, node: torch.fx.Node) -> Value:
    a, b = node.args[:2]
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    dtype = g.promoted(a, b)
    left = g.typed(a, dtype)
    if alpha != 1:
        left = g.one("Mul", [left, g.scalar(alpha, dtype)])
    return g.cast(g.one("Sub", [g.typed(b, dtype), left]), dtype, _meta(node).dtype)


def _not_equal(g: _Graph, node: torch.fx.Node) -> Value:
    a, b = node.args
    dtype = g.promoted(a, b)
    return g.one("Not", [g.one("Equal", [g.typed(a, dtype), g.typed(b, dtype)])])


def _unary(op: str, floating: bool = True) -> Translation:
    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        if len(node.args) != 1 or node.kwargs:
            return None  # type: ignore[return-value]
        x, out = node.args[0], _meta(node).dtype
        if floating and not out.is_floating_point:
            return None  # type: ignore[return-value]
        if out in _NARROW_INTEGERS:
            return g.cast(g.one(op, [g.typed(x, torch.int32)]), torch.int32, out)
        return g.one(op, [g.typed(x, out)])

    return translate_node


# ONNX Runtime has no Neg, Relu, Sign, Max or Min kernel for these: computed in int32, cast back (uint8's negation
# then wraps as aten's does; the result of a bool is a bool again)
_NARROW_INTEGERS = (torch.bool, torch.uint8, torch.int8, torch.int16)


def _log1p(g: _Graph, node: torch.fx.Node) -> Value:
    """`log(1 + x)`, as torch.onnx writes it (ONNX has no log1p; the sum rounds 1 + x for |x| below float32's
    epsilon, where PyTorch's kernel keeps x)."""
    out = _meta(node).dtype
    if len(node.args) != 1 or node.kwargs or not out.is_floating_point:
        return None  # type: ignore[return-value]
    return g.one("Log", [g.one("Add", [g.typed(node.args[0], out), g.scalar(1.0, out)])])


def _expm1(g: _Graph, node: torch.fx.Node) -> Value:
    """`exp(x) - 1`, as torch.onnx writes it (ONNX has no expm1; for |x| near float32's epsilon the difference
    keeps fewer digits than PyTorch's kernel)."""
    out = _meta(node).dtype
    if len(node.args) != 1 or node.kwargs or not out.is_floating_point:
        return None  # type: ignore[return-value]
    return g.one("Sub", [g.one("Exp", [g.typed(node.args[0], out)]), g.scalar(1.0, out)])


def _rounding(op: str) -> Translation:
    """floor, ceil, round (half to even, as ONNX Round) and trunc (the magnitude's Floor with the sign; ONNX has no
    Trunc) of floats; of integers they are the value itself. `round.decimals` scales by 10^decimals around it."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        x, out = node.args[0], _meta(node).dtype
        decimals = node.kwargs.get("decimals", node.args[1] if len(node.args) > 1 else 0)
        if not out.is_floating_point:
            return g.typed(x, out) if not decimals else None  # type: ignore[return-value]
        value = g.typed(x, out)
        if decimals:
            value = g.one("Mul", [value, g.scalar(10.0**decimals, out)])  # type: ignore[operator]
        if op == "Trunc":
            rounded = g.one("Mul", [g.one("Sign", [value]), g.one("Floor", [g.one("Abs", [value])])])
        else:
            rounded = g.one(op, [value])
        return g.one("Div", [rounded, g.scalar(10.0**decimals, out)]) if decimals else rounded  # type: ignore[operator]

    return translate_node


def _remainder(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.remainder` (the divisor's sign, as Python's %) and `aten.fmod` (the dividend's, as C's fmod): ONNX Mod
    with fmod 0 or 1 on integers; floats take fmod 1 only (ONNX), so remainder is a - Floor(a / b) * b there."""
    a, b = node.args[:2]
    out = _meta(node).dtype
    if out == torch.bool:
        return None  # type: ignore[return-value]
    left, right = g.typed(a, out), g.typed(b, out)
    python = node.target in (aten.remainder.Tensor, aten.remainder.Scalar)
    if python and out.is_floating_point:
        quotient = g.one("Floor", [g.one("Div", [left, right])])
        return g.one("Sub", [left, g.one("Mul", [quotient, right])])
    return g.one("Mod", [left, right], fmod=0 if python else 1)


def _flip(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.flip(x, dims)`: a Slice with step -1 along each dim."""
    x, dims = node.args[:2]
    rank = _rank(g, x)  # type: ignore[arg-type]
    axes = [_axis(d, rank) for d in dims]  # type: ignore[union-attr, arg-type]
    if not axes:
        return g.tensor(x)
    ends = [-(2**63)] * len(axes)  # past the start, backwards
    return g.one("Slice", [g.tensor(x), g.ints([-1] * len(axes)), g.ints(ends), g.ints(axes), g.ints([-1] * len(axes))])


def _cumsum(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.cumsum(x, dim, dtype=None)`: ONNX CumSum in the result's dtype."""
    x, dim = node.args[:2]
    out = _meta(node).dtype
    if out in (torch.bool, torch.float16, torch.bfloat16):  # PyTorch sums halves in float32, ONNX Runtime in float16
        return None  # type: ignore[return-value]
    if _rank(g, x) == 0:  # type: ignore[arg-type] # ONNX Runtime's CumSum takes no 0-d tensor: it is its own sum
        return g.typed(x, out)
    axis = g.const(np.asarray(_axis(dim, _rank(g, x)), dtype=np.int64))  # type: ignore[arg-type]
    if out in (torch.uint8, torch.int8, torch.int16):  # no CumSum kernel: summed in int64, wrapped back as aten's
        return g.cast(g.one("CumSum", [g.typed(x, torch.int64), axis]), torch.int64, out)
    return g.one("CumSum", [g.typed(x, out), axis])


def _isnan(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    if not g.meta(x).dtype.is_floating_point:  # type: ignore[arg-type]
        return g.one("Not", [g.one("Equal", [g.tensor(x), g.tensor(x)])])  # an integer is never NaN: all false
    return g.one("IsNaN", [g.tensor(x)])


def _isinf(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    if not g.meta(x).dtype.is_floating_point:  # type: ignore[arg-type]
        return g.one("Not", [g.one("Equal", [g.tensor(x), g.tensor(x)])])  # an integer is never infinite
    return g.one("IsInf", [g.tensor(x)])


def _log_base(base: float) -> Translation:
    """`aten.log2` / `aten.log10`: the natural log divided by ln(base) (ONNX has only the natural log)."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        out = _meta(node).dtype
        if not out.is_floating_point:
            return None  # type: ignore[return-value]
        return g.one("Div", [g.one("Log", [g.typed(node.args[0], out)]), g.scalar(math.log(base), out)])

    return translate_node


def _elu(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.elu(x, alpha, scale, input_scale)` with `input_scale` 1: ONNX Elu when `scale` is 1 too (nn.ELU,
    F.elu), else ONNX Selu, which is `scale` times it (nn.SELU: Selu's gamma is the scale)."""
    x, *rest = node.args
    alpha, scale, input_scale = [*rest, 1.0, 1.0, 1.0][:3]
    out = _meta(node).dtype
    if node.kwargs or not all(isinstance(v, (int, float)) for v in (alpha, scale)) or input_scale != 1:
        return None  # type: ignore[return-value]
    if not out.is_floating_point:
        return None  # type: ignore[return-value]
    if scale == 1:
        return g.one("Elu", [g.typed(x, out)], alpha=float(alpha))  # type: ignore[arg-type]
    return g.one("Selu", [g.typed(x, out)], alpha=float(alpha), gamma=float(scale))  # type: ignore[arg-type]


def _leaky_relu(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    slope = node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope", 0.01)
    out = _meta(node).dtype
    if not isinstance(slope, (int, float)) or not out.is_floating_point:
        return None  # type: ignore[return-value]
    return g.one("LeakyRelu", [g.typed(x, out)], alpha=float(slope))


def _vector_norm(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.linalg_vector_norm(x, ord, dim, keepdim)`: ord 1 and 2 ReduceL1 and ReduceL2; inf and -inf the largest
    and smallest |x| (ReduceMax, ReduceMin of Abs); 0 the count of nonzero elements; any other p
    (sum |x|^p)^(1/p), as PyTorch computes it."""
    x = node.args[0]
    ord_ = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
    dims: Any = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    keepdim = bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False))
    out = _meta(node).dtype
    if not isinstance(ord_, (int, float)) or node.kwargs.get("dtype") is not None or not out.is_floating_point:
        return None  # type: ignore[return-value]
    rank = _rank(g, x)  # type: ignore[arg-type]
    axes = [_axis(d, rank) for d in ([dims] if isinstance(dims, int) else (dims or []))]
    value = g.typed(x, out)
    if ord_ in (1, 2):
        return _reduce_node(g, "ReduceL1" if ord_ == 1 else "ReduceL2", value, axes, keepdim)
    if math.isinf(ord_):
        return _reduce_node(g, "ReduceMax" if ord_ > 0 else "ReduceMin", g.one("Abs", [value]), axes, keepdim)
    if ord_ == 0:
        nonzero = g.cast(g.one("Not", [g.one("Equal", [value, g.scalar(0, out)])]), torch.bool, out)
        return _reduce_node(g, "ReduceSum", nonzero, axes, keepdim)
    powered = g.one("Pow", [g.one("Abs", [value]), g.scalar(float(ord_), out)])
    return g.one("Pow", [_reduce_node(g, "ReduceSum", powered, axes, keepdim), g.scalar(1.0 / ord_, out)])


def _rsqrt(g: _Graph, node: torch.fx.Node) -> Value:
    out = _meta(node).dtype
    if not out.is_floating_point:
        return None  # type: ignore[return-value]
    return g.one("Reciprocal", [g.one("Sqrt", [g.typed(node.args[0], out)])])


def _logical(op: str) -> Translation:
    """`aten.logical_*` as ONNX's `op` on bool tensors; a tensor of another real type counts as true where it is
    nonzero (NaN included), which a Cast to bool gives (LongT5's block masks are integer tensors)."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        if any(not isinstance(a, torch.fx.Node) or g.meta(a).dtype.is_complex for a in node.args):
            return None  # type: ignore[return-value]
        return g.one(op, [g.typed(a, torch.bool) for a in node.args])

    return translate_node


def _bitwise(logical: str, bitwise: str) -> Translation:
    """`aten.bitwise_*`: on bools ONNX's `logical` op; on integers ONNX's `bitwise` op (opset 18) on the result's
    dtype (the promoted one): the bits, not the truth values (`5 & 3` is 1; CpmAnt builds its masks as int32
    `|` and `&`); a number argument (`.Scalar`: `x & 6`) in that dtype too."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        if any(not isinstance(a, (torch.fx.Node, bool, int)) for a in node.args) or node.kwargs:
            return None  # type: ignore[return-value]
        out = _meta(node).dtype
        if out == torch.bool:
            return g.one(logical, [g.typed(a, torch.bool) for a in node.args])
        if out.is_floating_point or out.is_complex:
            return None  # type: ignore[return-value]
        return g.one(bitwise, [g.typed(a, out) for a in node.args])

    return translate_node


def _where(g: _Graph, node: torch.fx.Node) -> Value:
    cond, a, b = node.args
    if not isinstance(cond, torch.fx.Node) or g.meta(cond).dtype != torch.bool:
        return None  # type: ignore[return-value]
    out = _meta(node).dtype
    return _chosen(g, g.tensor(cond), g.typed(a, out), g.typed(b, out), out)


def _masked_fill(g: _Graph, node: torch.fx.Node) -> Value:
    x, mask, value = node.args
    out = _meta(node).dtype
    return _chosen(g, g.tensor(mask), g.typed(value, out), g.typed(x, out), out)


def _chosen(g: _Graph, cond: Value, a: Value, b: Value, dtype: torch.dtype) -> Value:
    """ONNX Where(cond, a, b) of values of `dtype`; for bools `(cond and a) or (not cond and b)`: ONNX Runtime has
    no Where kernel for bool values (`torch.where` of two masks), nor for int8 and int16 (chosen in int32)."""
    if dtype in (torch.int8, torch.int16):  # no Where kernel either: chosen in int32
        return g.cast(
            g.one("Where", [cond, g.cast(a, dtype, torch.int32), g.cast(b, dtype, torch.int32)]), torch.int32, dtype
        )
    if dtype != torch.bool:
        return g.one("Where", [cond, a, b])
    return g.one("Or", [g.one("And", [cond, a]), g.one("And", [g.one("Not", [cond]), b])])


def _clamp(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    if node.target == aten.clamp_min.default:
        low, high = node.args[1], None
    elif node.target == aten.clamp_max.default:
        low, high = None, node.args[1]
    else:
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    out = _meta(node).dtype
    compute = torch.int32 if out in _NARROW_INTEGERS else out
    result = g.typed(x, compute)
    if low is not None:
        result = g.one("Max", [result, g.typed(low, compute)])
    if high is not None:
        result = g.one("Min", [result, g.typed(high, compute)])
    return g.cast(result, compute, out)


def _hardtanh(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.hardtanh(x, min_val=-1, max_val=1)` (nn.Hardtanh, nn.ReLU6): a clamp, as `_clamp` writes one."""
    x = node.args[0]
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", 1.0)
    out = _meta(node).dtype
    if not all(isinstance(v, (int, float)) for v in (low, high)):
        return None  # type: ignore[return-value]
    return g.one("Min", [g.one("Max", [g.typed(x, out), g.typed(low, out)]), g.typed(high, out)])


def _div_mode(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.div.Tensor_mode(a, b, rounding_mode)`. Integers: "trunc" is ONNX's integer Div (it truncates);
    "floor" is (a - Mod(a, b)) / b, exact, as Mod (fmod=0) takes the divisor's sign. Floats: Div, then Floor, or
    for "trunc" the magnitude's Floor with the quotient's sign (ONNX has no Trunc). PyTorch's float floor division
    corrects the rounding of a / b (1 // 0.1 is 9); Floor(Div) is 10 there, as torch.onnx writes it too."""
    a, b = node.args[:2]
    mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
    out = _meta(node).dtype
    if mode is None:
        return g.one("Div", [g.typed(a, out), g.typed(b, out)]) if out.is_floating_point else None  # type: ignore[return-value]
    if mode not in ("trunc", "floor") or out == torch.bool:
        return None  # type: ignore[return-value]
    left, right = g.typed(a, out), g.typed(b, out)
    if not out.is_floating_point:
        if mode == "trunc":
            return g.one("Div", [left, right])
        return g.one("Div", [g.one("Sub", [left, g.one("Mod", [left, right])]), right])
    quotient = g.one("Div", [left, right])
    if mode == "floor":
        return g.one("Floor", [quotient])
    return g.one("Mul", [g.one("Sign", [quotient]), g.one("Floor", [g.one("Abs", [quotient])])])


def _pow(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.pow` of floats (a tensor exponent, and a number's power `pow.Scalar` as in sinusoidal position
    embeddings, included): a product for the square, else ONNX Pow in the result's dtype."""
    x, exponent = node.args
    out = _meta(node).dtype
    if not out.is_floating_point:
        return None  # type: ignore[return-value]
    if exponent == 2:
        base = g.typed(x, out)
        return g.one("Mul", [base, base])
    return g.one("Pow", [g.typed(x, out), g.typed(exponent, out)])


def _gelu(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    out = _meta(node).dtype
    if approximate not in ("none", "tanh") or not out.is_floating_point:
        return None  # type: ignore[return-value]
    value = g.tensor(x)
    if approximate == "tanh":  # x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), PyTorch's formula
        cube = g.one("Mul", [g.one("Mul", [value, value]), value])
        inner = g.one("Add", [value, g.one("Mul", [cube, g.scalar(0.044715, out)])])
        tanh = g.one("Tanh", [g.one("Mul", [inner, g.scalar(math.sqrt(2.0 / math.pi), out)])])
        return g.one("Mul", [g.one("Mul", [value, g.scalar(0.5, out)]), g.one("Add", [tanh, g.scalar(1.0, out)])])
    # x * 0.5 * (1 + erf(x / sqrt(2))): the form ONNX Runtime's GeluFusion recognises
    erf = g.one("Erf", [g.one("Div", [value, g.scalar(math.sqrt(2.0), out)])])
    return g.one("Mul", [g.one("Mul", [value, g.one("Add", [erf, g.scalar(1.0, out)])]), g.scalar(0.5, out)])


def _reduce(op: str) -> Translation:
    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        x = node.args[0]
        out = _meta(node)
        if node.target in (aten.sum.default, aten.mean.default, aten.any.default, aten.max.default, aten.min.default):
            dims: Any = []
            keepdim = False
        else:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        if isinstance(dims, int):
            dims = [dims]
        rank = _rank(g, x)  # type: ignore[arg-type]
        axes = [_axis(d, rank) for d in (dims or [])]
        if op == "any":
            flag = g.cast(g.tensor(x), g.meta(x).dtype, torch.bool)  # type: ignore[arg-type]
            if rank == 0:  # aten reduces a 0-d tensor over dim 0 or -1 to itself; ONNX takes no axis of rank 0
                return g.cast(flag, torch.bool, out.dtype)
            source = g.one("Cast", [flag], to=TensorProto.INT32)
            reduced = _reduce_node(g, "ReduceMax", source, axes, keepdim)
            return g.one("Cast", [reduced], to=torch_to_onnx(out.dtype))  # bool; uint8 for uint8 (aten's rule)
        if out.dtype == torch.bool and op in ("ReduceMax", "ReduceMin"):
            return None  # type: ignore[return-value]
        source = g.typed(x, out.dtype)
        return source if rank == 0 else _reduce_node(g, op, source, axes, keepdim)

    return translate_node


def _reduce_node(g: _Graph, op: str, source: Value, axes: list[int], keepdim: bool) -> Value:
    inputs = [source, g.ints(axes)] if axes else [source]
    return g.one(op, inputs, keepdims=int(keepdim))


def _extreme(op: str) -> Translation:
    """`aten.max.dim` / `aten.min.dim(x, dim, keepdim)`: ReduceMax/ReduceMin and, where read, the first extreme along
    the dim as PyTorch's CPU kernels name it (`_first_extreme`: int64 through its Equal mask)."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
        x, dim = node.args[:2]
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        if g.meta(x).dtype == torch.bool:  # type: ignore[arg-type]
            return None  # type: ignore[return-value]
        if _rank(g, x) == 0:  # type: ignore[arg-type] # a 0-d tensor is its own extreme, at index 0
            return g.tensor(x), g.scalar(0, torch.int64)
        axis = _axis(dim, _rank(g, x))  # type: ignore[arg-type]
        values = _reduce_node(g, f"Reduce{op}", g.tensor(x), [axis], keepdim)
        if not _readers(node, 1):
            return values, g.fresh("unread_indices")
        indices = _first_extreme(g, op, g.tensor(x), g.meta(x).dtype, axis, keepdim)  # type: ignore[arg-type]
        return None if indices is None else (values, indices)  # type: ignore[return-value]

    return translate_node


def _topk(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    """`aten.topk(x, k, dim=-1, largest=True, sorted=True)` (a mixture of experts' router): ONNX TopK, values and
    int64 indices. Of equal elements ONNX names the lower index first; PyTorch's order among them is unspecified,
    which matters only where a tie straddles the k-th place."""
    x, k = node.args[:2]
    dim, largest, ordered = (list(node.args[2:]) + [-1, True, True][len(node.args) - 2 :])[:3]
    source = g.meta(x)  # type: ignore[arg-type]
    if node.kwargs or not isinstance(k, int) or source.dtype == torch.bool or source.dim() == 0:
        return None  # type: ignore[return-value]
    axis = _axis(dim, source.dim())  # type: ignore[arg-type]
    flags: dict[str, Any] = {"largest": int(bool(largest)), "sorted": int(bool(ordered))}
    return tuple(g.emit("TopK", [g.tensor(x), g.ints([k])], outputs=2, axis=axis, **flags))


def _sort(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    """`aten.sort(x, dim=-1, descending=False)` and `aten.sort.stable(x, *, stable, dim, descending)` (`argsort`:
    ViT-MAE's random masking): ONNX TopK of every element along dim, values and int64 indices. TopK names the lower
    index first among equal elements, which is PyTorch's stable order in either direction."""
    x = node.args[0]
    if node.target == aten.sort.stable:
        dim, descending = node.kwargs.get("dim", -1), node.kwargs.get("descending", False)
    else:
        dim, descending = (list(node.args[1:]) + [-1, False][len(node.args) - 1 :])[:2]
    source = g.meta(x)  # type: ignore[arg-type]
    if source.dtype == torch.bool or source.dim() == 0:
        return None  # type: ignore[return-value]
    axis = _axis(dim, source.dim())  # type: ignore[arg-type]
    size = g.ints([source.shape[axis]])
    return tuple(g.emit("TopK", [g.tensor(x), size], outputs=2, axis=axis, largest=int(bool(descending)), sorted=1))


def _arg_extreme(op: str) -> Translation:
    """`aten.argmax` / `aten.argmin(x, dim=None, keepdim=False)`: ArgMax/ArgMin, which name the first extreme as
    PyTorch does; over x's flattened elements where dim is None (and, with keepdim, shaped [1] * rank). ONNX
    Runtime's kernels take floats and int32: the narrow integers are cast to int32; int64 (onnxruntime
    1.19 has no such kernel, and a float cannot hold it exactly) becomes the first position equal to the extreme,
    an ArgMax of the Equal's 0/1."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        x = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        source = g.meta(x)  # type: ignore[arg-type]
        value, rank = g.tensor(x), source.dim()
        flat = dim is None or rank == 0
        if flat:
            value, axis = g.one("Reshape", [value, g.ints([-1])]), 0
        else:
            axis = _axis(dim, rank)  # type: ignore[arg-type]
        found = _first_extreme(g, op, value, source.dtype, axis, keepdim and not flat)
        if found is None:
            return None  # type: ignore[return-value]
        if flat and keepdim:
            return g.one("Reshape", [found, g.ints([1] * rank)], allowzero=1)
        return found

    return translate_node


def _first_extreme(g: _Graph, op: str, value: Value, dtype: torch.dtype, axis: int, keepdim: bool) -> Value | None:
    """The position of the first maximum (`op` "Max") or minimum along `axis` of `value` (of `dtype`), as
    `_arg_extreme`'s docstring says; None for a dtype no form covers."""
    arg = f"Arg{op}"
    if dtype in (torch.uint8, torch.int8, torch.int16):
        value = g.one("Cast", [value], to=TensorProto.INT32)
    elif dtype == torch.int64:
        extreme = _reduce_node(g, f"Reduce{op}", value, [axis], True)
        value, arg = g.one("Cast", [g.one("Equal", [value, extreme])], to=TensorProto.INT32), "ArgMax"
    elif dtype not in (torch.float16, torch.float32, torch.float64, torch.int32):
        return None
    return g.one(arg, [value], axis=axis, keepdims=int(keepdim))


def _variance(result: str) -> Translation:
    """`aten.var_mean.correction` ("var_mean": (var, mean)), `aten.var.correction` ("var") and
    `aten.std.correction` ("std": its square root): the mean, and the mean of the squared deviations from it scaled
    by n / (n - correction) (n: the elements reduced)."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Any:
        x = node.args[0]
        dims: Any = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        correction = node.kwargs.get("correction")
        correction = 1 if correction is None else correction  # aten's default: Bessel's correction
        keepdim = bool(node.kwargs.get("keepdim", False))
        source = g.meta(x)  # type: ignore[arg-type]
        if source.dtype not in (torch.float32, torch.float64) or not isinstance(correction, (int, float)):
            return None  # float16 sums: PyTorch accumulates wider, torch.onnx matches it
        rank = source.dim()
        axes = [_axis(d, rank) for d in ([dims] if isinstance(dims, int) else (dims or range(rank)))]
        count = math.prod(source.shape[a] for a in axes)
        if correction and count <= correction:
            return None  # PyTorch's inf or nan: torch.onnx writes it
        x_value = g.tensor(x)
        kept = _reduce_node(g, "ReduceMean", x_value, axes, True)
        deviation = g.one("Sub", [x_value, kept])
        var = _reduce_node(g, "ReduceMean", g.one("Mul", [deviation, deviation]), axes, keepdim)
        if correction:
            var = g.one("Mul", [var, g.scalar(count / (count - correction), source.dtype)])
        if result == "var":
            return var
        if result == "std":
            return g.one("Sqrt", [var])
        return var, kept if keepdim else g.one("Squeeze", [kept, g.ints(axes)])

    return translate_node


def _constant_pad(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.constant_pad_nd`: a Slice for the negative pads (they crop; LocalResponseNorm's backward has them),
    then ONNX Pad for the positive ones (aten lists (begin, end) pairs from the last dim back; ONNX all begins,
    then all ends, from the first dim)."""
    x = node.args[0]
    pad: Any = node.args[1]
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    out, source = _meta(node), g.meta(x)  # type: ignore[arg-type]
    if not isinstance(value, (bool, int, float)):
        return None  # type: ignore[return-value]
    rank = out.dim()
    begins, ends = [0] * rank, [0] * rank
    for i in range(0, len(pad), 2):
        begins[rank - 1 - i // 2], ends[rank - 1 - i // 2] = pad[i], pad[i + 1]
    result = g.tensor(x)
    cropped = [d for d in range(rank) if begins[d] < 0 or ends[d] < 0]
    if cropped:
        starts = [max(-begins[d], 0) for d in cropped]
        stops = [source.shape[d] - max(-ends[d], 0) for d in cropped]
        result = g.one("Slice", [result, g.ints(starts), g.ints(stops), g.ints(cropped)])
    widened = [max(p, 0) for p in begins + ends]
    if not any(widened):
        return result
    return g.one("Pad", [result, g.ints(widened), g.scalar(value, out.dtype)], mode="constant")


def _mm(g: _Graph, node: torch.fx.Node) -> Value:
    if any(not g.meta(a).dtype.is_floating_point for a in node.args):  # type: ignore[arg-type]
        return None  # type: ignore[return-value]
    return g.one("MatMul", [g.tensor(a) for a in node.args])


def _addmm(g: _Graph, node: torch.fx.Node) -> Value:
    bias, a, b = node.args[:3]
    beta = node.kwargs.get("beta", 1)
    alpha = node.kwargs.get("alpha", 1)
    if not _meta(node).dtype.is_floating_point:
        return None  # type: ignore[return-value]
    return g.one("Gemm", [g.tensor(a), g.tensor(b), g.tensor(bias)], alpha=float(alpha), beta=float(beta))  # type: ignore[arg-type]


def _convolution(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.convolution`: ONNX Conv, or ConvTranspose when `transposed` (aten's transposed weight [C_in, C_out/g,
    k...] is ConvTranspose's layout), with the same strides, symmetric pads, dilations, groups and output padding;
    other argument forms are left to torch.onnx."""
    x, weight, bias = node.args[:3]
    settings: list[Any] = list(node.args[3:])
    stride, padding, dilation, transposed, output_padding, groups = settings
    out = _meta(node)
    if not out.dtype.is_floating_point or out.dim() < 3:
        return None  # type: ignore[return-value]
    n = out.dim() - 2
    inputs = [g.tensor(x), g.tensor(weight)] + ([g.tensor(bias)] if bias is not None else [])
    attrs: dict[str, Any] = {  # aten takes a one-element list for every spatial dim
        "strides": _expanded(stride, n),
        "pads": _expanded(padding, n) * 2,
        "dilations": _expanded(dilation, n),
        "group": int(groups),
        "kernel_shape": list(g.meta(weight).shape[2:]),  # type: ignore[arg-type]
    }
    if any(len(attrs[k]) != n for k in ("strides", "dilations", "kernel_shape")) or len(attrs["pads"]) != 2 * n:
        return None  # type: ignore[return-value]
    if transposed:
        return g.one("ConvTranspose", inputs, output_padding=_expanded(output_padding, n), **attrs)
    return g.one("Conv", inputs, **attrs)


def _pool_attributes(
    g: _Graph,
    node: torch.fx.Node,
    n: int,
    window: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    dilation: Sequence[int] | None = None,
) -> dict[str, Any] | None:
    """ONNX pooling attributes of an aten pooling over the last `n` dims, or None where ONNX's output size is not
    aten's: aten drops a ceil_mode window that starts in the right padding, ONNX keeps it."""
    source, out = g.meta(node.args[0]), node.meta["val"]  # type: ignore[arg-type]
    out = out[0] if isinstance(out, (tuple, list)) else out
    kernel = _expanded(window, n)
    strides = _expanded(stride, n) if len(stride) else kernel
    pads, dilations = _expanded(padding, n), _expanded(dilation or [1], n)
    rounding = math.ceil if ceil_mode else math.floor
    for i in range(n):
        size, extent = source.shape[-n + i], dilations[i] * (kernel[i] - 1) + 1
        if rounding((size + 2 * pads[i] - extent) / strides[i]) + 1 != out.shape[-n + i]:
            return None
    attrs: dict[str, Any] = {"kernel_shape": kernel, "strides": strides, "pads": pads * 2, "ceil_mode": int(ceil_mode)}
    if dilation is not None:
        attrs["dilations"] = dilations
    return attrs


def _expanded(values: Sequence[int], n: int) -> list[int]:
    values = [int(v) for v in values]
    return values * n if len(values) == 1 else values


def _batched(g: _Graph, x: Any, n: int) -> tuple[Value, bool]:
    """x with a batch dim of 1 prepended when it has none (aten's pooling takes [C, *spatial]; ONNX's needs N)."""
    if _rank(g, x) == n + 1:
        return g.one("Unsqueeze", [g.tensor(x), g.ints([0])]), True
    return g.tensor(x), False


def _avg_pool(n: int) -> Translation:
    """`aten.avg_pool{n}d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)`: ONNX
    AveragePool with aten's divisor: the window clipped to the padded input (count_include_pad), or to the input.
    A ceil_mode window that runs past the padded input is where runtimes differ: aten and onnxruntime 1.32 clip it
    to the padded input, onnxruntime 1.19 counts the overhang too (and an explicit zero Pad before a pooling that
    counts no padding gave a wrong divisor there as well: docs/engine.md §30). There the pooling counts no padding,
    which both runtimes do as aten does, times a constant per output: aten's divisor over that count. A
    `divisor_override` is left to torch.onnx's route (gradient/torch_decompositions.avg_pool2d)."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        x, kernel, *rest = node.args
        defaults: list[Any] = [[], [0], False, True, None]
        arguments: list[Any] = [*rest, *defaults[len(rest) :]]
        stride, padding, ceil_mode, count_include_pad, divisor = arguments
        out = _meta(node)
        if node.kwargs or divisor or not out.dtype.is_floating_point:
            return None  # type: ignore[return-value]
        attrs = _pool_attributes(g, node, n, kernel, stride, padding, bool(ceil_mode))  # type: ignore[arg-type]
        if attrs is None:
            return None  # type: ignore[return-value]
        value, added = _batched(g, x, n)
        sizes = g.meta(x).shape[-n:]  # type: ignore[arg-type]
        kernels = attrs["kernel_shape"]
        windows = zip(out.shape[-n:], attrs["strides"], kernels, sizes, attrs["pads"][:n], strict=True)
        # per dim, each output's window [start, end) in the input's coordinates, clipped to the padded input
        spans = [[(o * s - p, min(o * s - p + k, size + p)) for o in range(outs)] for outs, s, k, size, p in windows]
        overhang = any(end - start < k for dim, k in zip(spans, kernels, strict=True) for start, end in dim)
        counted = bool(count_include_pad) and not (ceil_mode and overhang)
        pooled = g.one("AveragePool", [value], count_include_pad=int(counted), **attrs)
        pooled = g.one("Squeeze", [pooled, g.ints([0])]) if added else pooled
        if counted or not count_include_pad:
            return pooled
        factor = np.ones([1] * (out.dim() - n) + [len(dim) for dim in spans], dtype=_np(out.dtype))
        for i, (dim, size) in enumerate(zip(spans, sizes, strict=True)):  # inputs in the window / aten's divisor
            ratio = np.asarray([(min(end, size) - max(start, 0)) / (end - start) for start, end in dim])
            factor = factor * ratio.astype(factor.dtype).reshape(
                [-1 if d == out.dim() - n + i else 1 for d in range(out.dim())]
            )
        return g.one("Mul", [pooled, g.const(factor)])

    return translate_node


def _max_pool(n: int) -> Translation:
    """`aten.max_pool{n}d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)`: ONNX MaxPool. Its
    Indices count over the whole NCHW tensor, aten's within each (batch, channel) plane: Mod by the plane's size
    turns one into the other (both name the first maximum in scanning order). Written only where read."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
        x, kernel, *rest = node.args
        defaults: list[Any] = [[], [0], [1], False]
        stride, padding, dilation, ceil_mode = [*rest, *defaults[len(rest) :]][:4]
        if node.kwargs or not g.meta(x).dtype.is_floating_point:  # type: ignore[arg-type]
            return None  # type: ignore[return-value]
        attrs = _pool_attributes(g, node, n, kernel, stride, padding, bool(ceil_mode), dilation)  # type: ignore[arg-type]
        if attrs is None:
            return None  # type: ignore[return-value]
        value, added = _batched(g, x, n)
        indexed = bool(_readers(node, 1))
        outs = g.emit("MaxPool", [value], outputs=2 if indexed else 1, **attrs)
        if indexed:
            plane = math.prod(g.meta(x).shape[-n:])  # type: ignore[arg-type]
            outs[1] = g.one("Mod", [outs[1], g.const(np.asarray(plane, dtype=np.int64))])
        if added:
            outs = [g.one("Squeeze", [o, g.ints([0])]) for o in outs]
        return (outs[0], outs[1] if indexed else g.fresh("unread_indices"))

    return translate_node


def _layer_norm(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    x, shape, weight, bias, eps = node.args
    values = node.meta["val"]
    dtype = g.meta(x).dtype  # type: ignore[arg-type]
    if dtype != torch.float32 or any(v.dtype != dtype for v in values):
        return None  # type: ignore[return-value]
    rank = _rank(g, x)  # type: ignore[arg-type]
    normalized = list(shape)  # type: ignore[arg-type]
    scale = g.tensor(weight) if weight is not None else g.const(torch.ones(normalized, dtype=dtype))
    inputs = [g.tensor(x), scale] + ([g.tensor(bias)] if bias is not None else [])
    outs = g.emit("LayerNormalization", inputs, outputs=3, axis=rank - len(normalized), epsilon=float(eps))  # type: ignore[arg-type]
    return tuple(outs)


def _normalized(g: _Graph, x: Value, axes: list[int], eps: float, dtype: torch.dtype) -> tuple[Value, Value, Value]:
    """(x - mean) * rstd over `axes`, the mean and rstd = 1 / sqrt(biased var + eps), both kept [.., 1, ..]."""
    mean = _reduce_node(g, "ReduceMean", x, axes, True)
    deviation = g.one("Sub", [x, mean])
    var = _reduce_node(g, "ReduceMean", g.one("Mul", [deviation, deviation]), axes, True)
    rstd = g.one("Reciprocal", [g.one("Sqrt", [g.one("Add", [var, g.scalar(eps, dtype)])])])
    return g.one("Mul", [deviation, rstd]), mean, rstd


def _affine(g: _Graph, value: Value, weight: Any, bias: Any, channels: int, rank: int, dtype: torch.dtype) -> Value:
    """value * weight + bias, both [C] over dim 1 of a rank-`rank` value (None: left out)."""
    shape = g.ints([channels] + [1] * (rank - 2))
    if weight is not None:
        value = g.one("Mul", [value, g.one("Reshape", [g.typed(weight, dtype), shape])])
    if bias is not None:
        value = g.one("Add", [value, g.one("Reshape", [g.typed(bias, dtype), shape])])
    return value


def _group_norm(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    """`aten.native_group_norm(x, weight, bias, N, C, HxW, group, eps)`: x viewed as [N, group, rest], normalized
    over rest (`_normalized`), viewed back, then weight and bias per channel; mean and rstd are [N, group].
    float32 and float64 only (PyTorch computes float16's statistics in float32; torch.onnx writes that)."""
    arguments: Any = node.args
    x, weight, bias, batch, channels, _spatial, group, eps = arguments
    source = g.meta(x)
    if source.dtype not in (torch.float32, torch.float64) or not isinstance(group, int):
        return None  # type: ignore[return-value]
    grouped = g.one("Reshape", [g.tensor(x), g.ints([int(batch), group, -1])])
    normalized, mean, rstd = _normalized(g, grouped, [2], float(eps), source.dtype)
    value = g.one("Reshape", [normalized, g.ints(list(source.shape))])
    value = _affine(g, value, weight, bias, int(channels), source.dim(), source.dtype)
    statistics = g.ints([int(batch), group])
    return value, g.one("Reshape", [mean, statistics]), g.one("Reshape", [rstd, statistics])


def _batch_norm_batch_statistics(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    """`aten._native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)` (BatchNorm without
    running statistics; InstanceNorm calls it on x viewed as [1, N*C, ...]): normalized over every dim but the
    channels' (`_normalized`), then weight and bias; the saved mean and rstd are [C]. float32 and float64 only."""
    x, weight, bias, _training, _momentum, eps = node.args
    source = g.meta(x)  # type: ignore[arg-type]
    if source.dtype not in (torch.float32, torch.float64) or source.dim() < 2:
        return None  # type: ignore[return-value]
    axes = [0, *range(2, source.dim())]
    normalized, mean, rstd = _normalized(g, g.tensor(x), axes, float(eps), source.dtype)  # type: ignore[arg-type]
    value = _affine(g, normalized, weight, bias, source.shape[1], source.dim(), source.dtype)
    return value, g.one("Reshape", [mean, g.ints([-1])]), g.one("Reshape", [rstd, g.ints([-1])])


def _batch_norm_inference(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    """`aten._native_batch_norm_legit_no_training` (BatchNorm on its running statistics; only an eval-mode forward
    traced without a backward keeps it: torch_private.forward_decompositions): ONNX BatchNormalization in
    inference mode, which ONNX Runtime folds into a Conv before it, computing in float32 (float64 for float64
    input) as PyTorch does for float16 input; the op's other two outputs are empty."""
    x, weight, bias, mean, var, _momentum, eps = node.args
    source, out = g.meta(x), node.meta["val"][0]  # type: ignore[arg-type]
    if not source.dtype.is_floating_point or source.dim() < 2:
        return None  # type: ignore[return-value]
    compute = torch.float64 if source.dtype == torch.float64 else torch.float32
    channels = source.shape[1]
    scale = g.typed(weight, compute) if weight is not None else g.const(torch.ones(channels, dtype=compute))
    shift = g.typed(bias, compute) if bias is not None else g.const(torch.zeros(channels, dtype=compute))
    inputs = [g.typed(x, compute), scale, shift, g.typed(mean, compute), g.typed(var, compute)]
    result = g.cast(g.one("BatchNormalization", inputs, epsilon=float(eps)), compute, out.dtype)  # type: ignore[arg-type]
    empty = g.const(torch.empty(0, dtype=node.meta["val"][1].dtype))
    return result, empty, empty


def _softmax(op: str) -> Translation:
    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        x, dim, half_to_float = node.args
        if half_to_float or _meta(node).dtype != g.meta(x).dtype:  # type: ignore[arg-type]
            return None  # type: ignore[return-value]
        return g.one(op, [g.tensor(x)], axis=_axis(dim, _rank(g, x)))  # type: ignore[arg-type]

    return translate_node


def _embedding(g: _Graph, node: torch.fx.Node) -> Value:
    weight, indices = node.args[:2]
    return g.one("Gather", [g.tensor(weight), g.tensor(indices)], axis=0)


def _gather(g: _Graph, node: torch.fx.Node) -> Value:
    x, dim, index = node.args[:3]
    if node.kwargs.get("sparse_grad") or (len(node.args) > 3 and node.args[3]):
        return None  # type: ignore[return-value]
    # aten takes an empty index of any integer type; GatherElements takes int32 and int64 only
    index_value = g.cast(g.tensor(index), g.meta(index).dtype, torch.int64)  # type: ignore[arg-type]
    return g.one("GatherElements", [g.tensor(x), index_value], axis=_axis(dim, _rank(g, x)))  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Indexing:
    """aten's advanced indexing of x by integer tensors at some of its dims: x with those dims moved first (`perm`),
    the indices wrapped into [0, size) (`wrapped`), broadcast to one shape B and stacked as the last dim of one
    GatherND / ScatterND index [*B, k] (`index`); aten's result puts B at `at` among x's other dims (`others`): in
    place of the indexed dims when they are adjacent, else first."""

    perm: list[int]
    wrapped: list[tuple[Value, list[int]]]  # each index wrapped, with its shape
    batch: list[int]
    others: list[int]  # the sizes of x's dims that are not indexed, in order
    at: int

    def index(self, g: _Graph) -> Value:
        """The stacked index [*B, k]."""
        stacked = []
        for value, shape in self.wrapped:
            broadcast = value if shape == self.batch else g.one("Expand", [value, g.ints(self.batch)])
            stacked.append(g.one("Unsqueeze", [broadcast, g.ints([-1])]))
        return stacked[0] if len(stacked) == 1 else g.one("Concat", stacked, axis=-1)

    def front(self, g: _Graph, x: Value) -> Value:
        """x with the indexed dims first."""
        return x if self.perm == sorted(self.perm) else g.one("Transpose", [x], perm=self.perm)

    def aten_layout(self) -> list[int]:
        """The permutation from B + others (GatherND's result) to aten's result."""
        b = len(self.batch)
        return [*range(b, b + self.at), *range(b), *range(b + self.at, b + len(self.others))]


def _indexing(g: _Graph, x: Any, indices: Sequence[Any]) -> _Indexing | None:
    """`_Indexing` of x by aten's `indices` (None: a whole dim), or None for bool masks (their result's shape
    depends on the values)."""
    source = g.meta(x)
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    if not given or any(g.meta(i).dtype not in (torch.int64, torch.int32) for _, i in given):
        return None
    wrapped = []
    for d, i in given:
        if i in g.constants:  # reflection and replication pads index by constants
            wrapped.append(g.const(g.constants[i].to(torch.int64) % source.shape[d]))
            continue
        size = g.const(np.asarray(source.shape[d], dtype=np.int64))
        index = g.cast(g.tensor(i), g.meta(i).dtype, torch.int64)
        wrapped.append(g.one("Mod", [g.one("Add", [index, size]), size]))
    dims = [d for d, _ in given]
    others = [d for d in range(source.dim()) if d not in dims]
    shapes = [list(g.meta(i).shape) for _, i in given]
    batch = list(torch.broadcast_shapes(*[tuple(shape) for shape in shapes]))
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    sizes = [source.shape[d] for d in others]
    return _Indexing(dims + others, list(zip(wrapped, shapes, strict=True)), batch, sizes, dims[0] if adjacent else 0)


def _index(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.index.Tensor(x, indices)` with integer index tensors: one index is Gather on its dim; several are a
    GatherND over x with the indexed dims first, its result moved to aten's layout (`_Indexing`)."""
    x, indices = node.args[:2]
    indexing = _indexing(g, x, indices)  # type: ignore[arg-type]
    if indexing is None:
        return None  # type: ignore[return-value]
    if len(indexing.wrapped) == 1:  # perm starts with the indexed dim
        return g.one("Gather", [g.tensor(x), indexing.wrapped[0][0]], axis=indexing.perm[0])
    gathered = g.one("GatherND", [indexing.front(g, g.tensor(x)), indexing.index(g)])  # B + the other dims
    layout = indexing.aten_layout()
    return gathered if layout == sorted(layout) else g.one("Transpose", [gathered], perm=layout)


def _index_select(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.index_select(x, dim, index)`: ONNX Gather (aten refuses negative indices); a 0-d x is read as [1] and
    the result has the node's shape (aten's is 0-d or [1] there, ONNX Gather takes no 0-d data)."""
    x, dim, index = node.args
    if _rank(g, x) == 0:  # type: ignore[arg-type]
        column = g.one("Reshape", [g.tensor(x), g.ints([1])])
        gathered = g.one("Gather", [column, g.tensor(index)], axis=0)
        return g.one("Reshape", [gathered, g.ints(list(_meta(node).shape))])
    return g.one("Gather", [g.tensor(x), g.tensor(index)], axis=_axis(dim, _rank(g, x)))  # type: ignore[arg-type]


def _scatter(g: _Graph, node: torch.fx.Node) -> Value:
    x, dim, index, source = node.args[:4]
    out = _meta(node)
    if node.kwargs.get("reduce") or len(node.args) > 4 or out.dim() == 0:  # ONNX scatters into rank >= 1
        return None  # type: ignore[return-value]
    axis = _axis(dim, out.dim())  # type: ignore[arg-type]
    updates = _scatter_updates(g, source, list(g.meta(index).shape), out.dtype)  # type: ignore[arg-type]
    reduction = "add" if node.target == aten.scatter_add.default else "none"
    return g.one("ScatterElements", [g.tensor(x), g.tensor(index), updates], axis=axis, reduction=reduction)


def _scatter_updates(g: _Graph, source: Any, shape: list[int], dtype: torch.dtype) -> Value:
    """A scatter's values, of the index's `shape`: aten reads a source tensor at the index's positions only (a
    Slice when it is larger), and a number everywhere (an Expand)."""
    if not isinstance(source, torch.fx.Node):
        return g.one("Expand", [g.scalar(source, dtype), g.ints(shape)])
    updates = g.typed(source, dtype)
    if list(g.meta(source).shape) != shape:
        updates = g.one("Slice", [updates, g.ints([0] * len(shape)), g.ints(shape), g.ints(range(len(shape)))])
    return updates


_SCATTER_REDUCTIONS = {"sum": "add", "mean": "add", "prod": "mul", "amax": "max", "amin": "min"}


def _scatter_reduce(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.scatter_reduce.two(x, dim, index, src, reduce, include_self=True)` (graph networks' `scatter_max`,
    `scatter_mean`): ScatterElements with ONNX's reduction, which combines every value sent to one position (sum add,
    prod mul, amax max, amin min; mean a sum divided by the number of values at each position, at least 1). Without
    include_self, the positions the index names first take a value the reduction keeps: 0 for sum and mean, 1 for
    prod, and for amax/amin src's own values (the one written among duplicates is one of them, which the reduction
    then meets again). An integer mean (aten rounds it down) and a 0-d x (ONNX scatters into rank >= 1) are left
    to torch.onnx."""
    x, dim, index, source, reduce = node.args[:5]
    include_self = node.args[5] if len(node.args) > 5 else node.kwargs.get("include_self", True)
    out = _meta(node)
    if reduce not in _SCATTER_REDUCTIONS or (reduce == "mean" and not out.dtype.is_floating_point) or out.dim() == 0:
        return None  # type: ignore[return-value]
    shape = list(g.meta(index).shape)  # type: ignore[arg-type]
    axis = _axis(dim, out.dim())  # type: ignore[arg-type]
    updates, positions, base = _scatter_updates(g, source, shape, out.dtype), g.tensor(index), g.tensor(x)
    if not include_self:
        neutral = (
            updates if reduce in ("amax", "amin") else _scatter_updates(g, int(reduce == "prod"), shape, out.dtype)
        )
        base = g.one("ScatterElements", [base, positions, neutral], axis=axis, reduction="none")
    total = g.one("ScatterElements", [base, positions, updates], axis=axis, reduction=_SCATTER_REDUCTIONS[str(reduce)])
    if reduce != "mean":
        return total
    start = g.one("Expand", [g.scalar(int(bool(include_self)), out.dtype), g.ints(list(out.shape))])
    ones = _scatter_updates(g, 1, shape, out.dtype)
    counts = g.one("ScatterElements", [start, positions, ones], axis=axis, reduction="add")
    return g.one("Div", [total, g.one("Max", [counts, g.scalar(1, out.dtype)])])


def _index_put(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.index_put(x, indices, values, accumulate)` with integer index tensors (the backward of `x[i, j]` has
    several): ScatterND (reduction add when accumulating) into x with the indexed dims first, of the values broadcast
    to aten's `x[indices]` layout and moved to ScatterND's (`_Indexing`); x's dims are then put back."""
    x, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    indexing = _indexing(g, x, list(indices))  # type: ignore[arg-type]
    if indexing is None:
        return None  # type: ignore[return-value]
    out = _meta(node)
    layout = indexing.aten_layout()
    aten_shape = [[*indexing.batch, *indexing.others][p] for p in layout]
    updates = g.one("Expand", [g.typed(values, out.dtype), g.ints(aten_shape)])
    if layout != sorted(layout):  # aten's layout -> B + the other dims
        updates = g.one("Transpose", [updates], perm=[layout.index(i) for i in range(len(layout))])
    reduction = "add" if accumulate else "none"
    front = indexing.front(g, g.typed(x, out.dtype))
    scattered = g.one("ScatterND", [front, indexing.index(g), updates], reduction=reduction)
    if indexing.perm == sorted(indexing.perm):
        return scattered
    return g.one("Transpose", [scattered], perm=[indexing.perm.index(i) for i in range(len(indexing.perm))])


def _fill(g: _Graph, node: torch.fx.Node) -> Value:
    """full/zeros/ones/scalar_tensor/*_like with a static shape (small ones are folded before)."""
    out = _meta(node)
    target = node.target
    if target in (aten.full.default, aten.full_like.default):
        value = node.args[1]
    elif target in (aten.zeros.default, aten.zeros_like.default, aten.empty.memory_format, aten.empty_like.default):
        value = 0  # empty's contents are unspecified: zeros, so that the graph is the same every time
    elif target in (aten.ones.default, aten.ones_like.default):
        value = 1
    elif target == aten.scalar_tensor.default:
        value = node.args[0]
    else:
        return None  # type: ignore[return-value]
    if not isinstance(value, (bool, int, float)):
        return None  # type: ignore[return-value]
    fill = numpy_helper.from_array(np.asarray([value], dtype=_np(out.dtype)))
    return g.one("ConstantOfShape", [g.ints(list(out.shape))], value=fill)


def _random(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.rand`/`randn` (a static size) and `rand_like`/`randn_like`: ONNX RandomUniform/RandomNormal(Like) in
    [0, 1) or N(0, 1), as torch.onnx writes them. They draw from ONNX Runtime's generator, which the trainer seeds
    (trainer/model.py), not torch's: the same distribution, other numbers. Never folded (`_RANDOM`)."""
    out = _meta(node)
    if out.dtype not in (torch.float16, torch.float32, torch.float64) or node.kwargs.get("generator") is not None:
        return None  # type: ignore[return-value]
    normal = node.target in (aten.randn.default, aten.randn_like.default)
    like = node.target in (aten.rand_like.default, aten.randn_like.default)
    attrs: dict[str, Any] = {"dtype": torch_to_onnx(out.dtype)}
    attrs.update({"mean": 0.0, "scale": 1.0} if normal else {"low": 0.0, "high": 1.0})
    if like:
        return g.one("RandomNormalLike" if normal else "RandomUniformLike", [g.tensor(node.args[0])], **attrs)
    if out.dim() == 0:  # ONNX's attribute cannot be an empty list: draw [1], view it as 0-d
        drawn = g.one("RandomNormal" if normal else "RandomUniform", [], shape=[1], **attrs)
        return g.one("Reshape", [drawn, g.ints([])])
    return g.one("RandomNormal" if normal else "RandomUniform", [], shape=list(out.shape), **attrs)


def _bernoulli(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.bernoulli.p(x, p)`: ones with probability p, zeros else, in x's shape and dtype (an in-place dropout,
    `nn.Dropout(inplace=True)` as MobileNetV2's head has it, draws its mask so): a uniform draw below p, from ONNX
    Runtime's generator as `_random`'s. Never folded (`_RANDOM`)."""
    x = node.args[0]
    probability = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    out = _meta(node)
    if not out.dtype.is_floating_point or not isinstance(probability, (int, float)) or node.kwargs.get("generator"):
        return None  # type: ignore[return-value]
    drawn = g.one("RandomUniformLike", [g.tensor(x)], dtype=TensorProto.FLOAT, low=0.0, high=1.0)
    below = g.one("Less", [drawn, g.scalar(float(probability), torch.float32)])
    return g.one("Cast", [below], to=torch_to_onnx(out.dtype))


def _uniform(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.uniform(x, from, to)` (`Tensor.uniform_`: PhiMoE's and Switch Transformers' router jitter): uniform draws
    in [from, to] in x's shape and dtype, from ONNX Runtime's generator as `_random`'s. Never folded (`_RANDOM`).
    In float64, `from + (to - from) · u` of draws u in [0, 1): RandomUniformLike's `low` and `high` are float32
    attributes, whose rounding of `from` and `to` put float64 draws outside the interval (1.1 is 1.10000002)."""
    x = node.args[0]
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("from", 0.0)
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("to", 1.0)
    out = _meta(node)
    if out.dtype not in (torch.float16, torch.float32, torch.float64) or node.kwargs.get("generator") is not None:
        return None  # type: ignore[return-value]
    if not isinstance(low, (int, float)) or not isinstance(high, (int, float)):
        return None  # type: ignore[return-value]
    if out.dtype != torch.float64:
        attrs = {"dtype": torch_to_onnx(out.dtype), "low": float(low), "high": float(high)}
        return g.one("RandomUniformLike", [g.tensor(x)], **attrs)
    drawn = g.one("RandomUniformLike", [g.tensor(x)], dtype=torch_to_onnx(out.dtype), low=0.0, high=1.0)
    spread = g.one("Mul", [drawn, g.scalar(float(high) - float(low), out.dtype)])
    return g.one("Add", [spread, g.scalar(float(low), out.dtype)])


def _randint(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.randint(high, size)` and `randint.low(low, high, size)` (a static size: Informer's ProbSparse attention
    samples its keys so in training mode): integers uniform in [low, high), as `low + floor((high - low) · u)` of
    float64 draws u in [0, 1) from ONNX Runtime's generator as `_random`'s, at most high - 1 (float64 rounds
    `(high - low) · u` up to high - low for u just below 1), cast to the result's dtype. Never folded (`_RANDOM`)."""
    low, high = (0, node.args[0]) if node.target == aten.randint.default else node.args[:2]
    out = _meta(node)
    if not isinstance(low, int) or not isinstance(high, int) or high <= low or node.kwargs.get("generator"):
        return None  # type: ignore[return-value]
    if out.dtype == torch.bool or out.dtype.is_complex:
        return None  # type: ignore[return-value]
    drawn = g.one("RandomUniform", [], shape=list(out.shape) or [1], dtype=TensorProto.DOUBLE, low=0.0, high=1.0)
    spread = g.one("Floor", [g.one("Mul", [drawn, g.scalar(float(high - low), torch.float64)])])
    shifted = g.one("Add", [spread, g.scalar(float(low), torch.float64)])
    value = g.one(
        "Cast", [g.one("Min", [shifted, g.scalar(float(high - 1), torch.float64)])], to=torch_to_onnx(out.dtype)
    )
    return value if out.dim() > 0 else g.one("Reshape", [value, g.ints([])])


def _exponential(g: _Graph, node: torch.fx.Node) -> Value:
    """`aten.exponential(x, lambd)` (`Tensor.exponential_`: the Gumbel noise of `F.gumbel_softmax`, PhiMoE's router):
    draws from the exponential distribution of rate lambd in x's shape and dtype, as -log(1 - u) / lambd of a
    uniform draw u in [0, 1) (finite: 1 - u > 0), from ONNX Runtime's generator as `_random`'s. Never folded
    (`_RANDOM`)."""
    x = node.args[0]
    rate = node.args[1] if len(node.args) > 1 else node.kwargs.get("lambd", 1.0)
    out = _meta(node)
    if out.dtype not in (torch.float16, torch.float32, torch.float64) or node.kwargs.get("generator") is not None:
        return None  # type: ignore[return-value]
    if not isinstance(rate, (int, float)) or rate <= 0:
        return None  # type: ignore[return-value]
    drawn = g.one("RandomUniformLike", [g.tensor(x)], dtype=torch_to_onnx(out.dtype), low=0.0, high=1.0)
    left = g.one("Sub", [g.scalar(1.0, out.dtype), drawn])
    return g.one("Div", [g.one("Neg", [g.one("Log", [left])]), g.scalar(float(rate), out.dtype)])


def _dropout(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    x, p, train = node.args
    out = g.meta(x)  # type: ignore[arg-type]
    if train is False or not out.dtype.is_floating_point:
        return None  # type: ignore[return-value]
    ratio = g.scalar(float(p), out.dtype)  # type: ignore[arg-type]
    training = g.const(np.asarray(True))
    return tuple(g.emit("Dropout", [g.tensor(x), ratio, training], outputs=2))


@dataclass(frozen=True)
class _UnrolledRecurrence:
    """An unrolled `lstm_recurrence`'s per-step values its backward reads, each [H or 4H, B] (feature-major)."""

    cs_output: Value  # the recurrence's `cs` output
    forget: list[Value]  # f
    through_cell: list[Value]  # o·(1 - tanh²(c)): d c from d h
    gate_factors: list[Value]  # (g·i(1-i), c_prev·f(1-f), i·(1-g²), tanh(c)·o(1-o)) stacked: d gates from d c, d h


def _lstm_recurrence(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    """The recurrence unrolled, feature-major as the op is (gradient/recurrent_layers.py): the state is hᵀ, cᵀ
    [H, B], each step's gates W_hh·hᵀ + its columns of gates_x [4H, B]. Per step (in reverse for `reverse`): MatMul,
    Add, Split into i, f, g, o, their activations, the cell update; where the backward reads the step, also the
    factors it needs (`_UnrolledRecurrence`). An output is the steps' Concat where an op other than the backward
    reads it."""
    _, h0, c0, w_hh, reverse = node.args
    unrolled = _unrolled_inputs(g, node, gates=4, for_backward=2)
    if unrolled is None:
        return None  # type: ignore[return-value]
    inputs, hidden, batch = unrolled
    steps = len(inputs)
    h, c = (g.one("Transpose", [g.tensor(v)], perm=[1, 0]) for v in (h0, c0))
    backward = bool(_backward_readers(node))
    one = g.scalar(1.0, torch.float32)
    cell_part = np.concatenate([np.zeros(2 * hidden), np.ones(hidden), np.zeros(hidden)]).astype(np.float32)
    cell_mask = g.const(cell_part[:, None])
    hs, cs, forget, through_cell, factors = ([""] * steps for _ in range(5))
    for t in reversed(range(steps)) if reverse else range(steps):
        c_prev = c
        gates = g.one("Add", [g.one("MatMul", [g.tensor(w_hh), h]), inputs[t]])
        i, f, cell, o = g.emit("Split", [gates, g.ints([hidden] * 4)], outputs=4, axis=0)
        i, f, cell, o = g.one("Sigmoid", [i]), g.one("Sigmoid", [f]), g.one("Tanh", [cell]), g.one("Sigmoid", [o])
        c = g.one("Add", [g.one("Mul", [f, c]), g.one("Mul", [i, cell])])
        tanh_c = g.one("Tanh", [c])
        h = g.one("Mul", [o, tanh_c])
        hs[t], cs[t] = h, c
        if backward:  # activations' derivatives (1 - a)·(a + m): a·(1 - a) for σ, 1 - a² for tanh (m: cell_mask)
            acts = g.one("Concat", [i, f, cell, o], axis=0)
            derivative = g.one("Mul", [g.one("Sub", [one, acts]), g.one("Add", [acts, cell_mask])])
            factors[t] = g.one("Mul", [g.one("Concat", [cell, c_prev, i, tanh_c], axis=0), derivative])
            through_cell[t] = g.one("Mul", [o, g.one("Sub", [one, g.one("Mul", [tanh_c, tanh_c])])])
            forget[t] = f
    outputs = tuple(
        g.one("Concat", values, axis=1) if _read_outside_backward(node, k) else g.fresh("unmaterialized")
        for k, values in enumerate((hs, cs, [""]))
    )
    if backward:
        g.recurrences[outputs[2]] = _UnrolledRecurrence(outputs[1], forget, through_cell, factors)
    return outputs


def _unrolled_inputs(
    g: _Graph, node: torch.fx.Node, gates: int, for_backward: int
) -> tuple[list[Value], int, int] | None:
    """(each step's [gates·H, B] columns of the recurrence's gates_x, H, B), or None where the op is not translated:
    not float32, or its output `for_backward` (saved for its backward only) is read elsewhere."""
    gates_x, h0 = node.args[:2]
    width, columns = g.meta(gates_x).shape  # type: ignore[arg-type]
    batch = g.meta(h0).shape[0]  # type: ignore[arg-type]
    if g.meta(gates_x).dtype != torch.float32 or _read_outside_backward(node, for_backward):  # type: ignore[arg-type]
        return None
    return _steps_of(g, g.tensor(gates_x), columns // batch, batch), width // gates, batch


def _steps_of(g: _Graph, value: Value, steps: int, batch: int) -> list[Value]:
    """The T per-step column blocks [·, B] of a feature-major [·, T·B] value."""
    return g.emit("Split", [value, g.ints([batch] * steps)], outputs=steps, axis=1)


def _backward_readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The recurrence backward nodes reading any output of `node`."""
    return [r for r in _readers(node) if _custom_op_name(r.target) in _BACKWARD_OPS]


def _read_outside_backward(node: torch.fx.Node, index: int) -> bool:
    """Whether output `index` of `node` is read by anything but a recurrence backward."""
    return any(_custom_op_name(r.target) not in _BACKWARD_OPS for r in _readers(node, index))


def _readers(node: torch.fx.Node, index: int | None = None) -> list[torch.fx.Node]:
    """The nodes reading output `index` (None: any output) of the multi-output `node`, through views of the same
    shape (which are the value itself: `_reshape`)."""
    readers = [r for item in node.users if index is None or item.args[1] == index for r in item.users]
    while any(_same_shape_view(r) for r in readers):
        readers = [v for r in readers for v in (r.users if _same_shape_view(r) else [r])]
    return readers


def _same_shape_view(node: torch.fx.Node) -> bool:
    """A view (`_reshape`'s ops) to its input's own shape (AOTAutograd views the tensors it saves for the
    backward so)."""
    if node.target not in _VIEWS:
        return False
    source = node.args[0]
    value, result = source.meta.get("val"), node.meta.get("val")  # type: ignore[union-attr]
    return isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor) and value.shape == result.shape


def _lstm_recurrence_backward(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    """The recurrence's backward unrolled, feature-major as the op is, over the factors its forward computed
    (`lstm_recurrence_backward`'s docstring): per step, backward in time, d h = d hs[t] + the later step's, d c =
    d cs[t] + the later step's + d h·o·(1 - tanh²(c)), d gates = (d c, d c, d c, d h) stacked times the gate factors,
    the earlier step's d c = d c·f and its d h = W_hhᵀ·d gates."""
    grad_hs, grad_cs, cs, acts, c0, w_hh, reverse = node.args
    forward = g.recurrences.get(g.tensor(acts))
    if not isinstance(forward, _UnrolledRecurrence) or g.tensor(cs) != forward.cs_output:  # not one forward's values
        return None  # type: ignore[return-value]
    batch = g.meta(c0).shape[0]  # type: ignore[arg-type]
    steps = g.meta(grad_hs).shape[1] // batch  # type: ignore[arg-type]
    upper_h = _steps_of(g, g.tensor(grad_hs), steps, batch)
    upper_c = None if grad_cs is None else _steps_of(g, g.tensor(grad_cs), steps, batch)
    w_t = g.one("Transpose", [g.tensor(w_hh)], perm=[1, 0])  # once, read by every step's product
    grad_gates = [""] * steps
    grad_h = grad_c = ""
    for t in range(steps) if reverse else reversed(range(steps)):
        grad_h = g.one("Add", [upper_h[t], grad_h]) if grad_h else upper_h[t]
        if upper_c is not None:
            grad_c = g.one("Add", [upper_c[t], grad_c]) if grad_c else upper_c[t]
        from_h = g.one("Mul", [grad_h, forward.through_cell[t]])
        grad_c = g.one("Add", [grad_c, from_h]) if grad_c else from_h
        upstream = g.one("Concat", [grad_c, grad_c, grad_c, grad_h], axis=0)
        grad_gates[t] = g.one("Mul", [upstream, forward.gate_factors[t]])
        grad_c = g.one("Mul", [grad_c, forward.forget[t]])
        grad_h = g.one("MatMul", [w_t, grad_gates[t]])
    return (
        g.one("Concat", grad_gates, axis=1),
        g.one("Transpose", [grad_h], perm=[1, 0]),
        g.one("Transpose", [grad_c], perm=[1, 0]),
    )


@dataclass(frozen=True)
class _UnrolledGRU:
    """An unrolled `gru_recurrence`'s per-step values its backward reads, each [H or 3H, B] (feature-major)."""

    update: list[Value]  # z: d h_prev from d h, besides through W_hh
    input_factors: list[Value]  # d gates_x from d h (stacked three times): r, z, n pre-activation factors
    recurrent_factors: list[Value]  # d gh from d h (stacked three times)


def _gru_recurrence(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    """A GRU layer's recurrence unrolled, feature-major as the op is (gradient/recurrent_layers.py): per step (in
    reverse for `reverse`) gh = W_hh·hᵀ (+ b_hh), r, z = σ(gates_x's + gh's r, z parts), n = tanh(gates_x's n + r·gh's
    n), h = n + z·(h - n); where the backward reads the step, also the factors it multiplies d h by
    (`_UnrolledGRU`). The hs are the steps' Concat where an op other than the backward reads them."""
    _, h0, w_hh, b_hh, reverse = node.args
    unrolled = _unrolled_inputs(g, node, gates=3, for_backward=1)
    if unrolled is None:
        return None  # type: ignore[return-value]
    inputs, hidden, batch = unrolled
    steps = len(inputs)
    bias = None if b_hh is None else g.one("Unsqueeze", [g.tensor(b_hh), g.ints([1])])
    h = g.one("Transpose", [g.tensor(h0)], perm=[1, 0])
    backward = bool(_backward_readers(node))
    one = g.scalar(1.0, torch.float32)
    hs, update, input_factors, recurrent_factors = ([""] * steps for _ in range(4))
    for t in reversed(range(steps)) if reverse else range(steps):
        recurrent = g.one("MatMul", [g.tensor(w_hh), h])
        recurrent = recurrent if bias is None else g.one("Add", [recurrent, bias])
        x_rz, x_n = g.emit("Split", [inputs[t], g.ints([2 * hidden, hidden])], outputs=2, axis=0)
        h_rz, h_n = g.emit("Split", [recurrent, g.ints([2 * hidden, hidden])], outputs=2, axis=0)
        r, z = g.emit(
            "Split", [g.one("Sigmoid", [g.one("Add", [x_rz, h_rz])]), g.ints([hidden] * 2)], outputs=2, axis=0
        )
        n = g.one("Tanh", [g.one("Add", [x_n, g.one("Mul", [r, h_n])])])
        kept = g.one("Sub", [h, n])  # h_prev - n
        h = g.one("Add", [n, g.one("Mul", [z, kept])])
        hs[t] = h
        if backward:
            not_z = g.one("Sub", [one, z])
            through_n = g.one("Mul", [not_z, g.one("Sub", [one, g.one("Mul", [n, n])])])  # (1 - z)·(1 - n²)
            through_z = g.one("Mul", [kept, g.one("Mul", [z, not_z])])  # (h_prev - n)·z(1 - z)
            through_r = g.one("Mul", [g.one("Mul", [through_n, h_n]), g.one("Mul", [r, g.one("Sub", [one, r])])])
            input_factors[t] = g.one("Concat", [through_r, through_z, through_n], axis=0)
            recurrent_factors[t] = g.one("Concat", [through_r, through_z, g.one("Mul", [through_n, r])], axis=0)
            update[t] = z
    outputs = (
        g.one("Concat", hs, axis=1) if _read_outside_backward(node, 0) else g.fresh("unmaterialized"),
        g.fresh("unmaterialized"),
    )
    if backward:
        g.recurrences[outputs[1]] = _UnrolledGRU(update, input_factors, recurrent_factors)
    return outputs


def _gru_recurrence_backward(g: _Graph, node: torch.fx.Node) -> tuple[Value, ...]:
    """A GRU recurrence's backward unrolled, feature-major, over the factors its forward computed
    (`gru_recurrence_backward`'s docstring): per step, backward in time, d h = d hs[t] + the later step's,
    d gates_x and d gh = (d h, d h, d h) stacked times their factors, the earlier step's d h = d h·z + W_hhᵀ·d gh."""
    grad_hs, _, saved, h0, w_hh, reverse = node.args
    forward = g.recurrences.get(g.tensor(saved))
    if not isinstance(forward, _UnrolledGRU):
        return None  # type: ignore[return-value]
    batch = g.meta(h0).shape[0]  # type: ignore[arg-type]
    steps = g.meta(grad_hs).shape[1] // batch  # type: ignore[arg-type]
    upper = _steps_of(g, g.tensor(grad_hs), steps, batch)
    # once, read by every step's product; ONNX Runtime folds it into each step's Gemm here (docs/engine.md §23)
    w_t = g.one("Transpose", [g.tensor(w_hh)], perm=[1, 0])
    grad_gates, grad_recurrent = [""] * steps, [""] * steps
    grad_h = ""
    for t in range(steps) if reverse else reversed(range(steps)):
        grad_h = g.one("Add", [upper[t], grad_h]) if grad_h else upper[t]
        stacked = g.one("Concat", [grad_h, grad_h, grad_h], axis=0)
        grad_gates[t] = g.one("Mul", [stacked, forward.input_factors[t]])
        grad_recurrent[t] = g.one("Mul", [stacked, forward.recurrent_factors[t]])
        grad_h = g.one("Add", [g.one("Mul", [grad_h, forward.update[t]]), g.one("MatMul", [w_t, grad_recurrent[t]])])
    return (
        g.one("Concat", grad_gates, axis=1),
        g.one("Concat", grad_recurrent, axis=1),
        g.one("Transpose", [grad_h], perm=[1, 0]),
    )


_BACKWARD_OPS = {"orttrainer::lstm_recurrence_backward", "orttrainer::gru_recurrence_backward"}


def _conv_weight_gradient(g: _Graph, node: torch.fx.Node) -> Value:
    """`orttrainer::conv_weight_gradient(x, g, kernel, stride, padding, dilation)` (gradient/conv_ops.py) as the nodes
    its decomposition `weight_gradient_per_offset` translates to: x padded (Pad), g as [N, Y, C_g] (Reshape,
    Transpose); per kernel position j, x sliced from j·d with step s along each spatial dim (a Slice per dim), as
    [N, C_x, Y] (Reshape), times g (MatMul); the products stacked (a Concat of two or more, Reshape to
    [positions, N, C_x, C_g]), summed over the batch (ReduceSum) and laid out as the weight [C_g, C_x, *kernel]
    (Reshape, Transpose). A 1-d convolution's values have those shapes already: no Reshape but the stacking one."""
    x, grad = node.args[:2]
    kernel, stride, padding, dilation = (list(v) for v in node.args[2:6])  # type: ignore[arg-type]
    x_meta, g_meta, out = g.meta(x), g.meta(grad), _meta(node)  # type: ignore[arg-type]
    n, batch, channels_x, channels_g = len(kernel), x_meta.shape[0], x_meta.shape[1], g_meta.shape[1]
    spatial = list(g_meta.shape[2:])
    padded = g.tensor(x)
    if any(padding):
        pads = [0, 0, *padding, 0, 0, *padding]
        padded = g.one("Pad", [padded, g.ints(pads), g.scalar(0.0, x_meta.dtype)], mode="constant")

    def flat(value: Value, channels: int) -> Value:  # [N, C, *spatial] as [N, C, Y]: a 1-d one is that already
        return value if n == 1 else g.one("Reshape", [value, g.ints([batch, channels, -1])])

    gt = g.one("Transpose", [flat(g.tensor(grad), channels_g)], perm=[0, 2, 1])
    products = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        window = padded
        for i, j in enumerate(offset):
            start = j * dilation[i]
            end = start + (spatial[i] - 1) * stride[i] + 1
            window = g.one("Slice", [window, g.ints([start]), g.ints([end]), g.ints([2 + i]), g.ints([stride[i]])])
        products.append(g.one("MatMul", [flat(window, channels_x), gt]))
    stacked_shape = g.ints([len(products), batch, channels_x, channels_g])
    joined = products[0] if len(products) == 1 else g.one("Concat", products, axis=0)
    stacked = g.one("Reshape", [joined, stacked_shape])
    summed = g.one("ReduceSum", [stacked, g.ints([1])], keepdims=0)
    weight = summed if n == 1 else g.one("Reshape", [summed, g.ints([*kernel, channels_x, channels_g])])
    if list(out.shape) != [channels_g, channels_x, *kernel]:
        raise UntranslatableGraph(f"{node.name}: weight gradient of shape {tuple(out.shape)}")
    return g.one("Transpose", [weight], perm=[n + 1, n, *range(n)])


def _after(g: _Graph, node: torch.fx.Node) -> Value:
    """`orttrainer::after(x, dep)`: `x`, computed only once `dep` is, as `Squeeze(Unsqueeze(x, [0]), [0] + z)` with
    `z` an int64 zero read from `dep`'s first element: the gate torch.onnx's translation writes
    (gradient/torch_private/custom_ops.py says why it copies nothing and no optimiser folds it)."""
    x, dep = node.args
    flat = g.one("Reshape", [g.tensor(dep), g.ints([-1])])
    first = g.one("Slice", [flat, g.ints([0]), g.ints([1])])
    number = g.one("Cast", [first], to=TensorProto.FLOAT)  # Greater takes numbers only (dep may be bool)
    zero = g.one("ReduceSum", [g.one("Cast", [g.one("Greater", [number, number])], to=TensorProto.INT64)], keepdims=0)
    axis = g.ints([0])
    return g.one("Squeeze", [g.one("Unsqueeze", [g.tensor(x), axis]), g.one("Add", [axis, zero])])


def _activation_mark(g: _Graph, node: torch.fx.Node) -> Value:
    """`orttrainer::activation_mark(x, name, backward)`: the marker node `graph/statistics.py` reads
    (`orttrainer.debug::ActivationMark`, attributes `activation` and `direction`)."""
    x, name, backward = node.args
    direction = "backward" if backward else "forward"
    marked = g.one(MARK_OP, [g.tensor(x)], domain=MARK_DOMAIN, activation=name, direction=direction)
    g.stated_types[marked] = _meta(node)  # the statistics report the activation's dtype (float16 under mixed precision)
    return marked


def _complex_translations() -> dict[Any, Translation]:
    """The translations of the ops that read or make complex values: imported when a graph has one."""
    from .aten_onnx_complex import TRANSLATIONS

    return TRANSLATIONS


def _custom_op_name(target: Any) -> str | None:
    """An op's qualified name ("orttrainer::lstm_recurrence"): orttrainer's own ops are translated by name, so that
    importing the translation does not register them (gradient/recurrent_layers.recurrent_ops)."""
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else None


_RANDOM_DRAWS = (aten.rand.default, aten.randn.default, aten.rand_like.default, aten.randn_like.default)
_RANDOM = {
    aten.native_dropout.default,
    aten.bernoulli.p,
    aten.exponential.default,
    aten.uniform.default,
    aten.randint.default,
    aten.randint.low,
    *_RANDOM_DRAWS,
}
_UNSPECIFIED = {aten.empty.memory_format, aten.empty_like.default}  # not folded: their values are whatever memory held

_VIEWS = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.flatten.using_ints,
    torch.ops.prims.squeeze.default,
)

_FILLS = (
    aten.full.default,
    aten.full_like.default,
    aten.zeros.default,
    aten.zeros_like.default,
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.ones.default,
    aten.ones_like.default,
    aten.scalar_tensor.default,
)

_TRANSLATIONS: dict[Any, Translation] = {
    **{op: _reshape for op in _VIEWS},
    **{op: _same for op in (aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default)},
    aten._to_copy.default: _to_copy,
    aten.permute.default: _permute,
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.expand.default: _expand,
    aten.repeat.default: _repeat,
    aten.select.int: _select,
    aten.slice.Tensor: _slice,
    aten.cat.default: _cat,
    aten.constant_pad_nd.default: _constant_pad,
    aten.slice_scatter.default: _slice_scatter,
    aten.as_strided.default: _as_strided,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.add.Tensor: _with_alpha("Add"),
    aten.add.Scalar: _with_alpha("Add"),
    aten.sub.Tensor: _with_alpha("Sub"),
    aten.sub.Scalar: _with_alpha("Sub"),
    aten.rsub.Scalar: _rsub,
    aten.rsub.Tensor: _rsub,
    aten.mul.Tensor: _elementwise("Mul"),
    aten.mul.Scalar: _elementwise("Mul"),
    aten.div.Tensor: _elementwise("Div", "float"),
    aten.div.Scalar: _elementwise("Div", "float"),
    aten.div.Tensor_mode: _div_mode,
    aten.div.Scalar_mode: _div_mode,
    aten.maximum.default: _elementwise("Max"),
    aten.minimum.default: _elementwise("Min"),
    aten.eq.Tensor: _elementwise("Equal"),
    aten.eq.Scalar: _elementwise("Equal"),
    aten.ne.Tensor: _not_equal,
    aten.ne.Scalar: _not_equal,
    aten.lt.Tensor: _elementwise("Less"),
    aten.lt.Scalar: _elementwise("Less"),
    aten.le.Tensor: _elementwise("LessOrEqual"),
    aten.le.Scalar: _elementwise("LessOrEqual"),
    aten.gt.Tensor: _elementwise("Greater"),
    aten.gt.Scalar: _elementwise("Greater"),
    aten.ge.Tensor: _elementwise("GreaterOrEqual"),
    aten.ge.Scalar: _elementwise("GreaterOrEqual"),
    aten.neg.default: _unary("Neg", floating=False),
    aten.abs.default: _unary("Abs", floating=False),
    aten.exp.default: _unary("Exp"),
    aten.log.default: _unary("Log"),
    aten.sqrt.default: _unary("Sqrt"),
    aten.reciprocal.default: _unary("Reciprocal"),
    aten.erf.default: _unary("Erf"),
    aten.tanh.default: _unary("Tanh"),
    aten.sigmoid.default: _unary("Sigmoid"),
    aten.sin.default: _unary("Sin"),
    aten.cos.default: _unary("Cos"),
    aten.relu.default: _unary("Relu", floating=False),
    aten.sign.default: _unary("Sign", floating=False),
    aten.tan.default: _unary("Tan"),
    aten.asin.default: _unary("Asin"),
    aten.acos.default: _unary("Acos"),
    aten.atan.default: _unary("Atan"),
    aten.sinh.default: _unary("Sinh"),
    aten.cosh.default: _unary("Cosh"),
    aten.asinh.default: _unary("Asinh"),
    aten.acosh.default: _unary("Acosh"),
    aten.atanh.default: _unary("Atanh"),
    aten.floor.default: _rounding("Floor"),
    aten.ceil.default: _rounding("Ceil"),
    aten.round.default: _rounding("Round"),
    aten.round.decimals: _rounding("Round"),
    aten.trunc.default: _rounding("Trunc"),
    aten.remainder.Tensor: _remainder,
    aten.remainder.Scalar: _remainder,
    aten.fmod.Tensor: _remainder,
    aten.fmod.Scalar: _remainder,
    aten.flip.default: _flip,
    aten.cumsum.default: _cumsum,
    aten.rsqrt.default: _rsqrt,
    aten.log1p.default: _log1p,
    aten.expm1.default: _expm1,
    aten.isnan.default: _isnan,
    aten.isinf.default: _isinf,
    aten.log2.default: _log_base(2.0),
    aten.log10.default: _log_base(10.0),
    aten.elu.default: _elu,
    aten.leaky_relu.default: _leaky_relu,
    aten.linalg_vector_norm.default: _vector_norm,
    aten.logical_not.default: _logical("Not"),
    aten.bitwise_not.default: _bitwise("Not", "BitwiseNot"),
    aten.logical_and.default: _logical("And"),
    aten.bitwise_and.Tensor: _bitwise("And", "BitwiseAnd"),
    aten.bitwise_and.Scalar: _bitwise("And", "BitwiseAnd"),
    aten.bitwise_or.Scalar: _bitwise("Or", "BitwiseOr"),
    aten.bitwise_xor.Scalar: _bitwise("Xor", "BitwiseXor"),
    aten.logical_or.default: _logical("Or"),
    aten.bitwise_or.Tensor: _bitwise("Or", "BitwiseOr"),
    aten.logical_xor.default: _logical("Xor"),
    aten.bitwise_xor.Tensor: _bitwise("Xor", "BitwiseXor"),
    aten.where.self: _where,
    aten.masked_fill.Scalar: _masked_fill,
    aten.clamp.default: _clamp,
    aten.clamp_min.default: _clamp,
    aten.clamp_max.default: _clamp,
    aten.clamp.Tensor: _clamp,
    aten.hardtanh.default: _hardtanh,
    aten.pow.Tensor_Scalar: _pow,
    aten.pow.Tensor_Tensor: _pow,
    aten.pow.Scalar: _pow,
    aten.gelu.default: _gelu,
    aten.sum.dim_IntList: _reduce("ReduceSum"),
    aten.sum.default: _reduce("ReduceSum"),
    aten.mean.dim: _reduce("ReduceMean"),
    aten.logsumexp.default: _reduce("ReduceLogSumExp"),
    aten.mean.default: _reduce("ReduceMean"),
    aten.var_mean.correction: _variance("var_mean"),
    aten.var.correction: _variance("var"),
    aten.std.correction: _variance("std"),
    aten.amax.default: _reduce("ReduceMax"),
    aten.max.default: _reduce("ReduceMax"),
    aten.min.default: _reduce("ReduceMin"),
    aten.max.dim: _extreme("Max"),
    aten.min.dim: _extreme("Min"),
    aten.argmax.default: _arg_extreme("Max"),
    aten.argmin.default: _arg_extreme("Min"),
    aten.topk.default: _topk,
    aten.sort.default: _sort,
    aten.sort.stable: _sort,
    aten.diagonal.default: _diagonal,
    aten.unfold.default: _unfold,
    aten.unfold_backward.default: _unfold_backward,
    aten.amin.default: _reduce("ReduceMin"),
    aten.any.dim: _reduce("any"),
    aten.any.dims: _reduce("any"),
    aten.any.default: _reduce("any"),
    aten.mm.default: _mm,
    aten.bmm.default: _mm,
    aten.addmm.default: _addmm,
    aten.convolution.default: _convolution,
    aten.native_layer_norm.default: _layer_norm,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_inference,
    aten._native_batch_norm_legit.no_stats: _batch_norm_batch_statistics,
    aten.native_group_norm.default: _group_norm,
    aten.avg_pool2d.default: _avg_pool(2),
    aten.avg_pool3d.default: _avg_pool(3),
    aten.max_pool2d_with_indices.default: _max_pool(2),
    aten.max_pool3d_with_indices.default: _max_pool(3),
    aten._softmax.default: _softmax("Softmax"),
    aten._log_softmax.default: _softmax("LogSoftmax"),
    aten.embedding.default: _embedding,
    aten.gather.default: _gather,
    aten.index.Tensor: _index,
    aten.index_select.default: _index_select,
    aten.scatter.value: _scatter,
    aten.scatter.src: _scatter,
    aten.scatter_add.default: _scatter,
    aten.scatter_reduce.two: _scatter_reduce,
    aten.index_put.default: _index_put,
    aten.native_dropout.default: _dropout,
    **{op: _random for op in _RANDOM_DRAWS},
    aten.bernoulli.p: _bernoulli,
    aten.randint.default: _randint,
    aten.randint.low: _randint,
    aten.exponential.default: _exponential,
    aten.uniform.default: _uniform,
    **{op: _fill for op in _FILLS},
    # creation ops with static arguments: always folded (`_fold`); untranslatable otherwise
    **{op: (lambda g, node: None) for op in (aten.arange.default, aten.arange.start, aten.arange.start_step)},
}
_CUSTOM_TRANSLATIONS: dict[str | None, Translation] = {
    "orttrainer::conv_weight_gradient": _conv_weight_gradient,
    "orttrainer::after": _after,
    "orttrainer::activation_mark": _activation_mark,
    "orttrainer::lstm_recurrence": _lstm_recurrence,
    "orttrainer::lstm_recurrence_backward": _lstm_recurrence_backward,
    "orttrainer::gru_recurrence": _gru_recurrence,
    "orttrainer::gru_recurrence_backward": _gru_recurrence_backward,
}
