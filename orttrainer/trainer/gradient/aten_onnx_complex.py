"""Complex values in the direct translation (gradient/aten_onnx.py), as pairs of reals.

Rule: a complex tensor of shape S is written as the real tensor of shape S + [2] that `torch.view_as_real` gives
(the real part at index 0 of the last axis, the imaginary part at 1), so `view_as_complex` and `view_as_real` are
that value itself. Each op on complex values computes on that form what PyTorch computes:
- `polar(r, θ)` is (r·cos θ, r·sin θ), `complex(a, b)` is (a, b), a conjugate (`_conj`, `conj_physical`) is the pair
  times (1, -1);
- products, quotients and reciprocals follow complex arithmetic ((a + bi)(c + di) = (ac - bd) + (ad + bc)i), a real
  factor multiplies both parts, a sum or difference with a real adds to the real part only;
- views, `expand`, `permute`, `select`, `slice`, `cat` and reductions act on the same dims of the pair form, the
  pair's axis kept last;
- `abs` is √(a² + b²), `real` and `imag` the part;
- a complex constant is written in its pair form.
Any other op that reads or makes a complex value raises `UntranslatableGraph`, as does a complex graph input or output
(ONNX Runtime's kernels take no complex tensors): the graph then goes through torch.onnx.

Why: rotary position embeddings written with complex numbers (`torch.polar`, `view_as_complex`; LLaMA's reference
code, transformers' Llama 4 and DeepSeek-V2) trace to a few complex ops in the forward and their conjugate products
in the backward; torch.onnx's translation has no complex form of most ops (docs/engine.md §35).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .aten_onnx import (
    _FILLS,
    _VIEWS,
    Translation,
    UntranslatableGraph,
    Value,
    _axis,
    _Graph,
    _meta,
    _np,
    _same_shape_view,
    _select,
    _slice,
)

aten = torch.ops.aten


# -- the pair form ------------------------------------------------------------------------------------------------
def _parts(g: _Graph, pair: Value) -> tuple[Value, Value]:
    """The real and imaginary parts, each with a last axis of size 1 (so they broadcast as the pair does)."""
    real, imag = g.emit("Split", [pair, g.ints([1, 1])], outputs=2, axis=-1)
    return real, imag


def _joined(g: _Graph, real: Value, imag: Value) -> Value:
    return g.one("Concat", [real, imag], axis=-1)


def _last(g: _Graph, value: Value) -> Value:
    """A real tensor with a last axis of size 1 added: it then broadcasts against a pair as a factor of both parts."""
    return g.one("Unsqueeze", [value, g.ints([-1])])


def _is_complex_operand(g: _Graph, arg: Any) -> bool:
    return isinstance(arg, complex) or g.is_complex(arg)


def _pair(g: _Graph, arg: Any, real: torch.dtype) -> Value:
    """`arg` (a complex or real tensor, or a number) in pair form, its parts of dtype `real`."""
    if g.is_complex(arg):
        return g.cast(g.tensor(arg), g.meta(arg).dtype.to_real(), real)
    if isinstance(arg, torch.fx.Node):
        value = _last(g, g.typed(arg, real))
        rank = g.meta(arg).dim() + 1
        return g.one("Pad", [value, g.ints([0] * rank + [0] * (rank - 1) + [1])])  # imaginary part 0
    if isinstance(arg, (bool, int, float, complex)):
        number = complex(arg)
        return g.const(np.asarray([number.real, number.imag], dtype=_np(real)))
    raise UntranslatableGraph(f"argument {arg!r} is neither a tensor nor a number")


def _real_of(node: torch.fx.Node) -> torch.dtype:
    """The dtype of the parts of `node`'s complex result."""
    return _meta(node).dtype.to_real()


# -- translations -------------------------------------------------------------------------------------------------
def _itself(g: _Graph, node: torch.fx.Node) -> Value:
    """view_as_complex, view_as_real, and the copies: the pair form is the value."""
    return g.tensor(node.args[0])


