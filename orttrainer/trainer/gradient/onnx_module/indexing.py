"""OnnxModule's indexing ops: Gather, GatherElements, GatherND, Scatter, ScatterElements, ScatterND, OneHot,
ReverseSequence, and the ops whose output shape depends on values — Compress, NonZero, Unique,
NonMaxSuppression — written from the ONNX operator specification.

Rules: negative indices count from the end of their axis. Index tensors may come from data (the selection is a
graph computation, differentiable in the selected values). The value-shaped ops need their deciding input's
values: a static value, or a tensor when run eagerly; while the torch builder traces, a deciding input computed
from data is an error naming the node (`base.Call.numbers`) — no trace can give an output a size decided by
values. Their outputs that select elements (Compress, Unique's Y) are gathers from the input, so they keep the
gradient.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import Call, NodeSpec, Value, as_tensor, axis_of, static_op, torch_op


def _wrapped(index: torch.Tensor, size: int) -> torch.Tensor:
    index = index.to(torch.int64)
    return torch.where(index < 0, index + size, index)


@torch_op("Gather")
def gather(call: Call, data: Value, indices: Value) -> torch.Tensor:
    """Along `axis` (default 0). Output shape: data.shape[:axis] + indices.shape + data.shape[axis+1:]."""
    t = call.tensor(data)
    axis = axis_of(int(call.attr("axis", 0)), t.dim())
    index = _wrapped(call.tensor(indices), t.shape[axis])
    picked = torch.index_select(t, axis, index.reshape(-1))
    return picked.reshape(tuple(t.shape[:axis]) + tuple(index.shape) + tuple(t.shape[axis + 1 :]))


@static_op("Gather")
def gather_static(call: Call, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return np.take(data, indices.astype(np.int64), axis=int(call.attr("axis", 0)))


@torch_op("GatherElements")
def gather_elements(call: Call, data: Value, indices: Value) -> torch.Tensor:
    t, index = call.tensors(data, indices)
    axis = axis_of(int(call.attr("axis", 0)), t.dim())
    return torch.gather(t, axis, _wrapped(index, t.shape[axis]))


def _linear_index(index: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Row-major positions of the coordinates in `index`'s last dimension (negative ones wrapped) in `dims`."""
    position = torch.zeros(index.shape[:-1], dtype=torch.int64, device=index.device)
    for k, size in enumerate(dims):
        position = position * size + _wrapped(index[..., k], size)
    return position


@torch_op("GatherND")
def gather_nd(call: Call, data: Value, indices: Value) -> torch.Tensor:
    """data[b..., index...] for each index tuple in `indices`' last dimension, the first `batch_dims` dimensions
    shared by data and indices. Output: batch dims + indices.shape[batch_dims:-1] + the rest of data's."""
    t, index = call.tensors(data, indices)
    b = int(call.attr("batch_dims", 0))
    k = index.shape[-1]
    batch, rest = tuple(t.shape[:b]), tuple(t.shape[b + k :])
    flat = t.reshape(math.prod(batch), math.prod(t.shape[b : b + k]), *rest)
    where = _linear_index(index.to(torch.int64), tuple(t.shape[b : b + k])).reshape(math.prod(batch), -1)
    rows = torch.arange(flat.shape[0], device=t.device).unsqueeze(1)
    return flat[rows, where].reshape(*batch, *index.shape[b:-1], *rest)


_REDUCTIONS = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _reduction_check(node: NodeSpec) -> str | None:
    reduction = node.attr("reduction", "none")
    return None if reduction == "none" or reduction in _REDUCTIONS else f"reduction {reduction!r}"


def _scatter(target: torch.Tensor, axis: int, index: torch.Tensor, updates: torch.Tensor, reduction: str):
    if reduction == "none":
        return target.scatter(axis, index, updates)
    return target.scatter_reduce(axis, index, updates, reduce=_REDUCTIONS[reduction], include_self=True)


@torch_op("ScatterElements", "Scatter", check=_reduction_check)
def scatter_elements(call: Call, data: Value, indices: Value, updates: Value) -> torch.Tensor:
    """A copy of data with updates[i...] written to (or combined by `reduction`, opset 16, into) the element
    whose index along `axis` (default 0) is indices[i...]. Scatter (opsets 9-10) is the same without reduction."""
    t, index, values = call.tensors(data, indices, updates)
    axis = axis_of(int(call.attr("axis", 0)), t.dim())
    return _scatter(t, axis, _wrapped(index, t.shape[axis]), values, str(call.attr("reduction", "none")))


@torch_op("ScatterND", check=_reduction_check)
def scatter_nd(call: Call, data: Value, indices: Value, updates: Value) -> torch.Tensor:
    """A copy of data with updates written to (or combined into) the slices data[index...] named by the index
    tuples in `indices`' last dimension."""
    t, index, values = call.tensors(data, indices, updates)
    k = index.shape[-1]
    rest = tuple(t.shape[k:])
    flat = t.reshape(math.prod(t.shape[:k]), *rest)
    where = _linear_index(index.to(torch.int64), tuple(t.shape[:k])).reshape(-1)
    rows = values.reshape(-1, *rest)
    spread = where.reshape(-1, *([1] * len(rest))).expand(rows.shape)
    return _scatter(flat, 0, spread, rows, str(call.attr("reduction", "none"))).reshape(t.shape)


