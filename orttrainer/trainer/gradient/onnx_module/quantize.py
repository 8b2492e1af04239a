"""OnnxModule's quantization ops: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul,
QLinearConv and ConvInteger, written from the ONNX operator specification.

Rules: quantizing rounds x / scale half to even, adds the zero point and saturates to the output type (uint8 by
default; the zero point's type, or output_dtype from opset 21; INT4/UINT4 clamp to their 4-bit range; float8
types take no zero point and follow Cast's saturate rule). Scales and zero points are scalars, one per element of
`axis` (default 1; per-axis, opset 13), or blocks of `block_size` along it (opset 21). Dequantizing computes
(x - zero point) * scale in the scale's type. The integer products are exact (int64).
"""

from __future__ import annotations

import torch

from .base import SUBBYTE, Call, Value, axis_of, torch_dtype, torch_op
from .cast import cast_to
from .conv import convolve, window
from .linalg import integer_matmul

_INTEGER_RANGES = {
    torch.uint8: (0, 255),
    torch.int8: (-128, 127),
    torch.uint16: (0, 65535),
    torch.int16: (-32768, 32767),
}


def _broadcast(call: Call, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scale or zero point shaped to broadcast against `like`: a scalar, per-axis along `axis`, or blocked."""
    if value.dim() == 0 or value.numel() == 1 and value.dim() <= 1:
        return value.reshape(())
    axis = axis_of(int(call.attr("axis", 1)), like.dim())
    block = int(call.attr("block_size", 0))
    if block:
        return value.repeat_interleave(block, dim=axis).narrow(axis, 0, like.shape[axis])
    return value.reshape([-1 if d == axis else 1 for d in range(like.dim())])


def _output_type(call: Call, zero_point: Value | None) -> tuple[int | None, torch.dtype]:
    """(ONNX element type when it says more than the dtype, torch dtype) of QuantizeLinear's output."""
    if zero_point is not None:
        elem = call.node.input_types[2] if len(call.node.input_types) > 2 else None
        dtype = call.tensor(zero_point).dtype
        return (elem if elem in SUBBYTE else None), dtype
    given = int(call.attr("output_dtype", 0))
    if given:
        return given, torch_dtype(given)
    return None, torch.uint8


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    elem: int | None,
    dtype: torch.dtype,
    saturate: bool,
) -> torch.Tensor:
    """saturate(round(x / scale) + zero) in `dtype` (element type `elem` for INT4/UINT4)."""
    scaled = x.to(torch.float32) / scale.to(torch.float32)
    if dtype.is_floating_point:  # float8
        return cast_to(scaled, None, dtype, saturate)
    rounded = torch.round(scaled) + (0 if zero is None else zero.to(torch.float32))
    low, high = SUBBYTE[elem] if elem in SUBBYTE else _INTEGER_RANGES.get(dtype, (None, None))
    return torch.clamp(rounded, low, high).to(dtype)


@torch_op("QuantizeLinear")
def quantize_linear(call: Call, x: Value, scale: Value, zero_point: Value | None = None) -> torch.Tensor:
    t = call.tensor(x)
    elem, dtype = _output_type(call, zero_point)
    s = _broadcast(call, call.tensor(scale), t)
    zero = None if zero_point is None else _broadcast(call, call.tensor(zero_point), t)
    return quantize(t, s, zero, elem, dtype, bool(call.attr("saturate", 1)))


@torch_op("DequantizeLinear")
def dequantize_linear(call: Call, x: Value, scale: Value, zero_point: Value | None = None) -> torch.Tensor:
    t, s = call.tensors(x, scale)
    s = _broadcast(call, s, t)
    if t.dtype.is_floating_point:  # float8 (no zero point)
        return (t.to(torch.float32) * s.to(torch.float32)).to(s.dtype)
    values = t.to(torch.int64)
    if zero_point is not None:
        values = values - _broadcast(call, call.tensor(zero_point), t).to(torch.int64)
    return (values.to(torch.float32) * s.to(torch.float32)).to(s.dtype)


