"""OnnxModule's convolution and pooling ops (1-, 2- and 3-D), written from the ONNX operator specification.

Rule: every window op is computed from *patches* — one strided slice of the padded input per kernel offset,
stacked — then a product (Conv: einsum with the weights), a max or a mean over the offsets. Why not torch's conv
and pool kernels: their backward ops (`convolution_backward`, `avg_pool2d_backward`, max-pool indices) have no
ONNX translation in torch.onnx, or a wrong one, so the torch builder could not export the traced gradient
(docs/engine.md §11.2); slices, pads, stacks, einsum and max have exportable backward ops. The cost is memory:
the patches hold kernel-size copies of the input.

Padding: `pads` = [begin..., end...] (default 0), or auto_pad SAME_UPPER / SAME_LOWER (the output is
ceil(input / stride) long; the odd padding goes to the end for UPPER, the beginning for LOWER) or VALID (none).
Pooling with ceil_mode keeps a last window that starts inside the input or its begin padding; what it reaches
beyond the end padding does not count. MaxPool pads with -inf (padding never wins); AveragePool divides by the
number of real elements in the window, or (count_include_pad=1) also counts the explicit padding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from .base import Call, Value, torch_op


@dataclass(frozen=True)
class Window:
    """One window op's geometry over the spatial dimensions."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]  # padding before
    end: tuple[int, ...]  # explicit padding after
    overhang: tuple[int, ...]  # ceil_mode: further room after the end padding, which never counts
    out: tuple[int, ...]


def window(call: Call, spatial: Sequence[int], kernel: Sequence[int], ceil_mode: bool = False) -> Window:
    n = len(spatial)
    strides = tuple(call.attr("strides", [1] * n))
    dilations = tuple(call.attr("dilations", [1] * n))
    begin, end = _pads(call, spatial, kernel, strides, dilations)
    out, overhang = [], []
    for size, k, s, d, b, e in zip(spatial, kernel, strides, dilations, begin, end, strict=True):
        span = size + b + e - d * (k - 1) - 1
        count = (math.ceil(span / s) if ceil_mode else span // s) + 1
        if ceil_mode and (count - 1) * s >= size + b:  # the last window would start in the end padding
            count -= 1
        out.append(count)
        overhang.append(max((count - 1) * s + d * (k - 1) + 1 - (size + b + e), 0))
    return Window(tuple(kernel), strides, dilations, tuple(begin), tuple(end), tuple(overhang), tuple(out))


def _pads(call: Call, spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]):
    n = len(spatial)
    auto_pad = str(call.attr("auto_pad", "NOTSET"))
    if auto_pad in ("NOTSET", ""):
        pads = list(call.attr("pads", [0] * (2 * n)))
        return pads[:n], pads[n:]
    if auto_pad == "VALID":
        return [0] * n, [0] * n
    begin, end = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations, strict=True):
        total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else large)
        end.append(large if auto_pad == "SAME_UPPER" else small)
    return begin, end


def _torch_pad(begin: Sequence[int], end: Sequence[int]) -> list[int]:
    """F.pad's order: (begin, end) from the last dimension backwards."""
    return [p for b, e in zip(reversed(begin), reversed(end), strict=True) for p in (b, e)]


def patches(x, w: Window):
    """(N, C, K, *out) from the padded (N, C, *spatial) `x` (a tensor or an array): one strided slice per kernel
    offset, offsets in row-major order."""
    pieces = []
    for offsets in itertools.product(*(range(k) for k in w.kernel)):
        index: list[slice] = [slice(None), slice(None)]
        for o, d, s, size in zip(offsets, w.dilations, w.strides, w.out, strict=True):
            index.append(slice(o * d, o * d + s * (size - 1) + 1, s))
        pieces.append(x[tuple(index)])
    return torch.stack(pieces, dim=2) if isinstance(x, torch.Tensor) else np.stack(pieces, axis=2)


def _padded(t: torch.Tensor, w: Window, value: float) -> torch.Tensor:
    after = [e + o for e, o in zip(w.end, w.overhang, strict=True)]
    if not any(w.begin) and not any(after):
        return t
    return F.pad(t, _torch_pad(w.begin, after), value=value)


@torch_op("Conv")
def conv(call: Call, x: Value, weights: Value, bias: Value | None = None) -> torch.Tensor:
    """Y[n, o] = sum over the group's channels and the kernel of X * W, + B[o]; group splits the channels."""
    t, kernel_weights = call.tensors(x, weights)
    groups = int(call.attr("group", 1))
    w = window(call, list(t.shape[2:]), list(kernel_weights.shape[2:]))
    n, channels = t.shape[0], t.shape[1]
    grouped = patches(_padded(t, w, 0.0), w).reshape(n, groups, channels // groups, math.prod(w.kernel), -1)
    outputs = kernel_weights.shape[0]
    k = kernel_weights.reshape(groups, outputs // groups, channels // groups, math.prod(w.kernel))
    y = torch.einsum("ngckp,gock->ngop", grouped, k).reshape(n, outputs, *w.out)
    if bias is None:
        return y
    return y + call.tensor(bias).reshape((1, -1) + (1,) * len(w.out))


@torch_op("MaxPool")
def max_pool(call: Call, x: Value) -> torch.Tensor:
    """The largest element of each window (the first one in row-major order takes the gradient on ties). The
    Indices output is not supported."""
    if call.wants(1):
        raise call.fail("the Indices output is not supported")
    t = call.tensor(x)
    w = window(call, list(t.shape[2:]), list(call.attr("kernel_shape")), bool(call.attr("ceil_mode", 0)))
    return torch.max(patches(_padded(t, w, float("-inf")), w), dim=2).values


@torch_op("AveragePool")
def average_pool(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    w = window(call, list(t.shape[2:]), list(call.attr("kernel_shape")), bool(call.attr("ceil_mode", 0)))
    total = patches(_padded(t, w, 0.0), w).sum(dim=2)
    counts = _counts(t.shape[2:], w, bool(call.attr("count_include_pad", 0)))
    return total / call.tensor(counts).to(t.dtype)


def _counts(spatial: Sequence[int], w: Window, include_pad: bool) -> np.ndarray:
    """How many elements each window averages (static: it depends on shapes only)."""
    mask = np.ones(tuple(spatial), np.float64)
    explicit = [(b, e) for b, e in zip(w.begin, w.end, strict=True)]
    mask = np.pad(mask, explicit, constant_values=1.0 if include_pad else 0.0)
    mask = np.pad(mask, [(0, o) for o in w.overhang], constant_values=0.0)
    return patches(mask[None, None], w).sum(axis=2)


@torch_op("GlobalAveragePool")
def global_average_pool(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    return t.mean(dim=tuple(range(2, t.dim())), keepdim=True)


@torch_op("GlobalMaxPool")
def global_max_pool(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    return t.amax(dim=tuple(range(2, t.dim())), keepdim=True)
