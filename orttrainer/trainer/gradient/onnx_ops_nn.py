"""OnnxModule's torch ops for neural-network layers: Dropout, normalizations, convolution, pooling and the two
loss ops, written from the ONNX operator specification.

Rules: what a node computes is decided by the graph, never by the module's train/eval mode: Dropout drops only
with a true `training_mode` input (opset >= 12; before, ONNX Runtime runs Dropout as the identity), and
BatchNormalization uses batch statistics only in training mode (`training_mode` from opset 14; before, a node with
more than one output is a training one). Dropout draws its mask with torch's random generator (the traced graph's
random op), so PyTorch's autograd sees the mask it applied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn import functional as F

from .onnx_ops_base import Call, Value, axis_of, torch_op


@torch_op("Dropout")
def dropout(
    call: Call, x: Value, ratio: Value | None = None, training_mode: Value | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Outputs (output, mask). Training: mask = uniform >= ratio (default 0.5), output = x * mask / (1 - ratio);
    otherwise output = x and the mask is all true."""
    t = call.tensor(x)
    training = call.opset >= 12 and bool(call.scalar(training_mode, "training_mode", 0.0))
    p = call.scalar(ratio, "ratio", 0.5) if call.opset >= 12 else float(call.attr("ratio", 0.5))
    if not training or p == 0.0:
        return t, torch.ones_like(t, dtype=torch.bool) if call.wants(1) else None
    keep = torch.rand_like(t) >= p
    return t * keep.to(t.dtype) * (1.0 / (1.0 - p)), keep


def _normalized(t: torch.Tensor, dims: tuple[int, ...], epsilon: float) -> tuple[torch.Tensor, ...]:
    """(normalized, mean, 1 / sqrt(var + epsilon)) over `dims`, with the population variance."""
    mean = t.mean(dim=dims, keepdim=True)
    centered = t - mean
    inv_std = torch.rsqrt((centered * centered).mean(dim=dims, keepdim=True) + epsilon)
    return centered * inv_std, mean, inv_std


@torch_op("LayerNormalization")
def layer_norm(call: Call, x: Value, scale: Value, bias: Value | None = None) -> tuple[torch.Tensor, ...]:
    """Over the dimensions from `axis` (default -1) on; epsilon 1e-5; stash_type 1 (default) computes a float16 or
    bfloat16 input in float32. Outputs Y, Mean, InvStdDev (the last two in the stash type, with the reduced
    dimensions kept as 1)."""
    t = call.tensor(x)
    axis = axis_of(int(call.attr("axis", -1)), t.dim())
    low_precision = t.dtype in (torch.float16, torch.bfloat16)
    computed = t.float() if low_precision and int(call.attr("stash_type", 1)) == 1 else t
    normalized, mean, inv_std = _normalized(computed, tuple(range(axis, t.dim())), float(call.attr("epsilon", 1e-5)))
    y = normalized.to(t.dtype) * call.tensor(scale)
    if bias is not None:
        y = y + call.tensor(bias)
    return y, mean, inv_std