def _polar(g: _Graph, node: torch.fx.Node) -> Value:
    magnitude, angle = node.args[:2]
    real = _real_of(node)
    r, theta = g.typed(magnitude, real), g.typed(angle, real)
    return _joined(
        g, _last(g, g.one("Mul", [r, g.one("Cos", [theta])])), _last(g, g.one("Mul", [r, g.one("Sin", [theta])]))
    )


def _complex(g: _Graph, node: torch.fx.Node) -> Value:
    shape = g.ints(list(_meta(node).shape))
    real = _real_of(node)
    a, b = (g.one("Expand", [g.typed(part, real), shape]) for part in node.args[:2])
    return _joined(g, _last(g, a), _last(g, b))


def _conjugate(g: _Graph, node: torch.fx.Node) -> Value:
    real = _real_of(node)
    return g.one("Mul", [g.tensor(node.args[0]), g.const(np.asarray([1, -1], dtype=_np(real)))])


def _to_copy(g: _Graph, node: torch.fx.Node) -> Value:
    source = node.args[0]
    out = _meta(node).dtype
    if not out.is_complex:  # PyTorch keeps the real part (with a warning that the imaginary part is discarded)
        real, _ = _parts(g, g.tensor(source))
        part = g.one("Squeeze", [real, g.ints([-1])])
        return g.cast(part, g.meta(source).dtype.to_real(), out)  # type: ignore[arg-type]
    return _pair(g, source, out.to_real())


def _operands(node: torch.fx.Node) -> tuple[Any, Any] | None:
    """A binary op's two operands when each is a tensor or a number and no keyword is given, else None."""
    a, b = node.args[:2]
    if node.kwargs or not all(isinstance(x, (torch.fx.Node, bool, int, float, complex)) for x in (a, b)):
        return None
    return a, b


def _real_operand(g: _Graph, arg: Any, real: torch.dtype) -> Value:
    """A real tensor or number, of dtype `real`, broadcasting against both parts of a pair (a trailing dim of 1)."""
    return _last(g, g.typed(arg, real)) if isinstance(arg, torch.fx.Node) else g.scalar(arg, real)


def _multiply(g: _Graph, node: torch.fx.Node) -> Value:
    operands = _operands(node)
    if operands is None:
        return None  # type: ignore[return-value]
    a, b = operands
    real = _real_of(node)
    if not _is_complex_operand(g, a):
        a, b = b, a  # a is complex
    if not _is_complex_operand(g, b):  # a real factor multiplies both parts
        return g.one("Mul", [_pair(g, a, real), _real_operand(g, b, real)])
    (ar, ai), (br, bi) = _parts(g, _pair(g, a, real)), _parts(g, _pair(g, b, real))
    real_part = g.one("Sub", [g.one("Mul", [ar, br]), g.one("Mul", [ai, bi])])
    imag_part = g.one("Add", [g.one("Mul", [ar, bi]), g.one("Mul", [ai, br])])
    return _joined(g, real_part, imag_part)


def _divide(g: _Graph, node: torch.fx.Node) -> Value:
    operands = _operands(node)
    if operands is None:
        return None  # type: ignore[return-value]
    a, b = operands
    real = _real_of(node)
    if not _is_complex_operand(g, b):  # a real divisor divides both parts
        return g.one("Div", [_pair(g, a, real), _real_operand(g, b, real)])
    (ar, ai), (br, bi) = _parts(g, _pair(g, a, real)), _parts(g, _pair(g, b, real))
    norm = g.one("Add", [g.one("Mul", [br, br]), g.one("Mul", [bi, bi])])
    real_part = g.one("Add", [g.one("Mul", [ar, br]), g.one("Mul", [ai, bi])])
    imag_part = g.one("Sub", [g.one("Mul", [ai, br]), g.one("Mul", [ar, bi])])
    return _joined(g, g.one("Div", [real_part, norm]), g.one("Div", [imag_part, norm]))


def _reciprocal(g: _Graph, node: torch.fx.Node) -> Value:
    """1 / (a + bi) = (a - bi) / (a² + b²)."""
    pair = g.tensor(node.args[0])
    norm = g.one("ReduceSum", [g.one("Mul", [pair, pair]), g.ints([-1])], keepdims=1)
    conjugate = g.one("Mul", [pair, g.const(np.asarray([1, -1], dtype=_np(_real_of(node))))])
    return g.one("Div", [conjugate, norm])