@torch_op("OneHot")
def one_hot(call: Call, indices: Value, depth: Value, values: Value) -> torch.Tensor:
    """values[1] where the new axis (`axis`, default -1) equals the index (negative ones wrapped by depth),
    values[0] elsewhere; indices outside [-depth, depth - 1] give a row of values[0]."""
    index = call.tensor(indices)
    size = int(call.numbers(depth, "depth")[0])
    off_on = call.tensor(values)
    index = index.to(torch.int64) if not index.dtype.is_floating_point else index.trunc().to(torch.int64)
    index = torch.where(index < 0, index + size, index)
    axis = axis_of(int(call.attr("axis", -1)), index.dim() + 1)
    classes = torch.arange(size, device=index.device).reshape((size,) + (1,) * (index.dim() - axis))
    hit = index.unsqueeze(axis) == classes
    return torch.where(hit, off_on[1], off_on[0])


@torch_op("ReverseSequence")
def reverse_sequence(call: Call, x: Value, lengths: Value) -> torch.Tensor:
    """For each batch entry b (along `batch_axis`, default 1), the first lengths[b] elements along `time_axis`
    (default 0) reversed; the rest stay."""
    t, lens = call.tensors(x, lengths)
    batch_axis, time_axis = int(call.attr("batch_axis", 1)), int(call.attr("time_axis", 0))
    steps = t.shape[time_axis]
    time = torch.arange(steps, device=t.device).reshape([-1 if d == time_axis else 1 for d in range(t.dim())])
    length = lens.to(torch.int64).reshape([-1 if d == batch_axis else 1 for d in range(t.dim())])
    source = torch.where(time < length, length - 1 - time, time)
    return torch.gather(t, time_axis, source.expand(t.shape))


@torch_op("Compress")
def compress(call: Call, x: Value, condition: Value) -> torch.Tensor:
    """The slices along `axis` (flattened input without it) whose condition is true; the condition may be
    shorter than the axis."""
    t = call.tensor(x)
    keep = np.flatnonzero(np.asarray(call.numbers(condition, "condition"), dtype=bool))
    axis = call.attr("axis")
    source, dim = (t.reshape(-1), 0) if axis is None else (t, axis_of(int(axis), t.dim()))
    return torch.index_select(source, dim, as_tensor(keep.astype(np.int64)).to(t.device))


@torch_op("NonZero")
def non_zero(call: Call, x: Value) -> torch.Tensor:
    """The coordinates of the non-zero elements, (rank, count) int64, in row-major order."""
    values = call.array(x, "X")
    return as_tensor(np.array(np.nonzero(values), dtype=np.int64).reshape(values.ndim, -1)).to(call.device)


@static_op("NonZero")
def non_zero_static(call: Call, x: np.ndarray) -> np.ndarray:
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


@torch_op("Unique")
def unique(call: Call, x: Value) -> tuple[torch.Tensor, ...]:
    """Y (the unique elements, or slices along `axis`), indices (first occurrences), inverse_indices, counts;
    sorted ascending (sorted=1, default) or in order of first occurrence."""
    t = call.tensor(x)
    values = call.array(x, "X")
    axis = call.attr("axis")
    flat = values.reshape(-1) if axis is None else values
    dim = 0 if axis is None else axis_of(int(axis), values.ndim)
    _, first, inverse, counts = np.unique(flat, return_index=True, return_inverse=True, return_counts=True, axis=dim)
    if not call.attr("sorted", 1):
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
    source = t.reshape(-1) if axis is None else t
    picked = torch.index_select(source, dim, as_tensor(first.astype(np.int64)).to(t.device))
    return picked, *(as_tensor(a.reshape(-1).astype(np.int64)).to(t.device) for a in (first, inverse, counts))


@torch_op("NonMaxSuppression")
def non_max_suppression(
    call: Call,
    boxes: Value,
    scores: Value,
    max_output: Value | None = None,
    iou_threshold: Value | None = None,
    score_threshold: Value | None = None,
) -> torch.Tensor:
    """Per batch and class: boxes by descending score (ties: lower index first), above score_threshold when
    given, each kept unless its IoU with a kept box exceeds iou_threshold, at most max_output_boxes_per_class
    (default 0) of them. Output rows (batch, class, box), int64. center_point_box=1: boxes are (x, y, w, h)
    centres, else (y1, x1, y2, x2) corners in either order."""
    corners = _corners(call.array(boxes, "boxes"), int(call.attr("center_point_box", 0)))
    score = call.array(scores, "scores")
    limit = max(int(call.scalar(max_output, "max_output_boxes_per_class", 0)), 0)
    iou_limit = call.scalar(iou_threshold, "iou_threshold", 0.0)
    floor = None if score_threshold is None else call.scalar(score_threshold, "score_threshold", 0.0)
    selected = []
    for b in range(score.shape[0]):
        for c in range(score.shape[1]):
            kept: list[int] = []
            for i in np.argsort(-score[b, c], kind="stable"):
                if len(kept) >= limit:
                    break
                if floor is not None and not score[b, c, i] > floor:
                    continue
                if all(_iou(corners[b, i], corners[b, j]) <= iou_limit for j in kept):
                    kept.append(int(i))
                    selected.append((b, c, int(i)))
    return as_tensor(np.array(selected, dtype=np.int64).reshape(-1, 3)).to(call.device)


def _corners(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """(x_min, y_min, x_max, y_max) of each box."""
    if center_point_box:
        x, y, w, h = np.moveaxis(boxes.astype(np.float64), -1, 0)
        return np.stack([x - w / 2, y - h / 2, x + w / 2, y + h / 2], axis=-1)
    y1, x1, y2, x2 = np.moveaxis(boxes.astype(np.float64), -1, 0)
    return np.stack([np.minimum(x1, x2), np.minimum(y1, y2), np.maximum(x1, x2), np.maximum(y1, y2)], axis=-1)


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two corner boxes (0 when they do not overlap or one has no area)."""
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    if width <= 0 or height <= 0:
        return 0.0
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    area_a, area_b = (a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1])
    return float(inter / union) if area_a > 0 and area_b > 0 and union > 0 else 0.0