def _channels(v: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against an (N, C, ...) tensor of rank `rank`."""
    return v.reshape((1, -1) + (1,) * (rank - 2))


@torch_op("BatchNormalization")
def batch_norm(
    call: Call, x: Value, scale: Value, bias: Value, mean: Value, var: Value
) -> Sequence[torch.Tensor | None]:
    """Inference: Y = (X - mean) / sqrt(var + epsilon) * scale + B with the given statistics. Training: the batch
    mean and population variance over every dimension but the channel (1); outputs also running_mean = mean *
    momentum + batch_mean * (1 - momentum) and running_var likewise (momentum 0.9), which do not take part in the
    gradient."""
    t, gamma, beta, running_mean, running_var = call.tensors(x, scale, bias, mean, var)
    rank, epsilon = t.dim(), float(call.attr("epsilon", 1e-5))
    training = bool(call.attr("training_mode", 0)) if call.opset >= 14 else len(call.node.outputs) > 1
    if not training:
        inv_std = torch.rsqrt(_channels(running_var, rank) + epsilon)
        normalized = (t - _channels(running_mean, rank)) * inv_std
        return [normalized * _channels(gamma, rank) + _channels(beta, rank)]
    if call.wants(3) or call.wants(4):
        raise call.fail("the saved_mean/saved_var outputs (opsets before 14) are not supported")
    dims = (0, *range(2, rank))
    normalized, batch_mean, inv_std = _normalized(t, dims, epsilon)
    y = normalized * _channels(gamma, rank) + _channels(beta, rank)
    if not (call.wants(1) or call.wants(2)):
        return [y]
    momentum = float(call.attr("momentum", 0.9))
    batch_mean = batch_mean.detach()
    batch_var = ((t.detach() - batch_mean) ** 2).mean(dim=dims)  # the population variance, as ONNX Runtime's
    new_mean = running_mean * momentum + batch_mean.reshape(-1) * (1 - momentum)
    return [y, new_mean, running_var * momentum + batch_var * (1 - momentum)]


def _pads(call: Call, spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]):
    """(begin, end) padding per spatial dimension: `pads` for auto_pad NOTSET (default zeros), none for VALID, and
    for SAME_UPPER/SAME_LOWER what makes the output ceil(input / stride) long (the odd one at the end for UPPER,
    at the beginning for LOWER)."""
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


def _window(call: Call, t: torch.Tensor, kernel: Sequence[int]):
    n = t.dim() - 2
    strides = list(call.attr("strides", [1] * n))
    dilations = list(call.attr("dilations", [1] * n))
    begin, end = _pads(call, list(t.shape[2:]), kernel, strides, dilations)
    return strides, dilations, begin, end


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@torch_op("Conv")
def conv(call: Call, x: Value, w: Value, b: Value | None = None) -> torch.Tensor:
    """1-, 2- and 3-D convolution: strides, dilations (default 1), group (1), pads [begin..., end...] or auto_pad;
    asymmetric pads are applied as zero padding first."""
    t, weight = call.tensors(x, w)
    n = weight.dim() - 2
    if n not in _CONV:
        raise call.fail(f"{n}-D convolution is not supported")
    strides, dilations, begin, end = _window(call, t, list(weight.shape[2:]))
    padding: list[int] | int = begin
    if begin != end:
        t, padding = F.pad(t, _torch_pad(begin, end)), 0
    bias = None if b is None else call.tensor(b)
    return _CONV[n](t, weight, bias, strides, padding, dilations, int(call.attr("group", 1)))


_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _symmetric(begin: Sequence[int], end: Sequence[int], kernel: Sequence[int]) -> bool:
    """torch's pooling pads both ends alike, by at most half the kernel."""
    return list(begin) == list(end) and all(p <= k // 2 for p, k in zip(begin, kernel, strict=True))


@torch_op("MaxPool")
def max_pool(call: Call, x: Value) -> torch.Tensor:
    """kernel_shape, strides (default 1), pads or auto_pad, dilations, ceil_mode; padding never wins the max.
    The Indices output is not supported."""
    if call.wants(1):
        raise call.fail("the Indices output is not supported")
    t = call.tensor(x)
    kernel = list(call.attr("kernel_shape"))
    strides, dilations, begin, end = _window(call, t, kernel)
    ceil_mode = bool(call.attr("ceil_mode", 0))
    pool = _MAX_POOL[len(kernel)]
    if _symmetric(begin, end, kernel):
        return pool(t, kernel, strides, begin, dilations, ceil_mode=ceil_mode)
    padded = F.pad(t, _torch_pad(begin, end), value=float("-inf"))
    return pool(padded, kernel, strides, 0, dilations, ceil_mode=ceil_mode)


@torch_op("AveragePool")
def average_pool(call: Call, x: Value) -> torch.Tensor:
    """kernel_shape, strides, pads or auto_pad, ceil_mode; count_include_pad (default 0) says whether padding
    counts in the divisor. Dilations other than 1 are not supported."""
    t = call.tensor(x)
    kernel = list(call.attr("kernel_shape"))
    strides, dilations, begin, end = _window(call, t, kernel)
    if any(d != 1 for d in dilations):
        raise call.fail("dilations other than 1 are not supported")
    ceil_mode, with_pad = bool(call.attr("ceil_mode", 0)), bool(call.attr("count_include_pad", 0))
    pool: Callable[..., torch.Tensor] = _AVG_POOL[len(kernel)]
    if _symmetric(begin, end, kernel):
        return pool(t, kernel, strides, begin, ceil_mode=ceil_mode, count_include_pad=with_pad)
    padding = _torch_pad(begin, end)
    total = pool(F.pad(t, padding), kernel, strides, 0, ceil_mode=ceil_mode)
    if with_pad:
        return total
    # the mean over the real elements only: the same pooling of a padded all-ones mask counts them
    count = pool(F.pad(torch.ones_like(t[:1, :1]), padding), kernel, strides, 0, ceil_mode=ceil_mode)
    return total / count


@torch_op("GlobalAveragePool")
def global_average_pool(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    return t.mean(dim=tuple(range(2, t.dim())), keepdim=True)


@torch_op("GlobalMaxPool")
def global_max_pool(call: Call, x: Value) -> torch.Tensor:
    t = call.tensor(x)
    return t.amax(dim=tuple(range(2, t.dim())), keepdim=True)


def _nll(call: Call, log_prob: torch.Tensor, target: Value, weight: Value | None) -> torch.Tensor:
    """-log_prob[n, target[n], d...] (times weight[target]), reduced by `reduction` ('mean' default: divided by
    the summed weights of the counted elements; 'sum'; 'none'); elements whose target is `ignore_index` count
    for nothing. The class weights are constants: ONNX Runtime's gradient has no output for them either, and
    torch's nll_loss cannot differentiate them."""
    ignore = call.attr("ignore_index")
    return F.nll_loss(
        log_prob,
        call.tensor(target).to(torch.int64),
        None if weight is None else call.tensor(weight).detach(),
        ignore_index=-100 if ignore is None else int(ignore),
        reduction=str(call.attr("reduction", "mean")),
    )


@torch_op("NegativeLogLikelihoodLoss")
def negative_log_likelihood_loss(call: Call, x: Value, target: Value, weight: Value | None = None) -> torch.Tensor:
    return _nll(call, call.tensor(x), target, weight)


@torch_op("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(
    call: Call, scores: Value, labels: Value, weights: Value | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs (loss, log_prob): log_prob = log_softmax(scores) over the class dimension 1, loss its
    NegativeLogLikelihoodLoss."""
    log_prob = F.log_softmax(call.tensor(scores), dim=1)
    return _nll(call, log_prob, labels, weights), log_prob