def _with_alpha(op: str) -> Translation:
    """add/sub: `a op alpha * b`, a real operand (or number) being the complex number with imaginary part 0."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        a, b = node.args[:2]
        alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
        if not isinstance(alpha, (bool, int, float)):
            return None  # type: ignore[return-value]
        real = _real_of(node)
        right = _pair(g, b, real)
        if alpha != 1:
            right = g.one("Mul", [right, g.scalar(alpha, real)])
        return g.one(op, [_pair(g, a, real), right])

    return translate_node


def _negate(g: _Graph, node: torch.fx.Node) -> Value:
    return g.one("Neg", [g.tensor(node.args[0])])


def _view(g: _Graph, node: torch.fx.Node) -> Value:
    if _same_shape_view(node):
        return g.tensor(node.args[0])
    shape = [*_meta(node).shape, 2]
    return g.one("Reshape", [g.tensor(node.args[0]), g.ints(shape)], **({"allowzero": 1} if 0 in shape else {}))


def _expand(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    shape = list(_meta(node).shape)
    if list(g.meta(x).shape) == shape:  # type: ignore[arg-type]
        return g.tensor(x)
    return g.one("Expand", [g.tensor(x), g.ints([*shape, 2])])


def _permute(g: _Graph, node: torch.fx.Node) -> Value:
    x = node.args[0]
    rank = g.meta(x).dim()  # type: ignore[arg-type]
    if node.target == aten.permute.default:
        perm = [_axis(d, rank) for d in node.args[1]]  # type: ignore[union-attr, arg-type]
    else:  # transpose, t
        perm = list(range(rank))
        a, b = (0, 1 if rank == 2 else 0) if node.target == aten.t.default else node.args[1:3]
        a, b = _axis(a, rank), _axis(b, rank)  # type: ignore[arg-type]
        perm[a], perm[b] = perm[b], perm[a]
    if perm == list(range(rank)):
        return g.tensor(x)
    return g.one("Transpose", [g.tensor(x)], perm=[*perm, rank])


def _cat(g: _Graph, node: torch.fx.Node) -> Value:
    tensors = list(node.args[0])  # type: ignore[arg-type]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    out = _meta(node)
    names = [_pair(g, t, out.dtype.to_real()) for t in tensors]
    return names[0] if len(names) == 1 else g.one("Concat", names, axis=_axis(dim, out.dim()))  # type: ignore[arg-type]


def _slice_scatter(g: _Graph, node: torch.fx.Node) -> Value:
    """`base` with `src` written into `base[start:end:step]` along `dim`: the parts of base around the slice
    concatenated with `src` (step 1), else ScatterElements of `src` at start, start + step, ..."""
    base, src = node.args[:2]
    dim, start, end, step = (list(node.args[2:]) + [0, None, None, 1][len(node.args) - 2 :])[:4]
    if node.kwargs:
        return None  # type: ignore[return-value]
    out = _meta(node)
    real = out.dtype.to_real()
    axis = _axis(dim, out.dim())  # type: ignore[arg-type]
    size = out.shape[axis]
    s, e, st = slice(start, end, step).indices(size)
    whole, part = _pair(g, base, real), _pair(g, src, real)
    if st != 1:
        shape = [*g.meta(src).shape, 2]  # type: ignore[arg-type]
        positions = np.arange(s, e, st, dtype=np.int64).reshape([-1 if d == axis else 1 for d in range(len(shape))])
        return g.one("ScatterElements", [whole, g.one("Expand", [g.const(positions), g.ints(shape)]), part], axis=axis)
    parts = [g.one("Slice", [whole, g.ints([0]), g.ints([s]), g.ints([axis])])] if s > 0 else []
    parts.append(part)
    if e < size:
        parts.append(g.one("Slice", [whole, g.ints([e]), g.ints([size]), g.ints([axis])]))
    return parts[0] if len(parts) == 1 else g.one("Concat", parts, axis=axis)


def _where(g: _Graph, node: torch.fx.Node) -> Value:
    cond, a, b = node.args
    if not isinstance(cond, torch.fx.Node) or g.meta(cond).dtype != torch.bool:
        return None  # type: ignore[return-value]
    real = _real_of(node)
    return g.one("Where", [_last(g, g.tensor(cond)), _pair(g, a, real), _pair(g, b, real)])


def _fill(g: _Graph, node: torch.fx.Node) -> Value:
    """full/zeros/ones/empty/scalar_tensor/*_like of a complex dtype (small ones are folded before): the pair of the
    value expanded to the shape (empty's: zeros, as aten_onnx's)."""
    out = _meta(node)
    if node.target in (aten.full.default, aten.full_like.default):
        value = node.args[1]
    elif node.target == aten.scalar_tensor.default:
        value = node.args[0]
    else:
        value = 1 if node.target in (aten.ones.default, aten.ones_like.default) else 0
    if not isinstance(value, (bool, int, float, complex)):
        return None  # type: ignore[return-value]
    return g.one("Expand", [_pair(g, value, out.dtype.to_real()), g.ints([*out.shape, 2])])


def _reduce(op: str) -> Translation:
    """sum/mean over dims of a complex value: the same reduction of both parts."""

    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        x = node.args[0]
        rank = g.meta(x).dim()  # type: ignore[arg-type]
        dims = node.args[1] if len(node.args) > 1 else None
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        if node.kwargs.get("dtype") is not None:
            return None  # type: ignore[return-value]
        axes = list(range(rank)) if not dims else [_axis(d, rank) for d in dims]  # type: ignore[union-attr, arg-type]
        if not axes:
            return g.tensor(x)
        return g.one(op, [g.tensor(x), g.ints(axes)], keepdims=int(keepdim))

    return translate_node


def _magnitude(g: _Graph, node: torch.fx.Node) -> Value:
    """abs: √(a² + b²), a real result."""
    pair = g.tensor(node.args[0])
    return g.one("Sqrt", [g.one("ReduceSum", [g.one("Mul", [pair, pair]), g.ints([-1])], keepdims=0)])


def _part(index: int) -> Translation:
    def translate_node(g: _Graph, node: torch.fx.Node) -> Value:
        return g.one("Gather", [g.tensor(node.args[0]), g.const(np.asarray(index, dtype=np.int64))], axis=-1)

    return translate_node


TRANSLATIONS: dict[Any, Translation] = {
    **{op: _view for op in _VIEWS},
    **{
        op: _itself
        for op in (
            aten.view_as_complex.default,
            aten.view_as_real.default,
            aten.clone.default,
            aten.alias.default,
            aten.detach.default,
            aten.lift_fresh_copy.default,
            aten.resolve_conj.default,
        )
    },
    aten.polar.default: _polar,
    aten.complex.default: _complex,
    aten._conj.default: _conjugate,
    aten.conj_physical.default: _conjugate,
    aten._to_copy.default: _to_copy,
    aten.mul.Tensor: _multiply,
    aten.mul.Scalar: _multiply,
    aten.div.Tensor: _divide,
    aten.div.Scalar: _divide,
    aten.add.Tensor: _with_alpha("Add"),
    aten.add.Scalar: _with_alpha("Add"),
    aten.sub.Tensor: _with_alpha("Sub"),
    aten.sub.Scalar: _with_alpha("Sub"),
    aten.neg.default: _negate,
    aten.reciprocal.default: _reciprocal,
    aten.expand.default: _expand,
    aten.permute.default: _permute,
    aten.transpose.int: _permute,
    aten.t.default: _permute,
    aten.select.int: _select,  # the real translations: they index an axis before the pair's
    aten.slice.Tensor: _slice,
    aten.slice_scatter.default: _slice_scatter,
    aten.cat.default: _cat,
    aten.where.self: _where,
    **{op: _fill for op in _FILLS},
    aten.sum.dim_IntList: _reduce("ReduceSum"),
    aten.sum.default: _reduce("ReduceSum"),
    aten.mean.dim: _reduce("ReduceMean"),
    aten.mean.default: _reduce("ReduceMean"),
    aten.abs.default: _magnitude,
    aten.real.default: _part(0),
    aten.imag.default: _part(1),
}
