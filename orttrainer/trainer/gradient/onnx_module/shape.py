"""OnnxModule's shape and constant ops, in torch and — for the ones shape arithmetic uses — numpy, written from the
ONNX operator specification: Shape, Size, Constant, ConstantOfShape, Reshape, Transpose, Flatten, Squeeze,
Unsqueeze, Concat, Split, Slice, Expand, Tile, Range, Pad, DepthToSpace, SpaceToDepth, CenterCropPad, Trilu,
EyeLike, Identity.

Rules: numbers that decide a shape (Reshape's shape, Slice's starts/ends/axes/steps, Squeeze/Unsqueeze axes,
Split sizes, Expand/Tile/ConstantOfShape shapes, Pad's pads) must be static (`base`). `Shape` and `Size` are
always static: shapes are concrete while tracing. The numpy and torch versions of an op compute the same values;
an op whose result is large is computed in torch even from static inputs, so that it is not baked into the graph
as a constant (`module.STATIC_LIMIT`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
import torch
from torch.nn import functional as F

from .base import (
    CHECKS,
    Call,
    NodeSpec,
    Value,
    as_tensor,
    axes_of,
    axis_of,
    static_op,
    tensor_value,
    torch_dtype,
    torch_op,
)

Shape = tuple[int, ...]


def _shape(value: Value) -> Shape:
    return tuple(int(d) for d in value.shape)


@torch_op("Identity", "OptionalGetElement")
@static_op("Identity", "OptionalGetElement")
def identity(call: Call, x: Value) -> Value:
    """Identity; also OptionalGetElement of a tensor (OnnxModule holds no optional or sequence values)."""
    return x


@torch_op("OptionalHasElement")
def optional_has_element(call: Call, x: Value | None = None) -> np.ndarray:
    """Whether the (tensor) input is given."""
    return np.array(x is not None)


@torch_op("Shape")
def shape(call: Call, x: Value) -> np.ndarray:
    """Opset 15 `start`/`end` select a part of the shape (negative counts from the end, clamped to the rank)."""
    dims = _shape(x)
    rank = len(dims)
    start = min(max(axis_of(int(call.attr("start", 0)), rank), 0), rank)
    end = call.attr("end")
    stop = rank if end is None else min(max(axis_of(int(end), rank), 0), rank)
    return np.array(dims[start:stop], dtype=np.int64)


@torch_op("Size")
def size(call: Call, x: Value) -> np.ndarray:
    return np.array(math.prod(_shape(x)), dtype=np.int64)


def _constant_check(node: NodeSpec) -> str | None:
    for key in ("value_string", "value_strings"):
        if key in node.attrs:
            return f"string constants ({key}) have no torch type"
    value = node.attr("value")
    return value if isinstance(value, str) else None  # an unreadable tensor: the reason


@static_op("Constant")
def constant(call: Call) -> Value:
    """One of the attributes value (a tensor), sparse_value, value_float(s), value_int(s)."""
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32)):
        if key in call.node.attrs:
            return np.array(call.attr(key), dtype=dtype)
    for key in ("value_int", "value_ints"):
        if key in call.node.attrs:
            return np.array(call.attr(key), dtype=np.int64)
    sparse = call.attr("sparse_value")
    if isinstance(sparse, onnx.SparseTensorProto):
        return _dense(sparse)
    return call.attr("value")


CHECKS[("", "Constant")] = _constant_check


def _dense(sparse: onnx.SparseTensorProto) -> Value:
    """A SparseTensorProto as a dense value: `indices` are [NNZ] linear or [NNZ, rank] coordinates."""
    values = tensor_value(sparse.values)
    indices = np.asarray(tensor_value(sparse.indices), dtype=np.int64)
    dims = tuple(int(d) for d in sparse.dims)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(tuple(indices.T), dims)
    if isinstance(values, torch.Tensor):
        dense = torch.zeros(math.prod(dims), dtype=values.dtype)
        dense[torch.from_numpy(flat)] = values.reshape(-1)
        return dense.reshape(dims)
    result = np.zeros(math.prod(dims), dtype=values.dtype)
    result[flat] = values.reshape(-1)
    return result.reshape(dims)


def _fill_value(call: Call) -> Value:
    value = call.attr("value")
    if value is None:
        return np.zeros(1, np.float32)
    return value.reshape(-1)[:1]


@torch_op("ConstantOfShape")
def constant_of_shape(call: Call, dims: Value) -> torch.Tensor:
    fill, target = call.tensor(_fill_value(call)), tuple(call.ints(dims, "shape"))
    return fill.expand(target).clone() if target else fill[0].clone()


@static_op("ConstantOfShape")
def constant_of_shape_static(call: Call, dims: np.ndarray) -> Value:
    fill = _fill_value(call)
    if isinstance(fill, torch.Tensor):
        return constant_of_shape(call, dims)
    return np.full(tuple(int(d) for d in dims.reshape(-1)), fill[0], dtype=fill.dtype)


def reshape_target(call: Call, dims: Shape, shape: Value) -> Shape:
    """Reshape's output shape: a 0 copies the input's dimension unless allowzero (opset 14) is set; -1 is
    inferred (by torch/numpy)."""
    target = call.ints(shape, "shape")
    if call.attr("allowzero", 0):
        return tuple(target)
    return tuple(dims[i] if d == 0 else d for i, d in enumerate(target))


@torch_op("Reshape")
@static_op("Reshape")
def reshape(call: Call, x: Value, shape: Value) -> Value:
    return x.reshape(reshape_target(call, _shape(x), shape))


@torch_op("Transpose")
@static_op("Transpose")
def transpose(call: Call, x: Value) -> Value:
    """`perm` defaults to reversing the dimensions."""
    rank = len(x.shape)
    perm = tuple(axes_of(call.attr("perm", list(range(rank))[::-1]), rank))
    return x.permute(perm) if isinstance(x, torch.Tensor) else np.transpose(x, perm)


@torch_op("Flatten")
@static_op("Flatten")
def flatten(call: Call, x: Value) -> Value:
    """To 2-D: (product of the dimensions before `axis` (default 1), product of the rest)."""
    dims = _shape(x)
    axis = axis_of(int(call.attr("axis", 1)), len(dims))
    return x.reshape(math.prod(dims[:axis]), math.prod(dims[axis:]))


def _axes(call: Call, axes: Value | None, since: int) -> list[int] | None:
    """Axes from the input (opset >= `since`) or the attribute (before); None when neither is given."""
    if call.opset >= since:
        return None if axes is None else call.ints(axes, "axes")
    listed = call.attr("axes")
    return None if listed is None else list(listed)


@torch_op("Squeeze")
@static_op("Squeeze")
def squeeze(call: Call, x: Value, axes: Value | None = None) -> Value:
    """Removes the listed size-1 axes (input since opset 13), or every size-1 axis when none are listed."""
    dims = _shape(x)
    listed = _axes(call, axes, 13)
    drop = set(axes_of(listed, len(dims))) if listed else {i for i, d in enumerate(dims) if d == 1}
    return x.reshape(tuple(d for i, d in enumerate(dims) if i not in drop))


@torch_op("Unsqueeze")
@static_op("Unsqueeze")
def unsqueeze(call: Call, x: Value, axes: Value | None = None) -> Value:
    """Inserts size-1 axes at the listed positions of the output (input since opset 13)."""
    dims = list(_shape(x))
    listed = _axes(call, axes, 13) or []
    for axis in sorted(axes_of(listed, len(dims) + len(listed))):
        dims.insert(axis, 1)
    return x.reshape(tuple(dims))


@torch_op("Concat")
def concat(call: Call, *values: Value) -> torch.Tensor:
    return torch.cat(call.tensors(*values), dim=int(call.attr("axis")))


@static_op("Concat")
def concat_static(call: Call, *values: np.ndarray) -> np.ndarray:
    return np.concatenate(values, axis=int(call.attr("axis")))


def split_sizes(call: Call, dim: int, split: Value | None) -> list[int]:
    """`split` is an input from opset 13 (an attribute before); without it, the dimension is cut into as many
    parts as the node has outputs (opset 18 `num_outputs`), of ceil(dim / parts) each, the last one smaller."""
    given = _axes_like(call, split)
    if given:
        return given
    parts = int(call.attr("num_outputs", len(call.node.outputs)))
    chunk = -(-dim // parts)
    return [min(chunk, dim - i * chunk) for i in range(parts)]


def _axes_like(call: Call, split: Value | None) -> list[int]:
    if call.opset >= 13:
        return [] if split is None else call.ints(split, "split")
    return list(call.attr("split", []))


@torch_op("Split")
@static_op("Split")
def split(call: Call, x: Value, sizes: Value | None = None) -> Sequence[Value]:
    axis = axis_of(int(call.attr("axis", 0)), len(x.shape))
    lengths = split_sizes(call, int(x.shape[axis]), sizes)
    if isinstance(x, torch.Tensor):
        return list(torch.split(x, lengths, dim=axis))
    return np.split(x, np.cumsum(lengths)[:-1], axis=axis)


def slice_plan(
    dims: Shape, starts: Sequence[int], ends: Sequence[int], axes: Sequence[int], steps: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """(axis, start, end, step) per sliced axis, clamped as the spec says: negative starts/ends count from the end;
    for a positive step start and end are clamped to [0, dim], for a negative one start to [0, dim-1] and end to
    [-1, dim-1]."""
    plan = []
    for axis, start, end, step in zip(axes_of(axes, len(dims)), starts, ends, steps, strict=True):
        dim = dims[axis]
        start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        plan.append((axis, start, end, step))
    return plan


def _slice_arguments(call: Call, x: Value, inputs: Sequence[Value | None]) -> list[tuple[int, int, int, int]]:
    """Opset >= 10: inputs starts, ends, axes (default all), steps (default 1); before: attributes."""
    if call.opset >= 10:
        starts, ends = call.ints(inputs[0], "starts"), call.ints(inputs[1], "ends")
        axes = call.ints(inputs[2], "axes") if len(inputs) > 2 and inputs[2] is not None else None
        steps = call.ints(inputs[3], "steps") if len(inputs) > 3 and inputs[3] is not None else None
    else:
        starts, ends, axes, steps = list(call.attr("starts")), list(call.attr("ends")), call.attr("axes"), None
    axes = list(range(len(starts))) if axes is None else list(axes)
    return slice_plan(_shape(x), starts, ends, axes, steps or [1] * len(starts))


@torch_op("Slice")
def slice_(call: Call, x: Value, *inputs: Value | None) -> torch.Tensor:
    t = call.tensor(x)
    for axis, start, end, step in _slice_arguments(call, x, inputs):
        if step > 0:
            t = t[(slice(None),) * axis + (slice(start, end, step),)]
            continue
        count = len(range(start, end, step))  # torch slices with positive steps only: take, then flip
        low = start + step * (count - 1)
        part = t[(slice(None),) * axis + (slice(low, start + 1, -step) if count else slice(0, 0),)]
        t = torch.flip(part, [axis])
    return t


@static_op("Slice")
def slice_static(call: Call, x: np.ndarray, *inputs: np.ndarray | None) -> np.ndarray:
    for axis, start, end, step in _slice_arguments(call, x, inputs):
        x = np.take(x, np.arange(start, end, step, dtype=np.int64), axis=axis)
    return x


def expanded_shape(call: Call, dims: Shape, shape: Value) -> Shape:
    """Expand's output: the numpy broadcast of the input's shape and `shape`."""
    return tuple(int(d) for d in np.broadcast_shapes(dims, tuple(call.ints(shape, "shape"))))


@torch_op("Expand")
def expand(call: Call, x: Value, shape: Value) -> torch.Tensor:
    t = call.tensor(x)
    return t.expand(expanded_shape(call, _shape(t), shape))


@static_op("Expand")
def expand_static(call: Call, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    return np.broadcast_to(x, expanded_shape(call, _shape(x), shape)).copy()


@torch_op("Tile")
def tile(call: Call, x: Value, repeats: Value) -> torch.Tensor:
    return torch.tile(call.tensor(x), tuple(call.ints(repeats, "repeats")))


@static_op("Tile")
def tile_static(call: Call, x: np.ndarray, repeats: np.ndarray) -> np.ndarray:
    return np.tile(x, tuple(int(r) for r in repeats.reshape(-1)))


@static_op("Range")
def range_static(call: Call, start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """max(ceil((limit - start) / delta), 0) elements start, start + delta, ... of start's type."""
    count = max(math.ceil((limit.item() - start.item()) / delta.item()), 0)
    return (start + np.arange(count, dtype=start.dtype) * delta).astype(start.dtype)


