"""OnnxModule's Cast and CastLike, written from the ONNX operator specification (Cast-19/21's rules).

Rules: floating point to integer truncates toward zero; to bool means 'not zero'; integers to a narrower integer
keep the low bits; INT4/UINT4 (held in int8/uint8 elements, `base`) round half to even and clamp to [-8, 7] /
[0, 15]. To a float8 type, with saturate=1 (the default) values beyond the largest finite one become it (with
its sign) and infinities too, except for the FNUZ types, which have no infinity and give NaN for one; with
saturate=0 an overflow is NaN (E5M2: an infinity). Rounding is to the nearest even value (torch's conversion);
ONNX's test data for bfloat16 truncates instead, a difference of one bfloat16 unit in the last place at most.
STRING has no torch type: a Cast to it is refused at construction.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto

from .base import (
    FLOAT8,
    SUBBYTE,
    Call,
    NodeSpec,
    Value,
    element_name,
    numpy_dtype,
    static_op,
    torch_dtype,
    torch_op,
)

# the value halfway between the largest finite float8 value and the next one up: where rounding overflows
# (a tie rounds to even, so it overflows when the largest value's last mantissa bit is odd)
_OVERFLOW: dict[torch.dtype, tuple[float, bool]] = {
    torch.float8_e4m3fn: (464.0, False),  # 448 = 1.110b x 2^8: a tie rounds down to it
    torch.float8_e4m3fnuz: (248.0, True),  # 240 = 1.111b x 2^7
    torch.float8_e5m2: (61440.0, True),  # 57344 = 1.11b x 2^15
    torch.float8_e5m2fnuz: (61440.0, True),
}


def _cast_check(node: NodeSpec) -> str | None:
    to = node.attr("to")
    if to is None:
        return "attribute 'to' is missing"
    try:
        torch_dtype(int(to))
    except ValueError:
        return f"Cast to {element_name(int(to))}: the type has no torch equivalent"
    return None


def cast_to(t: torch.Tensor, elem_type: int | None, dtype: torch.dtype, saturate: bool) -> torch.Tensor:
    """`t` cast to `dtype` (ONNX element type `elem_type` where it says more: INT4/UINT4) by the rules above."""
    if t.dtype == dtype and elem_type not in SUBBYTE:
        return t
    if dtype == torch.bool:
        return t != 0
    if elem_type in SUBBYTE:
        low, high = SUBBYTE[elem_type]
        wide = t.to(torch.float64) if t.dtype.is_floating_point else t.to(torch.int64)
        return torch.round(torch.clamp(wide, low, high)).to(dtype)
    if dtype in FLOAT8:
        return _to_float8(t, dtype, saturate)
    if t.dtype == torch.bool or t.dtype in FLOAT8:
        return t.to(torch.float32).to(dtype) if dtype.is_floating_point else t.to(torch.int64).to(dtype)
    if not t.dtype.is_floating_point and not dtype.is_floating_point and t.dtype != torch.int64:
        return t.to(torch.int64).to(dtype)  # keeps the low bits (torch lacks some unsigned conversions)
    return t.to(dtype)


def _to_float8(t: torch.Tensor, dtype: torch.dtype, saturate: bool) -> torch.Tensor:
    x = t.to(torch.float32)
    largest = torch.finfo(dtype).max
    nan = torch.full_like(x, float("nan"))
    if saturate:
        return torch.clamp(x, -largest, largest).to(dtype)
    limit, tie_overflows = _OVERFLOW[dtype]
    overflow = (x.abs() > limit) | ((x.abs() == limit) & tie_overflows)
    beyond = torch.sign(x) * float("inf") if dtype == torch.float8_e5m2 else nan
    return torch.where(overflow, beyond, x).to(dtype)


@torch_op("Cast", check=_cast_check)
def cast(call: Call, x: Value) -> torch.Tensor:
    to = int(call.attr("to"))
    return cast_to(call.tensor(x), to, torch_dtype(to), bool(call.attr("saturate", 1)))


@static_op("Cast")
def cast_static(call: Call, x: np.ndarray) -> Value:
    """In numpy where both types are numpy types and no rounding rule differs (to bool, to the sub-byte and
    float8 types: torch)."""
    to = int(call.attr("to"))
    if to in SUBBYTE or to in (TensorProto.BOOL, TensorProto.BFLOAT16) or x.dtype == np.bool_:
        return cast(call, x)
    try:
        target = numpy_dtype(to)
    except ValueError:
        return cast(call, x)
    return x.astype(target)


@torch_op("CastLike")
def cast_like(call: Call, x: Value, like: Value) -> torch.Tensor:
    """Cast to the element type of `like` (saturate as Cast's)."""
    return cast_to(call.tensor(x), None, call.tensor(like).dtype, bool(call.attr("saturate", 1)))
