"""OnnxModule's convolution and pooling ops (any number of spatial dimensions): Conv, ConvTranspose, DeformConv,
MaxPool (with Indices), AveragePool, LpPool, the global pools, MaxUnpool and Col2Im, written from the ONNX
operator specification.

Rule: every window op is computed from *patches* — one strided slice of the padded input per kernel offset,
stacked — then a product (Conv: einsum with the weights), a max or a mean over the offsets. Why not torch's conv
and pool kernels: their backward ops (`convolution_backward`, `avg_pool2d_backward`, max-pool indices) have no
ONNX translation in torch.onnx, or a wrong one, so the torch builder could not export the traced gradient
(docs/engine.md §11.2); slices, pads, stacks, einsum and max have exportable backward ops. The cost is memory:
the patches hold kernel-size copies of the input. ConvTranspose is the Conv of the input spread out by the
strides (zeros between the elements) with the kernel flipped; Col2Im and MaxUnpool add values into positions
computed from shapes (scatter-add, whose backward is a gather).

Padding: `pads` = [begin..., end...] (default 0), or auto_pad SAME_UPPER / SAME_LOWER (the output is
ceil(input / stride) long; the odd padding goes to the end for UPPER, the beginning for LOWER) or VALID (none).
Pooling with ceil_mode keeps a last window that starts inside the input or its begin padding; what it reaches
beyond the end padding counts as neither input nor padding (as ONNX Runtime and PyTorch count it). MaxPool pads
with the lowest value (padding never wins); AveragePool divides by the number of real elements in the window, or
(count_include_pad=1) also counts the explicit padding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from .base import Call, NodeSpec, Value, as_tensor, torch_op


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


def _pads(
    call: Call, spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]
) -> tuple[list[int], list[int]]:
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


def _auto_pad_check(node: NodeSpec) -> str | None:
    auto_pad = node.attr("auto_pad", "NOTSET")
    return None if auto_pad in ("NOTSET", "", "VALID", "SAME_UPPER", "SAME_LOWER") else f"auto_pad {auto_pad!r}"


def torch_pad(begin: Sequence[int], end: Sequence[int]) -> list[int]:
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
    return F.pad(t, torch_pad(w.begin, after), value=value)


def convolve(t: torch.Tensor, kernel_weights: torch.Tensor, groups: int, w: Window) -> torch.Tensor:
    """Y[n, o] = sum over the group's channels and the kernel of X * W (no bias)."""
    n, channels = t.shape[0], t.shape[1]
    grouped = patches(_padded(t, w, 0.0), w).reshape(n, groups, channels // groups, math.prod(w.kernel), -1)
    outputs = kernel_weights.shape[0]
    k = kernel_weights.reshape(groups, outputs // groups, channels // groups, math.prod(w.kernel))
    return torch.einsum("ngckp,gock->ngop", grouped, k).reshape(n, outputs, *w.out)


def _with_bias(y: torch.Tensor, call: Call, bias: Value | None) -> torch.Tensor:
    if bias is None:
        return y
    return y + call.tensor(bias).reshape((1, -1) + (1,) * (y.dim() - 2))


@torch_op("Conv", check=_auto_pad_check)
def conv(call: Call, x: Value, weights: Value, bias: Value | None = None) -> torch.Tensor:
    """Y[n, o] = sum over the group's channels and the kernel of X * W, + B[o]; group splits the channels."""
    t, kernel_weights = call.tensors(x, weights)
    w = window(call, list(t.shape[2:]), list(kernel_weights.shape[2:]))
    return _with_bias(convolve(t, kernel_weights, int(call.attr("group", 1)), w), call, bias)


def _transpose_geometry(call: Call, spatial: Sequence[int], kernel: Sequence[int]) -> tuple[list[int], list[int]]:
    """ConvTranspose's (begin, end) padding: `pads`, or derived (pads ignored) from `output_shape` or auto_pad
    SAME_* (output_shape = input * stride): the full
    output (input - 1) * stride + output_padding + (kernel - 1) * dilation + 1 less `total` padding, which goes
    half to each side (the odd one to the end for SAME_UPPER, to the beginning otherwise, as the spec says and
    ONNX Runtime does)."""
    n = len(spatial)
    strides = list(call.attr("strides", [1] * n))
    dilations = list(call.attr("dilations", [1] * n))
    extra = list(call.attr("output_padding", [0] * n))[:n]
    full = [
        s * (i - 1) + e + (k - 1) * d + 1
        for i, s, e, k, d in zip(spatial, strides, extra, kernel, dilations, strict=True)
    ]
    auto_pad = str(call.attr("auto_pad", "NOTSET"))
    wanted = call.attr("output_shape")
    same = auto_pad in ("SAME_UPPER", "SAME_LOWER") and wanted is None
    if same:
        wanted = [i * s for i, s in zip(spatial, strides, strict=True)]
    if wanted is None or auto_pad == "VALID":
        pads = list(call.attr("pads", [0] * (2 * n)))
        return pads[:n], pads[n:]
    totals = [f - o for f, o in zip(full, list(wanted)[-n:], strict=True)]
    if same:  # never negative: the output is the full one when input * stride exceeds it (ONNX Runtime's rule)
        totals = [max(t, 0) for t in totals]
    if auto_pad == "SAME_UPPER":
        return [t // 2 for t in totals], [t - t // 2 for t in totals]
    return [t - t // 2 for t in totals], [t // 2 for t in totals]  # SAME_LOWER, and output_shape alone


def _spread(t: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
    """(N, C, *spatial) with stride - 1 zeros between neighbouring elements of each spatial dimension."""
    for axis, s in enumerate(strides, start=2):
        if s == 1:
            continue
        size = t.shape[axis]
        zeros = torch.zeros_like(t.unsqueeze(axis + 1)).expand(*t.shape[: axis + 1], s - 1, *t.shape[axis + 1 :])
        t = torch.cat([t.unsqueeze(axis + 1), zeros], dim=axis + 1).flatten(axis, axis + 1)
        t = t.narrow(axis, 0, (size - 1) * s + 1)
    return t


@torch_op("ConvTranspose", check=_auto_pad_check)
def conv_transpose(call: Call, x: Value, weights: Value, bias: Value | None = None) -> torch.Tensor:
    """The gradient of Conv with respect to its input: W is (C, M / group, k...), the output has M channels;
    strides, dilations, pads, output_padding, output_shape and auto_pad as the spec's shape equations say."""
    t, kernel_weights = call.tensors(x, weights)
    groups = int(call.attr("group", 1))
    spatial, kernel = list(t.shape[2:]), list(kernel_weights.shape[2:])
    n = len(spatial)
    strides = list(call.attr("strides", [1] * n))
    dilations = list(call.attr("dilations", [1] * n))
    begin, end = _transpose_geometry(call, spatial, kernel)
    extra = list(call.attr("output_padding", [0] * n))[:n]
    spread = _spread(t, strides)
    reach = [(k - 1) * d for k, d in zip(kernel, dilations, strict=True)]
    before = [r - b for r, b in zip(reach, begin, strict=True)]
    after = [r - e + o for r, e, o in zip(reach, end, extra, strict=True)]
    padded = F.pad(spread, torch_pad(before, after))
    c_in, per_group = kernel_weights.shape[0], kernel_weights.shape[1]
    flipped = torch.flip(kernel_weights, list(range(2, 2 + n)))
    flipped = flipped.reshape(groups, c_in // groups, per_group, *kernel).transpose(1, 2)
    as_conv = flipped.reshape(groups * per_group, c_in // groups, *kernel)
    geometry = Window(
        tuple(kernel), (1,) * n, tuple(dilations), (0,) * n, (0,) * n, (0,) * n,
        tuple(p - r for p, r in zip(padded.shape[2:], reach, strict=True)),
    )  # fmt: skip
    return _with_bias(convolve(padded, as_conv, groups, geometry), call, bias)


def _pool_window(call: Call, t: torch.Tensor) -> Window:
    return window(call, list(t.shape[2:]), list(call.attr("kernel_shape")), bool(call.attr("ceil_mode", 0)))


def _lowest(dtype: torch.dtype) -> float:
    return float("-inf") if dtype.is_floating_point else float(torch.iinfo(dtype).min)


@torch_op("MaxPool", check=_auto_pad_check)
def max_pool(call: Call, x: Value) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The largest element of each window (the first one in row-major order takes the gradient on ties), and
    (Indices output) its position in the flattened input (N·C·spatial, padding not counted): row-major, or
    column-major over the spatial dimensions with storage_order=1."""
    t = call.tensor(x)
    w = _pool_window(call, t)
    found = torch.max(patches(_padded(t, w, _lowest(t.dtype)), w), dim=2)
    if not call.wants(1):
        return found.values, None
    positions = call.tensor(_input_positions(list(t.shape[2:]), w, int(call.attr("storage_order", 0))))
    index = torch.gather(positions.expand(*t.shape[:2], *positions.shape[2:]), 2, found.indices.unsqueeze(2))
    plane = torch.arange(t.shape[0] * t.shape[1], device=t.device).reshape(t.shape[0], t.shape[1], *[1] * len(w.out))
    return found.values, index.squeeze(2) + plane * math.prod(t.shape[2:])


def _input_positions(spatial: Sequence[int], w: Window, storage_order: int) -> np.ndarray:
    """(1, 1, K, *out): the flattened spatial position of each window element (the order of `patches`)."""
    grids = np.meshgrid(*(np.arange(s) for s in spatial), indexing="ij")
    strides = np.cumprod([1, *spatial[:-1]]) if storage_order else np.cumprod([1, *spatial[::-1][:-1]])[::-1]
    linear = sum(g * int(s) for g, s in zip(grids, strides, strict=True))
    padded = np.pad(linear, [(b, e + o) for b, e, o in zip(w.begin, w.end, w.overhang, strict=True)])
    return patches(padded[None, None].astype(np.int64), w)


@torch_op("AveragePool", check=_auto_pad_check)
def average_pool(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    w = _pool_window(call, t)
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


def _lp(values: torch.Tensor, p: float, dims: int | tuple[int, ...]) -> torch.Tensor:
    """(sum |v|^p)^(1/p) over `dims`."""
    if p == 2:
        return torch.sqrt((values * values).sum(dim=dims))
    return values.abs().pow(p).sum(dim=dims).pow(1.0 / p)


@torch_op("LpPool", check=_auto_pad_check)
def lp_pool(call: Call, x: Value) -> torch.Tensor:
    """The p-norm (p default 2) of each window; padding adds nothing."""
    t = call.tensor(x)
    w = _pool_window(call, t)
    return _lp(patches(_padded(t, w, 0.0), w), float(call.attr("p", 2)), 2)


@torch_op("GlobalAveragePool")
def global_average_pool(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    return t.mean(dim=tuple(range(2, t.dim())), keepdim=True)


@torch_op("GlobalMaxPool")
def global_max_pool(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    return t.amax(dim=tuple(range(2, t.dim())), keepdim=True)


@torch_op("GlobalLpPool")
def global_lp_pool(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    dims = tuple(range(2, t.dim()))
    return _lp(t, float(call.attr("p", 2)), dims).reshape(*t.shape[:2], *[1] * len(dims))


@torch_op("MaxUnpool")
def max_unpool(call: Call, x: Value, indices: Value, output_shape: Value | None = None) -> torch.Tensor:
    """Zeros of the shape MaxPool's input had — `output_shape`, or (in - 1) * stride + kernel - pads — with each
    X value at its flattened position from `indices`."""
    t, where = call.tensors(x, indices)
    kernel = list(call.attr("kernel_shape"))
    n = len(kernel)
    strides, pads = list(call.attr("strides", [1] * n)), list(call.attr("pads", [0] * (2 * n)))
    if output_shape is not None:
        shape = call.ints(output_shape, "output_shape")
    else:
        spatial = [
            (i - 1) * s - pads[d] - pads[n + d] + k
            for d, (i, s, k) in enumerate(zip(t.shape[2:], strides, kernel, strict=True))
        ]
        shape = [*t.shape[:2], *spatial]
    flat = torch.zeros(math.prod(shape), dtype=t.dtype, device=t.device)
    return flat.scatter_add(0, where.reshape(-1).to(torch.int64), t.reshape(-1)).reshape(shape)


@torch_op("Col2Im")
def col2im(call: Call, x: Value, image_shape: Value, block_shape: Value) -> torch.Tensor:
    """(N, C·prod(block), L) columns summed back into (N, C, *image): column l holds the block whose corner is the
    l-th window position (strides, dilations, pads as a convolution's)."""
    t = call.tensor(x)
    image, block = call.ints(image_shape, "image_shape"), call.ints(block_shape, "block_shape")
    n = len(image)
    strides = list(call.attr("strides", [1] * n))
    dilations = list(call.attr("dilations", [1] * n))
    pads = list(call.attr("pads", [0] * (2 * n)))
    padded = [i + pads[d] + pads[n + d] for d, i in enumerate(image)]
    w = Window(
        tuple(block), tuple(strides), tuple(dilations), (0,) * n, (0,) * n, (0,) * n,
        tuple((p - dl * (b - 1) - 1) // s + 1 for p, b, s, dl in zip(padded, block, strides, dilations, strict=True)),
    )  # fmt: skip
    positions = patches(np.arange(math.prod(padded)).reshape(1, 1, *padded), w).reshape(-1)
    batch, channels = t.shape[0], t.shape[1] // math.prod(block)
    values = t.reshape(batch, channels, -1)
    index = as_tensor(positions).to(t.device).expand(batch, channels, -1)
    summed = torch.zeros(batch, channels, math.prod(padded), dtype=t.dtype, device=t.device)
    full = summed.scatter_add(2, index, values).reshape(batch, channels, *padded)
    for d in range(n):
        full = full.narrow(2 + d, pads[d], image[d])
    return full


@torch_op("DeformConv")
def deform_conv(
    call: Call,
    x: Value,
    weights: Value,
    offset: Value,
    bias: Value | None = None,
    mask: Value | None = None,
) -> torch.Tensor:
    """Conv whose kernel taps sample the input at their regular positions plus learned offsets (bilinear,
    zero outside the input), times `mask` (default 1). offset: (N, offset_group·K·n, *out), each tap's
    displacement per spatial dimension; mask: (N, offset_group·K, *out)."""
    from .resize import sample_linear

    t, kernel_weights, shift = call.tensors(x, weights, offset)
    n = t.dim() - 2
    kernel = list(kernel_weights.shape[2:])
    w = window(call, list(t.shape[2:]), kernel)
    groups, offset_groups = int(call.attr("group", 1)), int(call.attr("offset_group", 1))
    batch, channels, taps = t.shape[0], t.shape[1], math.prod(kernel)
    base = _tap_positions(w)  # (K, *out, n)
    moved = shift.reshape(batch, offset_groups, taps, n, *w.out).movedim(3, -1) + call.tensor(base).to(t.dtype)
    per_group = t.reshape(batch * offset_groups, channels // offset_groups, *t.shape[2:])
    sampled = sample_linear(per_group, moved.reshape(batch * offset_groups, taps, *w.out, n))
    sampled = sampled.reshape(batch, channels, taps, *w.out)
    if mask is not None:
        weight = call.tensor(mask).reshape(batch, offset_groups, 1, taps, *w.out)
        sampled = sampled.reshape(batch, offset_groups, channels // offset_groups, taps, *w.out) * weight
        sampled = sampled.reshape(batch, channels, taps, *w.out)
    grouped = sampled.reshape(batch, groups, channels // groups, taps, -1)
    outputs = kernel_weights.shape[0]
    k = kernel_weights.reshape(groups, outputs // groups, channels // groups, taps)
    y = torch.einsum("ngckp,gock->ngop", grouped, k).reshape(batch, outputs, *w.out)
    return _with_bias(y, call, bias)


def _tap_positions(w: Window) -> np.ndarray:
    """(K, *out, n): the input coordinate each kernel tap reads at each output position, without offsets."""
    n = len(w.kernel)
    taps = np.array(list(itertools.product(*(range(k) for k in w.kernel))), dtype=np.float64).reshape(-1, n)
    grid = np.stack(np.meshgrid(*(np.arange(o) for o in w.out), indexing="ij"), axis=-1).astype(np.float64)
    strides, dilations, begin = (np.array(v, dtype=np.float64) for v in (w.strides, w.dilations, w.begin))
    return grid[None] * strides + taps.reshape(-1, *([1] * n), n) * dilations - begin