@torch_op("Range")
def range_(call: Call, start: Value, limit: Value, delta: Value) -> torch.Tensor:
    first, last, step = (call.numbers(v, n)[0] for v, n in ((start, "start"), (limit, "limit"), (delta, "delta")))
    count = max(math.ceil((last - first) / step), 0)
    dtype = call.tensor(start).dtype
    steps = torch.arange(count, device=call.device, dtype=torch.float64 if dtype.is_floating_point else torch.int64)
    return (first + steps * step).to(dtype) if dtype.is_floating_point else (int(first) + steps * int(step)).to(dtype)


_PAD_MODES = ("constant", "reflect", "edge", "wrap")


@torch_op("Pad", check=lambda n: None if n.attr("mode", "constant") in _PAD_MODES else f"mode {n.attr('mode')!r}")
def pad(call: Call, x: Value, *inputs: Value | None) -> torch.Tensor:
    """Opset >= 11: inputs pads ([begin..., end...]), constant_value, axes (opset 18); before: attributes pads,
    value. Modes constant (default), reflect (mirror without the edge), edge, wrap (opset 19). Negative pads
    remove elements."""
    t = call.tensor(x)
    if call.opset >= 11:
        pads = call.ints(inputs[0], "pads")
        constant_input = inputs[1] if len(inputs) > 1 else None
        value = call.numbers(constant_input, "constant_value")[0] if constant_input is not None else 0
        axes = call.ints(inputs[2], "axes") if len(inputs) > 2 and inputs[2] is not None else None
    else:
        pads, value, axes = list(call.attr("pads")), float(call.attr("value", 0.0)), None
    axes = axes_of(axes, t.dim()) if axes is not None else list(range(t.dim()))
    half = len(axes)
    widths = {axis: (pads[k], pads[k + half]) for k, axis in enumerate(axes)}
    mode = str(call.attr("mode", "constant"))
    if mode == "constant":
        flat: list[int] = []
        for i in reversed(range(t.dim())):  # torch lists (begin, end) from the last dimension backwards
            flat += list(widths.get(i, (0, 0)))
        return F.pad(t, flat, value=value) if any(flat) else t
    for axis, (begin, end) in widths.items():
        t = _pad_by_index(t, axis, begin, end, mode)
    return t


