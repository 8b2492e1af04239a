"""OnnxModule's resampling ops: Resize, Upsample, GridSample, AffineGrid and RoiAlign, written from the ONNX
operator specification (and, where the text leaves a detail open, ONNX's backend test data, which
tests/test_onnx_conformance.py compares with).

Resize is separable: each resized axis gets an interpolation matrix (output length x input length) computed in
numpy from shapes and the static scales/sizes/roi — coordinate transformation, nearest rounding, linear or cubic
(coefficient a) weights, antialias filters, exclude_outside, neighbours past the edge repeating the edge — and the
input is multiplied by the matrices, the last resized axis first. tf_crop_and_resize's points outside the input
take extrapolation_value. Nearest picks elements (a gather), so integer types stay exact.

GridSample, RoiAlign and DeformConv (conv.py) sample the input at computed points: the taps around each point are
gathered and weighted (`sample`), so the result is differentiable in the input and, where the points come from
data (GridSample's grid, DeformConv's offsets), in the points.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .base import Call, NodeSpec, Value, axes_of, torch_op

_COORDINATE_MODES = (
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_crop_and_resize",
)
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _resize_check(node: NodeSpec) -> str | None:
    mode = node.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic", "bilinear", "trilinear"):
        return f"mode {mode!r}"
    if node.attr("coordinate_transformation_mode", "half_pixel") not in _COORDINATE_MODES:
        return f"coordinate_transformation_mode {node.attr('coordinate_transformation_mode')!r}"
    if node.attr("nearest_mode", "round_prefer_floor") not in _NEAREST_MODES:
        return f"nearest_mode {node.attr('nearest_mode')!r}"
    if node.attr("keep_aspect_ratio_policy", "stretch") not in ("stretch", "not_larger", "not_smaller"):
        return f"keep_aspect_ratio_policy {node.attr('keep_aspect_ratio_policy')!r}"
    return None


def _source_coordinate(mode: str, x: float, scale: float, size: int, out: int, roi: tuple[float, float]) -> float:
    """Where output position `x` of an axis falls in the input (coordinate_transformation_mode). length_resized
    is the output length `out`; the half-pixel and asymmetric modes divide by the scale factor (given, or out /
    size from sizes). In float32 arithmetic, as ONNX Runtime computes it: a coordinate that is a whole number in
    exact arithmetic stays one, so nearest's rounding modes see the tie they are written for."""
    f = np.float32
    x32, scale32, size32, out32 = f(x), f(scale), f(size), f(out)
    if mode == "align_corners":
        return 0.0 if out == 1 else float(x32 * (size32 - f(1)) / (out32 - f(1)))
    if mode == "asymmetric":
        return float(x32 / scale32)
    if mode == "tf_crop_and_resize":
        start, end = f(roi[0]), f(roi[1])
        if out == 1:
            return float((end - start) * (size32 - f(1)) / f(2) + start * (size32 - f(1)))
        return float(x32 * (end - start) * (size32 - f(1)) / (out32 - f(1)) + start * (size32 - f(1)))
    centred = (x32 + f(0.5)) / scale32 - f(0.5)
    if mode == "pytorch_half_pixel":
        return 0.0 if out == 1 else float(centred)
    if mode == "half_pixel_symmetric":
        return float(size32 / f(2) * (f(1) - out32 / (scale32 * size32)) + centred)
    return float(centred)  # half_pixel


def _nearest(ratio: float, rounding: str) -> tuple[int, np.ndarray]:
    if ratio == 1.0:
        return 0, np.array([0.0, 1.0])
    prefers_ceil = {
        "round_prefer_floor": ratio > 0.5,
        "round_prefer_ceil": ratio >= 0.5,
        "floor": False,
        "ceil": True,
    }[rounding]
    return 0, np.array([0.0, 1.0]) if prefers_ceil else np.array([1.0, 0.0])


