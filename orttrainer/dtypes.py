"""The one table of element types: ONNX `TensorProto` element type <-> torch dtype <-> numpy dtype <-> the type
string ONNX Runtime reports for an `OrtValue` (`"tensor(float)"`).

Every module that converts between these names looks them up here. Legacy helpers whose historical mappings differ
(`_utils.dtype_torch_to_numpy` maps bfloat16 to float16, as the original did) start from this table and say where
they depart from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper


@dataclass(frozen=True)
class ElementType:
    """One element type under its four names. `numpy` is None where numpy has no such type (bfloat16)."""

    onnx: int
    torch: torch.dtype
    numpy: type | None
    ort: str  # OrtValue.data_type()


ELEMENT_TYPES: tuple[ElementType, ...] = (
    ElementType(TensorProto.FLOAT, torch.float32, np.float32, "tensor(float)"),
    ElementType(TensorProto.FLOAT16, torch.float16, np.float16, "tensor(float16)"),
    ElementType(TensorProto.BFLOAT16, torch.bfloat16, None, "tensor(bfloat16)"),
    ElementType(TensorProto.DOUBLE, torch.float64, np.float64, "tensor(double)"),
    ElementType(TensorProto.INT8, torch.int8, np.int8, "tensor(int8)"),
    ElementType(TensorProto.UINT8, torch.uint8, np.uint8, "tensor(uint8)"),
    ElementType(TensorProto.INT16, torch.int16, np.int16, "tensor(int16)"),
    ElementType(TensorProto.INT32, torch.int32, np.int32, "tensor(int32)"),
    ElementType(TensorProto.INT64, torch.int64, np.int64, "tensor(int64)"),
    ElementType(TensorProto.BOOL, torch.bool, np.bool_, "tensor(bool)"),
    ElementType(TensorProto.COMPLEX64, torch.complex64, np.complex64, "tensor(complex64)"),
    ElementType(TensorProto.COMPLEX128, torch.complex128, np.complex128, "tensor(complex128)"),
)

FLOAT_ONNX_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16})

_BY_ONNX = {t.onnx: t for t in ELEMENT_TYPES}
_BY_TORCH = {t.torch: t for t in ELEMENT_TYPES}
_BY_ORT = {t.ort: t for t in ELEMENT_TYPES}


def _onnx_name(elem_type: int) -> str:
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return str(elem_type)


def onnx_to_torch(elem_type: int) -> torch.dtype:
    """ONNX element type -> torch dtype; ValueError naming the type when torch has none."""
    if elem_type not in _BY_ONNX:
        raise ValueError(f"ONNX element type {_onnx_name(elem_type)} has no torch equivalent")
    return _BY_ONNX[elem_type].torch


def torch_to_onnx(dtype: torch.dtype) -> int:
    """torch dtype -> ONNX element type; ValueError naming the dtype when ONNX has none."""
    if dtype not in _BY_TORCH:
        raise ValueError(f"torch dtype {dtype} has no ONNX element type")
    return _BY_TORCH[dtype].onnx


def ort_to_numpy(type_string: str) -> type:
    """`OrtValue.data_type()` (e.g. "tensor(float)") -> numpy dtype; ValueError when numpy has none."""
    entry = _BY_ORT.get(type_string)
    if entry is None or entry.numpy is None:
        raise ValueError(f"ONNX Runtime type {type_string!r} has no numpy equivalent")
    return entry.numpy


def tensor_proto(value: torch.Tensor, name: str) -> TensorProto:
    """`value` as an ONNX tensor named `name` (an initializer), in its own element type. numpy has no bfloat16, so a
    bfloat16 tensor's bits are written as they are (`raw_data` holds each value's two bytes, as ONNX stores them)."""
    value = value.detach().cpu().contiguous()
    if value.dtype == torch.bfloat16:
        raw = value.view(torch.int16).numpy().tobytes()
        return helper.make_tensor(name, TensorProto.BFLOAT16, list(value.shape), raw, raw=True)
    return numpy_helper.from_array(value.numpy(), name)