@torch_op("DynamicQuantizeLinear")
def dynamic_quantize_linear(call: Call, x: Value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 quantization of x with scale (max(0, max x) - min(0, min x)) / 255 and the zero point that maps 0
    exactly: outputs y, y_scale, y_zero_point."""
    t = call.tensor(x).to(torch.float32)
    low = torch.clamp(t.min(), max=0.0)
    high = torch.clamp(t.max(), min=0.0)
    scale = (high - low) / 255.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.clamp(torch.round(-low / safe), 0, 255)
    y = torch.clamp(torch.round(t / safe) + zero, 0, 255).to(torch.uint8)
    return y, scale, zero.to(torch.uint8)


def _requantize(call: Call, product: torch.Tensor, scale: torch.Tensor, y_zero: Value | None, like: torch.Tensor):
    """round(product * scale) + y_zero_point, saturated to the output type (y_zero_point's, else the input's)."""
    dtype = call.tensor(y_zero).dtype if y_zero is not None else like.dtype
    values = torch.round(product.to(torch.float64) * scale.to(torch.float64))
    if y_zero is not None:
        values = values + call.tensor(y_zero).to(torch.float64)
    low, high = _INTEGER_RANGES.get(dtype, (None, None))
    return torch.clamp(values, low, high).to(dtype)


def _centred(call: Call, value: Value, zero: Value | None, per_row: bool = False) -> torch.Tensor:
    t = call.tensor(value).to(torch.int64)
    if zero is None:
        return t
    z = call.tensor(zero).to(torch.int64)
    if per_row and z.dim() == 1 and z.numel() > 1:
        z = z.reshape((-1,) + (1,) * (t.dim() - 1))
    return t - z


def _per(value: torch.Tensor, rows: bool) -> torch.Tensor:
    """A per-row (A's scale: one per row) or per-column (B's) scale shaped for an (M, N) product."""
    if value.dim() == 0 or value.numel() == 1:
        return value.reshape(())
    return value.reshape(-1, 1) if rows else value.reshape(1, -1)


@torch_op("QLinearMatMul")
def qlinear_matmul(
    call: Call,
    a: Value,
    a_scale: Value,
    a_zero: Value,
    b: Value,
    b_scale: Value,
    b_zero: Value,
    y_scale: Value,
    y_zero: Value,
) -> torch.Tensor:
    """quantize((a - a_zero) @ (b - b_zero) * a_scale * b_scale / y_scale) with y_zero, exact integer product."""
    product = integer_matmul(_centred(call, a, a_zero), _centred(call, b, b_zero))
    sa, sb, sy = call.tensors(a_scale, b_scale, y_scale)
    return _requantize(call, product, _per(sa, True) * _per(sb, False) / sy, y_zero, call.tensor(a))


@torch_op("QLinearConv")
def qlinear_conv(
    call: Call,
    x: Value,
    x_scale: Value,
    x_zero: Value,
    w: Value,
    w_scale: Value,
    w_zero: Value,
    y_scale: Value,
    y_zero: Value,
    bias: Value | None = None,
) -> torch.Tensor:
    """quantize((Conv(x - x_zero, w - w_zero) + B) * x_scale * w_scale / y_scale) with y_zero (w_scale and
    w_zero per output channel or scalar)."""
    accumulated = _integer_conv(call, _centred(call, x, x_zero), _centred(call, w, w_zero, per_row=True))
    if bias is not None:
        accumulated = accumulated + call.tensor(bias).to(torch.int64).reshape((1, -1) + (1,) * (accumulated.dim() - 2))
    sx, sw, sy = call.tensors(x_scale, w_scale, y_scale)
    per_channel = sw.reshape((1, -1) + (1,) * (accumulated.dim() - 2)) if sw.numel() > 1 else sw.reshape(())
    return _requantize(call, accumulated, sx * per_channel / sy, y_zero, call.tensor(x))


def _integer_conv(call: Call, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Conv of integer tensors, exact: in float64 (sums of int8 products stay far below 2^53), back to int64."""
    geometry = window(call, list(x.shape[2:]), list(w.shape[2:]))
    result = convolve(x.to(torch.float64), w.to(torch.float64), int(call.attr("group", 1)), geometry)
    return torch.round(result).to(torch.int64)


@torch_op("ConvInteger")
def conv_integer(
    call: Call, x: Value, w: Value, x_zero: Value | None = None, w_zero: Value | None = None
) -> torch.Tensor:
    """Conv(x - x_zero_point, w - w_zero_point) in int32."""
    return _integer_conv(call, _centred(call, x, x_zero), _centred(call, w, w_zero, per_row=True)).to(torch.int32)
