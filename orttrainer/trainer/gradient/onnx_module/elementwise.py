"""OnnxModule's torch ops for arithmetic, activations, products, softmax, reductions and variadic ops, each written
from the ONNX operator specification (attribute defaults and the opset where an attribute became an input).

Rules shared by all: binary ops broadcast numpy-style (as ONNX does since opset 7); integer Div truncates toward
zero (ONNX Runtime's C++ division); an op's result keeps the element type ONNX gives it (Pow: the base's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch.nn import functional as F

from .base import MICROSOFT, Call, Value, axes_of, axis_of, torch_op


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[Call, Value, Value], torch.Tensor]:
    def run(call: Call, a: Value, b: Value) -> torch.Tensor:
        x, y = call.tensors(a, b)
        return fn(x, y)

    return run


def _div(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.dtype.is_floating_point:
        return x / y
    return torch.div(x, y, rounding_mode="trunc")


_BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Add": torch.add,
    "Sub": torch.sub,
    "Mul": torch.mul,
    "Div": _div,
    "Equal": torch.eq,
    "Less": torch.lt,
    "LessOrEqual": torch.le,
    "Greater": torch.gt,
    "GreaterOrEqual": torch.ge,
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
}
for _name, _fn in _BINARY.items():
    torch_op(_name)(_binary(_fn))


@torch_op("Pow")
def pow_(call: Call, a: Value, b: Value) -> torch.Tensor:
    x, y = call.tensors(a, b)
    return torch.pow(x, y).to(x.dtype)  # ONNX: the result has the base's type


@torch_op("Mod")
def mod(call: Call, a: Value, b: Value) -> torch.Tensor:
    """fmod=0 (default): the remainder takes the divisor's sign (integers only); fmod=1: C fmod."""
    x, y = call.tensors(a, b)
    return torch.fmod(x, y) if call.attr("fmod", 0) else torch.remainder(x, y)


def _unary(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Call, Value], torch.Tensor]:
    def run(call: Call, a: Value) -> torch.Tensor:
        return fn(call.tensor(a))

    return run


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Neg": torch.neg,
    "Sqrt": torch.sqrt,
    "Exp": torch.exp,
    "Log": torch.log,
    "Abs": torch.abs,
    "Erf": torch.erf,
    "Tanh": torch.tanh,
    "Sigmoid": torch.sigmoid,
    "Relu": torch.relu,
    "Reciprocal": torch.reciprocal,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Sign": torch.sign,
    "Not": torch.logical_not,
    "Softplus": F.softplus,
    "Softsign": F.softsign,
}
for _name, _one in _UNARY.items():
    torch_op(_name)(_unary(_one))


@torch_op("LeakyRelu")
def leaky_relu(call: Call, x: Value) -> torch.Tensor:
    return F.leaky_relu(call.tensor(x), float(call.attr("alpha", 0.01)))


@torch_op("Elu")
def elu(call: Call, x: Value) -> torch.Tensor:
    return F.elu(call.tensor(x), float(call.attr("alpha", 1.0)))


@torch_op("HardSigmoid")
def hard_sigmoid(call: Call, x: Value) -> torch.Tensor:
    alpha, beta = float(call.attr("alpha", 0.2)), float(call.attr("beta", 0.5))
    return torch.clamp(alpha * call.tensor(x) + beta, 0.0, 1.0)


@torch_op("Gelu")
def gelu(call: Call, x: Value) -> torch.Tensor:
    """Opset 20: approximate 'none' (erf, default) or 'tanh'."""
    return F.gelu(call.tensor(x), approximate=str(call.attr("approximate", "none")))


@torch_op("Gelu", domain=MICROSOFT)
def ms_gelu(call: Call, x: Value) -> torch.Tensor:
    return F.gelu(call.tensor(x))


@torch_op("BiasGelu", domain=MICROSOFT)
def ms_bias_gelu(call: Call, x: Value, bias: Value) -> torch.Tensor:
    return F.gelu(call.tensor(x) + call.tensor(bias))


@torch_op("FastGelu", domain=MICROSOFT)
def ms_fast_gelu(call: Call, x: Value, bias: Value | None = None) -> torch.Tensor:
    """The tanh approximation of GELU of `x (+ bias)`."""
    value = call.tensor(x) if bias is None else call.tensor(x) + call.tensor(bias)
    return F.gelu(value, approximate="tanh")


def _softmax(call: Call, x: Value, log: bool) -> torch.Tensor:
    """Opset >= 13: along `axis` (default -1). Before: on the input coerced to 2-D at `axis` (default 1), i.e.
    over all dimensions from `axis` on."""
    t = call.tensor(x)
    fn = F.log_softmax if log else F.softmax
    if call.opset >= 13:
        return fn(t, dim=axis_of(int(call.attr("axis", -1)), t.dim()))
    axis = axis_of(int(call.attr("axis", 1)), t.dim())
    flat = t.reshape(math.prod(t.shape[:axis]), -1) if t.dim() else t.reshape(1, 1)
    return fn(flat, dim=1).reshape(t.shape)


@torch_op("Softmax")
def softmax(call: Call, x: Value) -> torch.Tensor:
    return _softmax(call, x, log=False)


@torch_op("LogSoftmax")
def log_softmax(call: Call, x: Value) -> torch.Tensor:
    return _softmax(call, x, log=True)