def _linear(ratio: float, scale: float, antialias: bool) -> tuple[int, np.ndarray]:
    if not antialias:
        return 0, np.array([1.0 - ratio, ratio])
    scale = min(scale, 1.0)
    start = math.floor(-1 / scale) + 1
    args = (np.arange(start, 2 - start) - ratio) * scale
    weights = np.clip(1 - np.abs(args), 0, 1)
    return start, weights / weights.sum()


def _cubic_weight(x: float, a: float) -> float:
    x = abs(x)
    if x <= 1:
        return (a + 2) * x**3 - (a + 3) * x**2 + 1
    if x < 2:
        return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a
    return 0.0


def _cubic(ratio: float, scale: float, antialias: bool, a: float) -> tuple[int, np.ndarray]:
    if not antialias:
        return -1, np.array([_cubic_weight(d, a) for d in (ratio + 1, ratio, 1 - ratio, 2 - ratio)])
    scale = min(scale, 1.0)
    start = math.floor(-2 / scale) + 1
    weights = np.array([_cubic_weight(scale * (i - ratio), a) for i in range(start, 2 - start)])
    return start, weights / weights.sum()


def _axis_matrix(
    call: Call, size: int, out: int, scale: float, roi: tuple[float, float], mode: str
) -> tuple[np.ndarray, np.ndarray]:
    """(weights (out, size), outside (out,) bool): output i = weights[i] @ input, or extrapolation_value where
    outside[i] (tf_crop_and_resize)."""
    transform = _transform_mode(call)
    exclude = bool(call.attr("exclude_outside", 0))
    antialias = bool(call.attr("antialias", 0)) and mode != "nearest"
    weights = np.zeros((out, size))
    outside = np.zeros(out, dtype=bool)
    for x in range(out):
        source = _source_coordinate(transform, float(x), scale, size, out, roi)
        if transform == "tf_crop_and_resize" and not 0 <= source <= size - 1:
            outside[x] = True
            continue
        base = math.floor(source)
        ratio = 1.0 if source == base else source - base
        base = base - 1 if ratio == 1.0 else base
        if mode == "nearest":
            start, coeffs = _nearest(ratio, _nearest_mode(call))
        elif mode == "cubic":
            start, coeffs = _cubic(ratio, scale, antialias, float(call.attr("cubic_coeff_a", -0.75)))
        else:
            start, coeffs = _linear(ratio, scale, antialias)
        taps = base + start + np.arange(len(coeffs))
        if exclude:
            coeffs = np.where((taps >= 0) & (taps < size), coeffs, 0.0)
            coeffs = coeffs / coeffs.sum()
        np.add.at(weights[x], np.clip(taps, 0, size - 1), coeffs)
    return weights, outside


def _transform_mode(call: Call) -> str:
    if call.node.op_type == "Upsample" or call.opset < 11:
        return "asymmetric"
    return str(call.attr("coordinate_transformation_mode", "half_pixel"))


def _nearest_mode(call: Call) -> str:
    if call.node.op_type == "Upsample" or call.opset < 11:
        return "floor"
    return str(call.attr("nearest_mode", "round_prefer_floor"))


def _interpolation(call: Call) -> str:
    mode = str(call.attr("mode", "nearest"))
    return "linear" if mode in ("bilinear", "trilinear") else mode


