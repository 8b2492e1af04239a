"""OnnxModule's matrix products and linear algebra: MatMul, Gemm, Einsum, Det and MatMulInteger, written from the
ONNX operator specification (MatMul broadcasts like numpy.matmul; Einsum takes numpy's equation syntax, implicit
output and `...` included).
"""

from __future__ import annotations

import torch

from .base import Call, Value, torch_op


@torch_op("MatMul")
def matmul(call: Call, a: Value, b: Value) -> torch.Tensor:
    x, y = call.tensors(a, b)
    return integer_matmul(x, y) if not x.dtype.is_floating_point else torch.matmul(x, y)


def integer_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """numpy.matmul of integer tensors, exact: computed in int64 (torch's CPU kernels lack smaller integer
    products), the result in the inputs' type."""
    return torch.matmul(x.to(torch.int64), y.to(torch.int64)).to(x.dtype)


@torch_op("Gemm")
def gemm(call: Call, a: Value, b: Value, c: Value | None = None) -> torch.Tensor:
    """Y = alpha * A' @ B' + beta * C; A' = A^T when transA, B' = B^T when transB; C (optional from opset 11)
    broadcasts to (M, N)."""
    x, w = call.tensors(a, b)
    x = x.t() if call.attr("transA", 0) else x
    w = w.t() if call.attr("transB", 0) else w
    alpha, beta = float(call.attr("alpha", 1.0)), float(call.attr("beta", 1.0))
    product = torch.matmul(x, w) if x.dtype.is_floating_point else integer_matmul(x, w)
    y = product if alpha == 1.0 else (alpha * product).to(x.dtype)
    if c is None:
        return y
    bias = call.tensor(c)
    return y + (bias if beta == 1.0 else (beta * bias).to(bias.dtype))


@torch_op("Einsum")
def einsum(call: Call, *values: Value) -> torch.Tensor:
    equation = str(call.attr("equation")).replace(" ", "")
    tensors = call.tensors(*values)
    if tensors and not tensors[0].dtype.is_floating_point:
        return torch.einsum(equation, *(t.to(torch.int64) for t in tensors)).to(tensors[0].dtype)
    return torch.einsum(equation, *tensors)


@torch_op("Det")
def det(call: Call, x: Value) -> torch.Tensor:
    """The determinant of each square matrix in the last two dimensions."""
    return torch.linalg.det(call.tensor(x))


def _zero_point(call: Call, value: Value | None, like: torch.Tensor, axis: int) -> torch.Tensor:
    """A MatMulInteger zero point as int64: a scalar, or one per row of A (axis -2) / column of B (axis -1)."""
    if value is None:
        return torch.zeros((), dtype=torch.int64, device=like.device)
    point = call.tensor(value).to(torch.int64)
    if point.dim() == 0 or point.numel() == 1:
        return point.reshape(())
    return point.unsqueeze(-1) if axis == -2 else point


@torch_op("MatMulInteger")
def matmul_integer(
    call: Call, a: Value, b: Value, a_zero: Value | None = None, b_zero: Value | None = None
) -> torch.Tensor:
    """(A - a_zero_point) @ (B - b_zero_point) in int32, exactly."""
    x, y = call.tensors(a, b)
    x = x.to(torch.int64) - _zero_point(call, a_zero, x, -2)
    y = y.to(torch.int64) - _zero_point(call, b_zero, y, -1)
    return torch.matmul(x, y).to(torch.int32)