@torch_op("MatMul")
def matmul(call: Call, a: Value, b: Value) -> torch.Tensor:
    return torch.matmul(*call.tensors(a, b))


@torch_op("Gemm")
def gemm(call: Call, a: Value, b: Value, c: Value | None = None) -> torch.Tensor:
    """Y = alpha * A' @ B' + beta * C; A' = A^T when transA, B' = B^T when transB; C (optional) broadcasts."""
    x, w = call.tensors(a, b)
    x = x.t() if call.attr("transA", 0) else x
    w = w.t() if call.attr("transB", 0) else w
    alpha, beta = float(call.attr("alpha", 1.0)), float(call.attr("beta", 1.0))
    y = x @ w if alpha == 1.0 else alpha * (x @ w)
    if c is None:
        return y
    bias = call.tensor(c)
    return y + (bias if beta == 1.0 else beta * bias)


# Reductions: the opset from which `axes` is an input instead of an attribute.
_AXES_INPUT_SINCE = {"ReduceSum": 13}
_REDUCTIONS: dict[str, Callable[[torch.Tensor, tuple[int, ...], bool], torch.Tensor]] = {
    "ReduceSum": lambda t, d, k: torch.sum(t, dim=d, keepdim=k),
    "ReduceMean": lambda t, d, k: torch.mean(t, dim=d, keepdim=k),
    "ReduceMax": lambda t, d, k: torch.amax(t, dim=d, keepdim=k),
    "ReduceMin": lambda t, d, k: torch.amin(t, dim=d, keepdim=k),
    "ReduceSumSquare": lambda t, d, k: torch.sum(t * t, dim=d, keepdim=k),
    "ReduceL1": lambda t, d, k: torch.sum(torch.abs(t), dim=d, keepdim=k),
    "ReduceL2": lambda t, d, k: torch.sqrt(torch.sum(t * t, dim=d, keepdim=k)),
    "ReduceLogSum": lambda t, d, k: torch.log(torch.sum(t, dim=d, keepdim=k)),
    "ReduceLogSumExp": lambda t, d, k: torch.logsumexp(t, dim=d, keepdim=k),
    "ReduceProd": lambda t, d, k: _prod(t, d, k),
}


def _prod(t: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    for d in sorted(dims, reverse=True):  # torch.prod reduces one dimension at a time
        t = torch.prod(t, dim=d, keepdim=keepdim)
    return t


def reduction_axes(call: Call, axes: Value | None, rank: int) -> tuple[int, ...] | None:
    """The axes to reduce, or None for 'return the input' (empty axes with noop_with_empty_axes=1).

    `axes` is an attribute before opset 13 (ReduceSum) or 18 (the others), then an optional input; empty or
    absent axes reduce every dimension unless noop_with_empty_axes is set (an attribute of the input form)."""
    if call.opset >= _AXES_INPUT_SINCE.get(call.node.op_type, 18):
        listed = [] if axes is None else call.ints(axes, "axes")
        if not listed and call.attr("noop_with_empty_axes", 0):
            return None
    else:
        listed = list(call.attr("axes", []))
    return tuple(sorted(axes_of(listed, rank))) if listed else tuple(range(rank))


def _reduce(call: Call, x: Value, axes: Value | None = None) -> torch.Tensor:
    t = call.tensor(x)
    dims = reduction_axes(call, axes, t.dim())
    if dims is None or t.dim() == 0:
        return t
    return _REDUCTIONS[call.node.op_type](t, dims, bool(call.attr("keepdims", 1)))


for _name in _REDUCTIONS:
    torch_op(_name)(_reduce)


def _variadic(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(call: Call, *values: Value) -> torch.Tensor:
        return functools.reduce(fn, call.tensors(*values))

    return run


torch_op("Sum")(_variadic(torch.add))
torch_op("Max")(_variadic(torch.maximum))
torch_op("Min")(_variadic(torch.minimum))


@torch_op("Mean")
def mean(call: Call, *values: Value) -> torch.Tensor:
    return functools.reduce(torch.add, call.tensors(*values)) / len(values)


@torch_op("Clip")
def clip(call: Call, x: Value, low: Value | None = None, high: Value | None = None) -> torch.Tensor:
    """Opset >= 11: optional `min`/`max` inputs; before, attributes `min`/`max` (defaults: no bound)."""
    t = call.tensor(x)
    if call.opset < 11:
        lo, hi = call.attr("min"), call.attr("max")
        return torch.clamp(t, None if lo is None else float(lo), None if hi is None else float(hi))
    return torch.clamp(t, None if low is None else call.tensor(low), None if high is None else call.tensor(high))


@torch_op("Einsum")
def einsum(call: Call, *values: Value) -> torch.Tensor:
    return torch.einsum(str(call.attr("equation")), *call.tensors(*values))


@torch_op("CumSum")
def cumsum(call: Call, x: Value, axis: Value) -> torch.Tensor:
    """Along the static `axis`; `exclusive` leaves each element out of its own sum, `reverse` sums from the end."""
    t = call.tensor(x)
    dim = axis_of(call.ints(axis, "axis")[0], t.dim())
    reverse = bool(call.attr("reverse", 0))
    source = torch.flip(t, [dim]) if reverse else t
    total = torch.cumsum(source, dim=dim)
    if call.attr("exclusive", 0):
        total = total - source
    return torch.flip(total, [dim]) if reverse else total
