"""OnnxModule's element-wise ops: arithmetic, comparisons, logic and bit ops, unary math, activations, Clip, Where
and the variadic Sum/Mean/Max/Min, each written from the ONNX operator specification (attribute defaults and the
opset where an attribute became an input).

Rules shared by all: binary and variadic ops broadcast numpy-style (as ONNX does from opset 7); integer Div
truncates toward zero (ONNX Runtime's C++ division); an op's result keeps the element type ONNX gives it (Pow: the
base's); Round rounds halves to even; Max/Min propagate NaN.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn import functional as F

from .base import Call, NodeSpec, Value, torch_op


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[Call, Value, Value], torch.Tensor]:
    def run(call: Call, a: Value, b: Value) -> torch.Tensor:
        x, y = call.tensors(a, b)
        return fn(x, y)

    return run


def _div(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.dtype.is_floating_point:
        return x / y
    return torch.div(x, y, rounding_mode="trunc")


_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def _bitwise(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """A bitwise op on any integer type: torch lacks some of them for uint16/32/64, whose bits are computed in
    int64 (two's complement keeps them)."""

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.dtype in _WIDE_UNSIGNED:
            return fn(x.to(torch.int64), y.to(torch.int64)).to(x.dtype)
        return fn(x, y)

    return run


def _ordered(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """maximum/minimum on any type: torch lacks them for uint16/32/64, which are compared in int64 — uint64 with
    its top bit flipped, which keeps the unsigned order."""

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint64:
            top = torch.tensor(-(2**63), dtype=torch.int64, device=x.device)
            flipped = fn(x.view(torch.int64) ^ top, y.view(torch.int64) ^ top)
            return (flipped ^ top).view(torch.uint64)
        if x.dtype in _WIDE_UNSIGNED:
            return fn(x.to(torch.int64), y.to(torch.int64)).to(x.dtype)
        return fn(x, y)

    return run


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
    "BitwiseAnd": _bitwise(torch.bitwise_and),
    "BitwiseOr": _bitwise(torch.bitwise_or),
    "BitwiseXor": _bitwise(torch.bitwise_xor),
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
    if x.dtype in _WIDE_UNSIGNED:  # torch has no remainder for them; exact in int64 (uint64: below 2**63)
        return torch.remainder(x.to(torch.int64), y.to(torch.int64)).to(x.dtype)
    return torch.fmod(x, y) if call.attr("fmod", 0) else torch.remainder(x, y)


@torch_op("BitShift", check=lambda n: None if n.attr("direction") in ("LEFT", "RIGHT") else "direction must be set")
def bit_shift(call: Call, a: Value, b: Value) -> torch.Tensor:
    """Unsigned integers shifted LEFT or RIGHT by `b` bits (bits shifted out are lost)."""
    x, y = call.tensors(a, b)
    wide = x.to(torch.int64), y.to(torch.int64)
    if call.attr("direction") == "LEFT":
        bits = torch.iinfo(x.dtype).bits if x.dtype != torch.uint64 else 64
        shifted = torch.bitwise_left_shift(*wide)
        return (shifted & ((1 << bits) - 1) if bits < 64 else shifted).to(x.dtype)
    return torch.bitwise_right_shift(*wide).to(x.dtype) if x.dtype != torch.uint64 else _shift_right_u64(*wide)


def _shift_right_u64(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A logical right shift of uint64 bits held in int64 (an arithmetic shift would copy the sign bit)."""
    shifted = torch.bitwise_right_shift(x, y)
    mask = torch.where(y > 0, torch.bitwise_left_shift(torch.ones_like(y), 64 - y) - 1, torch.full_like(y, -1))
    return (shifted & mask).to(torch.uint64)


def _softplus(t: torch.Tensor) -> torch.Tensor:
    """log(exp(x) + 1), without torch's linear cut-off (threshold 20) so that the value is the formula's."""
    return torch.logaddexp(t, torch.zeros((), dtype=t.dtype, device=t.device))


def _unary(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Call, Value], torch.Tensor]:
    def run(call: Call, a: Value) -> torch.Tensor:
        return fn(call.tensor(a))

    return run


def _bitwise_not(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return torch.bitwise_not(t.to(torch.int64)).to(t.dtype)
    return torch.bitwise_not(t)


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
    "Round": torch.round,  # halves to even, as ONNX says
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Tan": torch.tan,
    "Asin": torch.asin,
    "Acos": torch.acos,
    "Atan": torch.atan,
    "Sinh": torch.sinh,
    "Cosh": torch.cosh,
    "Asinh": torch.asinh,
    "Acosh": torch.acosh,
    "Atanh": lambda t: 0.5 * (torch.log1p(t) - torch.log1p(-t)),  # torch.onnx cannot export atanh's backward
    "Sign": torch.sign,
    "Not": torch.logical_not,
    "BitwiseNot": _bitwise_not,
    "IsNaN": torch.isnan,
    "Softsign": F.softsign,
    "Mish": lambda t: t * torch.tanh(_softplus(t)),
}
for _name, _one in _UNARY.items():
    torch_op(_name)(_unary(_one))


@torch_op("Softplus")
def softplus(call: Call, x: Value) -> torch.Tensor:
    return _softplus(call.tensor(x))


@torch_op("IsInf")
def is_inf(call: Call, x: Value) -> torch.Tensor:
    """detect_negative, detect_positive (both 1 by default) choose which infinities count."""
    t = call.tensor(x)
    negative, positive = bool(call.attr("detect_negative", 1)), bool(call.attr("detect_positive", 1))
    if negative and positive:
        return torch.isinf(t)
    if positive:
        return torch.isposinf(t)
    return torch.isneginf(t) if negative else torch.zeros_like(t, dtype=torch.bool)


@torch_op("LeakyRelu")
def leaky_relu(call: Call, x: Value) -> torch.Tensor:
    return F.leaky_relu(call.tensor(x), float(call.attr("alpha", 0.01)))


@torch_op("PRelu")
def prelu(call: Call, x: Value, slope: Value) -> torch.Tensor:
    """x where x >= 0, slope * x elsewhere; slope broadcasts to x (unidirectionally)."""
    t, s = call.tensors(x, slope)
    return torch.where(t < 0, s * t, t)


@torch_op("Elu")
def elu(call: Call, x: Value) -> torch.Tensor:
    return F.elu(call.tensor(x), float(call.attr("alpha", 1.0)))


@torch_op("Celu")
def celu(call: Call, x: Value) -> torch.Tensor:
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1)), alpha 1 by default."""
    return F.celu(call.tensor(x), float(call.attr("alpha", 1.0)))


_SELU_ALPHA, _SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875


@torch_op("Selu")
def selu(call: Call, x: Value) -> torch.Tensor:
    """gamma * (alpha * exp(x) - alpha) for x <= 0, gamma * x for x > 0 (the spec's default alpha and gamma)."""
    t = call.tensor(x)
    alpha, gamma = float(call.attr("alpha", _SELU_ALPHA)), float(call.attr("gamma", _SELU_GAMMA))
    return gamma * torch.where(t > 0, t, alpha * torch.expm1(torch.clamp(t, max=0)))


@torch_op("ThresholdedRelu")
def thresholded_relu(call: Call, x: Value) -> torch.Tensor:
    """x where x > alpha (default 1), else 0."""
    t = call.tensor(x)
    return torch.where(t > float(call.attr("alpha", 1.0)), t, torch.zeros_like(t))


@torch_op("HardSigmoid")
def hard_sigmoid(call: Call, x: Value) -> torch.Tensor:
    alpha, beta = float(call.attr("alpha", 0.2)), float(call.attr("beta", 0.5))
    return torch.clamp(alpha * call.tensor(x) + beta, 0.0, 1.0)


@torch_op("HardSwish")
def hard_swish(call: Call, x: Value) -> torch.Tensor:
    """x * max(0, min(1, x / 6 + 0.5)) (HardSigmoid with alpha 1/6, beta 0.5)."""
    t = call.tensor(x)
    return t * torch.clamp(t / 6 + 0.5, 0.0, 1.0)


@torch_op("Shrink")
def shrink(call: Call, x: Value) -> torch.Tensor:
    """x + bias where x < -lambd, x - bias where x > lambd, else 0 (lambd 0.5, bias 0)."""
    t = call.tensor(x)
    lambd, bias = float(call.attr("lambd", 0.5)), float(call.attr("bias", 0.0))
    zero = torch.zeros_like(t)
    return torch.where(t < -lambd, t + bias, torch.where(t > lambd, t - bias, zero)).to(t.dtype)


def _gelu_check(node: NodeSpec) -> str | None:
    approximate = node.attr("approximate", "none")
    return None if approximate in ("none", "tanh") else f"approximate={approximate!r} is not 'none' or 'tanh'"


@torch_op("Gelu", check=_gelu_check)
def gelu(call: Call, x: Value) -> torch.Tensor:
    """Opset 20: approximate 'none' (erf, default) or 'tanh'."""
    return F.gelu(call.tensor(x), approximate=str(call.attr("approximate", "none")))


@torch_op("Clip")
def clip(call: Call, x: Value, low: Value | None = None, high: Value | None = None) -> torch.Tensor:
    """Opset >= 11: optional `min`/`max` inputs; before, attributes `min`/`max` (defaults: no bound); neither bound
    gives the input. min > max gives max everywhere."""
    t = call.tensor(x)
    if call.opset < 11:
        lo, hi = call.attr("min"), call.attr("max")
        return t if lo is None and hi is None else torch.clamp(t, lo, hi)
    if low is None and high is None:
        return t
    return torch.clamp(t, None if low is None else call.tensor(low), None if high is None else call.tensor(high))


@torch_op("Where")
def where(call: Call, condition: Value, x: Value, y: Value) -> torch.Tensor:
    c, a, b = call.tensors(condition, x, y)
    return torch.where(c, a, b)


def _variadic(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(call: Call, *values: Value) -> torch.Tensor:
        return functools.reduce(fn, call.tensors(*values))

    return run


torch_op("Sum")(_variadic(torch.add))
torch_op("Max")(_variadic(_ordered(torch.maximum)))
torch_op("Min")(_variadic(_ordered(torch.minimum)))


@torch_op("Mean")
def mean(call: Call, *values: Value) -> torch.Tensor:
    return functools.reduce(torch.add, call.tensors(*values)) / len(values)
