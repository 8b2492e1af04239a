"""OnnxModule's reductions and the ops that work along an axis: Reduce*, ArgMax/ArgMin, Softmax, LogSoftmax,
Hardmax, CumSum and TopK, written from the ONNX operator specification.

Rules: reduction axes are an attribute before opset 13 (ReduceSum) or 18 (the others), then an optional input;
no axes reduce everything unless noop_with_empty_axes is set. A reduction over an empty dimension gives the
operation's identity (0 for sums and L-norms, 1 for products, -inf for Max/LogSum/LogSumExp, +inf for Min;
the type's extremes for integers). Before opset 13, Softmax, LogSoftmax and Hardmax work on the input coerced
to 2-D at `axis` (default 1), i.e. over all dimensions from `axis` on; from 13, along `axis` (default -1).
Ties: ArgMax/ArgMin take the first index (the last with select_last_index), Hardmax the first, TopK the lower
index first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.nn import functional as F

from .base import Call, Value, axes_of, axis_of, torch_op

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
# what a reduction over no element gives (None: computed by the formula)
_EMPTY: dict[str, str | float] = {"ReduceMax": "low", "ReduceMin": "high", "ReduceLogSumExp": "low", "ReduceProd": 1.0}


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
    return tuple(sorted(set(axes_of(listed, rank)))) if listed else tuple(range(rank))


def _reduce(call: Call, x: Value, axes: Value | None = None) -> torch.Tensor:
    t = call.tensor(x)
    dims = reduction_axes(call, axes, t.dim())
    if dims is None:
        return t
    keep = bool(call.attr("keepdims", 1))
    op = call.node.op_type
    if t.dim() and any(t.shape[d] == 0 for d in dims) and op in _EMPTY:
        shape = [1 if d in dims else n for d, n in enumerate(t.shape)]
        shape = shape if keep else [n for d, n in enumerate(t.shape) if d not in dims]
        return torch.full(shape, _identity(_EMPTY[op], t.dtype), dtype=t.dtype, device=t.device)
    if t.dim() == 0:
        return _REDUCTIONS[op](t.reshape(1), (0,), False)
    return _REDUCTIONS[op](t, dims, keep)


def _identity(kind: str | float, dtype: torch.dtype) -> float | int:
    if not isinstance(kind, str):
        return kind
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    if dtype.is_floating_point:
        return -math.inf if kind == "low" else math.inf
    return int(info.min if kind == "low" else info.max)


for _name in _REDUCTIONS:
    torch_op(_name)(_reduce)


def _arg(call: Call, x: Value, largest: bool) -> torch.Tensor:
    """The index of the largest (smallest) element along `axis` (default 0), keepdims (default 1), first or
    (select_last_index, opset 12) last among ties."""
    t = call.tensor(x)
    axis = axis_of(int(call.attr("axis", 0)), t.dim())
    last = bool(call.attr("select_last_index", 0))
    source = torch.flip(t, [axis]) if last else t
    index = torch.argmax(source, dim=axis, keepdim=True) if largest else torch.argmin(source, dim=axis, keepdim=True)
    if last:
        index = t.shape[axis] - 1 - index
    return index if call.attr("keepdims", 1) else index.squeeze(axis)


@torch_op("ArgMax")
def arg_max(call: Call, x: Value) -> torch.Tensor:
    return _arg(call, x, largest=True)


@torch_op("ArgMin")
def arg_min(call: Call, x: Value) -> torch.Tensor:
    return _arg(call, x, largest=False)


def _along_axis(call: Call, x: Value, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """`fn(t, dim)` along `axis` (opset >= 13), or on the input coerced to 2-D at `axis` (before)."""
    t = call.tensor(x)
    if call.opset >= 13:
        return fn(t, axis_of(int(call.attr("axis", -1)), t.dim()))
    axis = axis_of(int(call.attr("axis", 1)), t.dim())
    flat = t.reshape(math.prod(t.shape[:axis]), -1) if t.dim() else t.reshape(1, 1)
    return fn(flat, 1).reshape(t.shape)


@torch_op("Softmax")
def softmax(call: Call, x: Value) -> torch.Tensor:
    return _along_axis(call, x, lambda t, d: F.softmax(t, dim=d))


@torch_op("LogSoftmax")
def log_softmax(call: Call, x: Value) -> torch.Tensor:
    return _along_axis(call, x, lambda t, d: F.log_softmax(t, dim=d))


def _hardmax(t: torch.Tensor, dim: int) -> torch.Tensor:
    if t.shape[dim] == 0:
        return t
    index = torch.argmax(t, dim=dim, keepdim=True)
    return torch.zeros_like(t).scatter(dim, index, torch.ones_like(index, dtype=t.dtype))


@torch_op("Hardmax")
def hardmax(call: Call, x: Value) -> torch.Tensor:
    """1 at the first largest element along the axis, 0 elsewhere."""
    return _along_axis(call, x, _hardmax)


@torch_op("CumSum")
def cumsum(call: Call, x: Value, axis: Value) -> torch.Tensor:
    """Along the static `axis`; `exclusive` leaves each element out of its own sum, `reverse` sums from the end."""
    t = call.tensor(x)
    dim = axis_of(call.ints(axis, "axis")[0], t.dim())
    reverse = bool(call.attr("reverse", 0))
    source = torch.flip(t, [dim]) if reverse else t
    total = torch.cumsum(source, dim=dim).to(t.dtype)
    if call.attr("exclusive", 0):
        total = total - source
    return torch.flip(total, [dim]) if reverse else total


@torch_op("TopK")
def top_k(call: Call, x: Value, k: Value | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest (largest=0: smallest) elements along `axis` (default -1) and their int64 indices, sorted;
    equal values keep the lower index first. `k` is an attribute before opset 10, then an input."""
    t = call.tensor(x)
    count = int(call.attr("k")) if call.opset < 10 else call.ints(k, "K")[0]
    axis = axis_of(int(call.attr("axis", -1)), t.dim())
    largest = bool(call.attr("largest", 1))
    if torch.compiler.is_compiling():  # torch.onnx exports topk as ONNX's TopK, whose ties follow the spec
        order = torch.topk(t, count, dim=axis, largest=largest, sorted=True).indices
    else:  # eager torch.topk orders ties arbitrarily; a stable sort keeps the lower index first
        order = torch.sort(t, dim=axis, descending=largest, stable=True).indices.narrow(axis, 0, count)
    return torch.gather(t, axis, order), order