def _resize_plan(call: Call, t: torch.Tensor, inputs: Sequence[Value | None]) -> tuple[list, list, list, list]:
    """(axes, output sizes, scales, rois) of the resized axes, from the inputs roi, scales, sizes (opset >= 11;
    scales only before) and the attributes axes and keep_aspect_ratio_policy (opset 18)."""
    rank = t.dim()
    roi_value: Value | None
    scales_value: Value | None
    sizes_value: Value | None
    if call.node.op_type == "Upsample" and call.opset < 9:
        roi_value, scales_value, sizes_value = None, np.array(call.attr("scales"), np.float64), None
    elif call.node.op_type == "Upsample" or call.opset < 11:
        roi_value, scales_value, sizes_value = None, inputs[0], None
    else:
        roi_value, scales_value, sizes_value = (inputs[k] if len(inputs) > k else None for k in range(3))
    axes = axes_of(call.attr("axes", list(range(rank))), rank)
    roi_numbers = call.numbers(roi_value, "roi") if roi_value is not None else []
    n = len(axes)
    rois = [(roi_numbers[k], roi_numbers[n + k]) if roi_numbers else (0.0, 1.0) for k in range(n)]
    sizes_list = call.ints(sizes_value, "sizes") if sizes_value is not None else []
    if sizes_list:
        scales = [o / t.shape[a] for o, a in zip(sizes_list, axes, strict=True)]
        policy = str(call.attr("keep_aspect_ratio_policy", "stretch"))
        if policy != "stretch":
            chosen = min(scales) if policy == "not_larger" else max(scales)
            scales = [chosen] * n
            sizes_list = [int(chosen * t.shape[a] + 0.5) for a in axes]
        return axes, sizes_list, scales, rois
    scales = call.numbers(scales_value, "scales")
    return axes, [int(s * t.shape[a]) for s, a in zip(scales, axes, strict=True)], scales, rois


@torch_op("Resize", "Upsample", check=_resize_check)
def resize(call: Call, x: Value, *inputs: Value | None) -> torch.Tensor:
    t = call.tensor(x)
    axes, sizes, scales, rois = _resize_plan(call, t, inputs)
    mode = _interpolation(call)
    extrapolation = float(call.attr("extrapolation_value", 0.0))
    for axis, out, scale, roi in reversed(list(zip(axes, sizes, scales, rois, strict=True))):
        size = t.shape[axis]
        if out == size and scale == 1.0 and _transform_mode(call) != "tf_crop_and_resize":
            continue
        weights, outside = _axis_matrix(call, size, out, scale, roi, mode)
        t = _apply(call, t, axis, weights, outside, extrapolation, mode == "nearest")
    return t


def _apply(
    call: Call, t: torch.Tensor, axis: int, weights: np.ndarray, outside: np.ndarray, fill: float, pick: bool
) -> torch.Tensor:
    """Output i along `axis` = weights[i] @ input (a gather when each row has one 1), `fill` where outside[i]."""
    if pick and ((weights == 0) | (weights == 1)).all() and (weights.sum(axis=1)[~outside] == 1).all():
        index = call.tensor(np.where(outside, 0, weights.argmax(axis=1)).astype(np.int64))
        result = torch.index_select(t, axis, index)
    else:
        matrix = call.tensor(weights).to(torch.float64 if t.dtype == torch.float64 else torch.float32)
        moved = torch.movedim(t, axis, -1)
        product = torch.matmul(moved.to(matrix.dtype), matrix.T)
        result = torch.movedim(product, -1, axis)
        if not t.dtype.is_floating_point:
            info = torch.iinfo(t.dtype)
            result = torch.clamp(torch.round(result), info.min, info.max)
        result = result.to(t.dtype)
    if outside.any():
        shape = [1] * t.dim()
        shape[axis] = len(outside)
        mask = call.tensor(outside.reshape(shape))
        result = torch.where(mask, torch.full((), fill, dtype=result.dtype, device=result.device), result)
    return result