def _pad_by_index(t: torch.Tensor, axis: int, begin: int, end: int, mode: str) -> torch.Tensor:
    """Pad one axis in mode reflect, edge or wrap by picking source positions (negative widths crop first)."""
    size = t.shape[axis]
    low, high = max(-begin, 0), size - max(-end, 0)
    t, size = t.narrow(axis, low, high - low), high - low
    begin, end = max(begin, 0), max(end, 0)
    if not begin and not end:
        return t
    positions = np.arange(-begin, size + end)
    if mode == "edge":
        index = np.clip(positions, 0, size - 1)
    elif mode == "wrap":
        index = np.mod(positions, size)
    else:  # reflect: period 2 * (size - 1), mirrored about the edges
        period = max(2 * (size - 1), 1)
        folded = np.mod(positions, period)
        index = np.where(folded >= size, period - folded, folded)
    return torch.index_select(t, axis, as_tensor(index.astype(np.int64)).to(t.device))


def _blocks(call: Call) -> int:
    return int(call.attr("blocksize"))


@torch_op("DepthToSpace")
def depth_to_space(call: Call, x: Value) -> torch.Tensor:
    """(N, C, H, W) -> (N, C / b², H·b, W·b); mode DCR (default: depth, column, row) or CRD."""
    t = call.tensor(x)
    b = _blocks(call)
    n, c, h, w = t.shape
    if str(call.attr("mode", "DCR")) == "CRD":
        blocks = t.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    else:
        blocks = t.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    return blocks.reshape(n, c // (b * b), h * b, w * b)


@torch_op("SpaceToDepth")
def space_to_depth(call: Call, x: Value) -> torch.Tensor:
    """(N, C, H, W) -> (N, C·b², H / b, W / b), the inverse of DepthToSpace in DCR mode."""
    t = call.tensor(x)
    b = _blocks(call)
    n, c, h, w = t.shape
    blocks = t.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)
    return blocks.reshape(n, c * b * b, h // b, w // b)


@torch_op("CenterCropPad")
def center_crop_pad(call: Call, x: Value, shape: Value) -> torch.Tensor:
    """Each listed axis (`axes`, default all) cropped or zero-padded to its target size about the centre; an odd
    difference puts the extra element at the end."""
    t = call.tensor(x)
    targets = call.ints(shape, "shape")
    axes = axes_of(call.attr("axes", list(range(t.dim()))), t.dim())
    for axis, target in zip(axes, targets, strict=True):
        size = t.shape[axis]
        if target < size:
            t = t.narrow(axis, (size - target) // 2, target)
        elif target > size:
            before = (target - size) // 2
            widths = [0, 0] * (t.dim() - 1 - axis) + [before, target - size - before]
            t = F.pad(t, widths)
    return t


@torch_op("Trilu")
def trilu(call: Call, x: Value, k: Value | None = None) -> torch.Tensor:
    """The upper (upper=1, default) or lower triangle of the last two dimensions, from diagonal k (default 0)."""
    t = call.tensor(x)
    diagonal = 0 if k is None else call.ints(k, "k")[0]
    return torch.triu(t, diagonal) if call.attr("upper", 1) else torch.tril(t, diagonal)


@torch_op("EyeLike")
def eye_like(call: Call, x: Value) -> torch.Tensor:
    """A 2-D tensor of the input's shape with ones on diagonal k (default 0), of type `dtype` (default the
    input's)."""
    t = call.tensor(x)
    dtype = torch_dtype(int(call.attr("dtype"))) if call.attr("dtype") is not None else t.dtype
    rows, cols = t.shape
    k = int(call.attr("k", 0))
    grid = torch.arange(cols, device=t.device)[None, :] - torch.arange(rows, device=t.device)[:, None]
    return (grid == k).to(dtype)