def sample(
    image: torch.Tensor,
    points: torch.Tensor,
    offsets: Sequence[int],
    weight: Callable[[torch.Tensor, int], torch.Tensor],
    index: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """(N, C, *P): image (N, C, *S) sampled at `points` (N, *P, n), pixel coordinates in S's order. Around each
    point, the taps floor(point) + offset per dimension (every combination) are read with `index(tap, dim)` ->
    (clamped index, valid mask) and weighted by `weight(point - floor(point) - offset, dim)` (a tensor per
    dimension)."""
    n = points.shape[-1]
    batch, channels, spatial = image.shape[0], image.shape[1], image.shape[2:]
    flat = image.reshape(batch, channels, -1)
    base = torch.floor(points)
    fraction = points - base
    steps = [int(math.prod(spatial[d + 1 :])) for d in range(n)]
    total = None
    for combination in itertools.product(offsets, repeat=n):
        position = torch.zeros(points.shape[:-1], dtype=torch.int64, device=image.device)
        w = torch.ones(points.shape[:-1], dtype=image.dtype, device=image.device)
        for d, k in enumerate(combination):
            tap, valid = index(base[..., d].to(torch.int64) + k, d)
            position = position + tap * steps[d]
            w = w * weight(fraction[..., d] - k, d).to(image.dtype) * valid.to(image.dtype)
        picked = torch.gather(flat, 2, position.reshape(batch, 1, -1).expand(batch, channels, -1))
        term = picked.reshape(batch, channels, *points.shape[1:-1]) * w.unsqueeze(1)
        total = term if total is None else total + term
    assert total is not None
    return total


def sample_linear(image: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Multilinear sampling at pixel coordinates; taps outside the input read 0 (DeformConv's rule)."""
    spatial = image.shape[2:]

    def index(tap: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        valid = (tap >= 0) & (tap < spatial[d])
        return torch.clamp(tap, 0, spatial[d] - 1), valid

    return sample(image, points, (0, 1), lambda f, d: 1 - torch.abs(f), index)


def _reflect(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """x reflected at `low` and `high` until it lies between them (GridSample's padding_mode=reflection)."""
    span = high - low
    below, above = low - x, x - high
    distance = torch.where(x < low, below, above)
    count = torch.floor(distance / span) if span > 0 else torch.zeros_like(distance)
    rest = distance - count * span
    even = torch.remainder(count, 2) == 0
    from_low = torch.where(even, low + rest, high - rest)
    from_high = torch.where(even, high - rest, low + rest)
    return torch.where(x < low, from_low, torch.where(x > high, from_high, x))


def _cubic_tensor(f: torch.Tensor, a: float = -0.75) -> torch.Tensor:
    """Keys' cubic convolution weight of a tap at distance |f| (a = -0.75)."""
    x = torch.abs(f)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x <= 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


_GRID_MODES = {"bilinear": "linear", "linear": "linear", "nearest": "nearest", "bicubic": "cubic", "cubic": "cubic"}


def _grid_check(node: NodeSpec) -> str | None:
    if node.attr("mode", "linear" if node.opset >= 20 else "bilinear") not in _GRID_MODES:
        return f"mode {node.attr('mode')!r}"
    padding = node.attr("padding_mode", "zeros")
    return None if padding in ("zeros", "border", "reflection") else f"padding_mode {padding!r}"


@torch_op("GridSample", check=_grid_check)
def grid_sample(call: Call, x: Value, grid: Value) -> torch.Tensor:
    """X (N, C, *S) sampled at grid (N, *P, n), coordinates in [-1, 1] listed from the last spatial dimension
    (x, y[, z]): align_corners maps -1 and 1 to the corner pixels' centres (else their outer edges); mode
    (bi)linear, nearest (halves to even) or (bi)cubic; padding_mode zeros (taps outside read 0), border (taps
    outside read the edge; the point itself stays, which matters for cubic's weights, as in ONNX Runtime) or
    reflection (points and taps reflected at the border)."""
    t, g = call.tensors(x, grid)
    mode = _GRID_MODES[str(call.attr("mode", "linear" if call.opset >= 20 else "bilinear"))]
    padding = str(call.attr("padding_mode", "zeros"))
    align = bool(call.attr("align_corners", 0))
    spatial = t.shape[2:]
    n = len(spatial)
    coordinates = []
    for d in range(n):
        size = spatial[d]
        normalized = g[..., n - 1 - d].to(t.dtype)
        point = (normalized + 1) / 2 * (size - 1) if align else ((normalized + 1) * size - 1) / 2
        if mode == "nearest":
            point = torch.round(point)
        if padding == "reflection":
            low, high = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
            point = _reflect(point, low, high)
        coordinates.append(point)
    points = torch.stack(coordinates, dim=-1)

    def index(tap: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = spatial[d]
        if padding == "zeros":
            return torch.clamp(tap, 0, size - 1), (tap >= 0) & (tap < size)
        if padding == "border":
            return torch.clamp(tap, 0, size - 1), torch.ones_like(tap, dtype=torch.bool)
        low, high = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        reflected = torch.trunc(_reflect(tap.to(torch.float64), low, high)).to(torch.int64)
        return torch.clamp(reflected, 0, size - 1), torch.ones_like(tap, dtype=torch.bool)

    if mode == "nearest":
        return sample(t, points, (0,), lambda f, d: torch.ones_like(f), index)
    if mode == "cubic":
        return sample(t, points, (-1, 0, 1, 2), lambda f, d: _cubic_tensor(f), index)
    return sample(t, points, (0, 1), lambda f, d: 1 - torch.abs(f), index)


@torch_op("AffineGrid")
def affine_grid(call: Call, theta: Value, size: Value) -> torch.Tensor:
    """(N, *S, n) sampling grid: theta (N, n, n + 1) applied to the normalized coordinates (x, y[, z], 1) of each
    output position; align_corners puts -1 and 1 at the corner pixels' centres (else at their outer edges)."""
    matrix = call.tensor(theta)
    dims = call.ints(size, "size")
    spatial = dims[2:]
    align = bool(call.attr("align_corners", 0))
    axes = []
    for s in reversed(spatial):  # x first: the last spatial dimension
        steps = np.arange(s, dtype=np.float64)
        axes.append((2 * steps / (s - 1) - 1) if align and s > 1 else (2 * steps + 1) / s - 1)
    grids = np.meshgrid(*reversed(axes), indexing="ij")  # in spatial order
    base = np.stack([*reversed(grids), np.ones(tuple(spatial))], axis=-1)  # (*S, n + 1): x, y, (z,) 1
    homogeneous = call.tensor(base).to(matrix.dtype)
    return torch.einsum("...k,njk->n...j", homogeneous, matrix)


def _roi_align_check(node: NodeSpec) -> str | None:
    if node.attr("mode", "avg") not in ("avg", "max"):
        return f"mode {node.attr('mode')!r}"
    transform = node.attr("coordinate_transformation_mode", "half_pixel")
    return None if transform in ("half_pixel", "output_half_pixel") else f"coordinate_transformation_mode {transform!r}"


@torch_op("RoiAlign", check=_roi_align_check)
def roi_align(call: Call, x: Value, rois: Value, batch_indices: Value) -> torch.Tensor:
    """(R, C, output_height, output_width): each ROI (x1, y1, x2, y2, times spatial_scale; shifted by half a
    pixel in half_pixel mode, else at least 1 pixel wide) split into bins, each bin the average (or max) of
    sampling_ratio² bilinear samples (ceil(roi / bins) per side when 0); samples beyond one pixel outside the
    input count 0. The boxes must be known (static, or run eagerly)."""
    t = call.tensor(x)
    boxes = call.array(rois, "rois")
    images = [int(v) for v in call.array(batch_indices, "batch_indices").reshape(-1)]
    out_h, out_w = int(call.attr("output_height", 1)), int(call.attr("output_width", 1))
    half_pixel = call.opset >= 16 and call.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    height, width = t.shape[2], t.shape[3]
    flat = t.reshape(t.shape[0], t.shape[1], -1)
    results = []
    for box, image in zip(boxes, images, strict=True):
        positions, weights, count = _roi_samples(call, box, height, width, out_h, out_w, half_pixel)
        taps = flat[image][:, call.tensor(positions)]  # (C, bins, samples, 4)
        weighted = taps * call.tensor(weights).to(t.dtype)
        if call.attr("mode", "avg") == "max":
            results.append(weighted.amax(dim=-1).amax(dim=-1))
        else:
            results.append(weighted.sum(dim=(-1, -2)) / count)
    return torch.stack(results).reshape(len(images), t.shape[1], out_h, out_w)


def _roi_samples(
    call: Call, box: np.ndarray, height: int, width: int, out_h: int, out_w: int, half_pixel: bool
) -> tuple[np.ndarray, np.ndarray, int]:
    """(positions (bins, samples, 4) flat indices, weights alike, samples per bin) of one ROI."""
    scale = float(call.attr("spatial_scale", 1.0))
    offset = 0.5 if half_pixel else 0.0
    x1, y1, x2, y2 = (float(v) * scale - offset for v in box)
    roi_w, roi_h = x2 - x1, y2 - y1
    if not half_pixel:
        roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
    bin_h, bin_w = roi_h / out_h, roi_w / out_w
    ratio = int(call.attr("sampling_ratio", 0))
    grid_h = ratio if ratio > 0 else math.ceil(roi_h / out_h)
    grid_w = ratio if ratio > 0 else math.ceil(roi_w / out_w)
    positions = np.zeros((out_h * out_w, max(grid_h * grid_w, 1), 4), dtype=np.int64)
    weights = np.zeros(positions.shape)
    for b, (ph, pw) in enumerate(itertools.product(range(out_h), range(out_w))):
        for s, (iy, ix) in enumerate(itertools.product(range(grid_h), range(grid_w))):
            y = y1 + ph * bin_h + (iy + 0.5) * bin_h / grid_h
            xx = x1 + pw * bin_w + (ix + 0.5) * bin_w / grid_w
            if y < -1.0 or y > height or xx < -1.0 or xx > width:
                continue
            (y_low, y_high, ly), (x_low, x_high, lx) = _bilinear_taps(y, height), _bilinear_taps(xx, width)
            positions[b, s] = [
                y_low * width + x_low,
                y_low * width + x_high,
                y_high * width + x_low,
                y_high * width + x_high,
            ]
            weights[b, s] = [(1 - ly) * (1 - lx), (1 - ly) * lx, ly * (1 - lx), ly * lx]
    return positions, weights, max(grid_h * grid_w, 1)


def _bilinear_taps(v: float, size: int) -> tuple[int, int, float]:
    """(low, high, fraction) of a RoiAlign sample along one axis: clamped at 0, and at the last pixel."""
    v = max(v, 0.0)
    low = int(v)
    if low >= size - 1:
        return size - 1, size - 1, 0.0
    return low, low + 1, v - low


@torch_op("MaxRoiPool")
def max_roi_pool(call: Call, x: Value, rois: Value) -> torch.Tensor:
    """(R, C, *pooled_shape): each ROI (batch index, x1, y1, x2, y2; times spatial_scale, rounded half away
    from zero, both corners included) split into pooled_shape bins (floor and ceil of the fractional bin edges,
    clamped to the input), each bin's maximum (0 for an empty bin). The boxes must be known (static, or run
    eagerly)."""
    t = call.tensor(x)
    boxes = call.array(rois, "rois")
    pooled_h, pooled_w = (int(v) for v in call.attr("pooled_shape"))
    scale = float(call.attr("spatial_scale", 1.0))
    height, width = t.shape[2], t.shape[3]
    results = []
    for batch, *corners in boxes.tolist():
        x1, y1, x2, y2 = (int(math.floor(abs(v * scale) + 0.5)) * (1 if v >= 0 else -1) for v in corners)
        bin_h, bin_w = max(y2 - y1 + 1, 1) / pooled_h, max(x2 - x1 + 1, 1) / pooled_w
        bins = []
        for ph, pw in itertools.product(range(pooled_h), range(pooled_w)):
            h0 = min(max(math.floor(ph * bin_h) + y1, 0), height)
            h1 = min(max(math.ceil((ph + 1) * bin_h) + y1, 0), height)
            w0 = min(max(math.floor(pw * bin_w) + x1, 0), width)
            w1 = min(max(math.ceil((pw + 1) * bin_w) + x1, 0), width)
            region = t[int(batch), :, h0:h1, w0:w1]
            empty = h1 <= h0 or w1 <= w0
            bins.append(torch.zeros(t.shape[1], dtype=t.dtype, device=t.device) if empty else region.amax(dim=(1, 2)))
        results.append(torch.stack(bins, dim=-1).reshape(t.shape[1], pooled_h, pooled_w))
    return torch.stack(results) if results else t.new_zeros((0, t.shape[1], pooled_h, pooled_w))
