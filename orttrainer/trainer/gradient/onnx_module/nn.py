"""OnnxModule's neural-network layers other than convolution and pooling: Dropout, the normalizations
(BatchNormalization, LayerNormalization, InstanceNormalization, GroupNormalization, LRN,
MeanVarianceNormalization, LpNormalization) and the two loss ops, written from the ONNX operator specification.

Rules: what a node computes is decided by the graph, never by the module's train/eval mode: Dropout drops only
with a true `training_mode` input (opset >= 12; before, Dropout is the identity, as ONNX Runtime runs it), and
BatchNormalization uses batch statistics only in training mode (`training_mode` from opset 14; before, a node with
more than one output is a training one). Dropout draws its mask with torch's random generator (the traced graph's
random op), so PyTorch's autograd sees the mask it applied. Variances are population variances (the spec's), also
in BatchNormalization's running variance.

Running statistics: a training-mode BatchNormalization outputs running_mean = mean·momentum +
batch_mean·(1 - momentum) and running_var likewise (momentum 0.9); they take no part in the gradient. When its
mean and variance inputs are buffers of the module (frozen initializers), the module also writes the new values
into those buffers after the forward (`Call.update`; module.py: `statistics`), as PyTorch's BatchNorm does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.nn import functional as F

from .base import Call, NodeSpec, Value, axes_of, axis_of, torch_op


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
    keep = torch.rand_like(t, dtype=torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype) >= p
    return t * keep.to(t.dtype) * (1.0 / (1.0 - p)), keep


def _normalized(t: torch.Tensor, dims: tuple[int, ...], epsilon: float) -> tuple[torch.Tensor, ...]:
    """(normalized, mean, 1 / sqrt(var + epsilon)) over `dims`, with the population variance."""
    mean = t.mean(dim=dims, keepdim=True)
    centered = t - mean
    inv_std = torch.rsqrt((centered * centered).mean(dim=dims, keepdim=True) + epsilon)
    return centered * inv_std, mean, inv_std


def _stashed(t: torch.Tensor, stash_type: int) -> torch.Tensor:
    """The input in the computation type: stash_type 1 (float) computes float16 and bfloat16 in float32."""
    return t.float() if stash_type == 1 and t.dtype in (torch.float16, torch.bfloat16) else t


@torch_op("LayerNormalization")
def layer_norm(call: Call, x: Value, scale: Value, bias: Value | None = None) -> tuple[torch.Tensor, ...]:
    """Over the dimensions from `axis` (default -1) on; epsilon 1e-5; stash_type 1 (default) computes a float16 or
    bfloat16 input in float32. Outputs Y, Mean, InvStdDev (the last two in the stash type, with the reduced
    dimensions kept as 1). (Also ONNX Runtime's contrib op of the same name in the default domain, which models
    of opsets before 17 hold: the same computation.)"""
    t = call.tensor(x)
    axis = axis_of(int(call.attr("axis", -1)), t.dim())
    computed = _stashed(t, int(call.attr("stash_type", 1)))
    normalized, mean, inv_std = _normalized(computed, tuple(range(axis, t.dim())), float(call.attr("epsilon", 1e-5)))
    y = normalized.to(t.dtype) * call.tensor(scale)
    if bias is not None:
        y = y + call.tensor(bias)
    return y, mean, inv_std


def _per_channel(v: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-channel parameter (C) or, for BatchNormalization-7 with spatial=0, per-activation (C, D1, ...)
    shaped to broadcast against an (N, C, ...) tensor of rank `rank`."""
    return v.reshape((1, *v.shape) + (1,) * (rank - 1 - v.dim()))


def batch_norm_training(node: NodeSpec) -> bool:
    """Whether a BatchNormalization node computes batch statistics: `training_mode` from opset 14; before, when
    it has more than one output (the training form's running and saved statistics)."""
    if node.opset >= 14:
        return bool(node.attr("training_mode", 0))
    return len(node.outputs) > 1


@torch_op("BatchNormalization")
def batch_norm(
    call: Call, x: Value, scale: Value, bias: Value, mean: Value, var: Value
) -> Sequence[torch.Tensor | None]:
    """Inference: Y = (X - mean) / sqrt(var + epsilon) * scale + B with the given statistics. Training: the batch
    mean and population variance over every dimension but the channel (1) (only N for BatchNormalization-7 with
    spatial=0); outputs Y, the running mean and variance (module docstring) and, before opset 14, saved_mean (the
    batch mean) and saved_var — the spec calls it the saved variance "used to speed up gradient computation";
    ONNX Runtime, which evaluates the model, writes 1 / sqrt(batch variance + epsilon) there, and so does this."""
    t, gamma, beta, running_mean, running_var = call.tensors(x, scale, bias, mean, var)
    rank, epsilon = t.dim(), float(call.attr("epsilon", 1e-5))
    if not batch_norm_training(call.node):
        inv_std = torch.rsqrt(_per_channel(running_var, rank) + epsilon)
        normalized = (t - _per_channel(running_mean, rank)) * inv_std
        return [normalized * _per_channel(gamma, rank) + _per_channel(beta, rank)]
    spatial = call.opset >= 9 or bool(call.attr("spatial", 1))
    dims = (0, *range(2, rank)) if spatial else (0,)
    normalized, batch_mean, inv_std = _normalized(t, dims, epsilon)
    y = normalized * _per_channel(gamma, rank) + _per_channel(beta, rank)
    momentum = float(call.attr("momentum", 0.9))
    batch_mean = batch_mean.detach().reshape(running_mean.shape)
    batch_var = ((t.detach() - batch_mean.reshape(_per_channel(running_mean, rank).shape)) ** 2).mean(dim=dims)
    batch_var = batch_var.reshape(running_var.shape)
    new_mean = running_mean.detach() * momentum + batch_mean * (1 - momentum)
    new_var = running_var.detach() * momentum + batch_var * (1 - momentum)
    call.update(mean, new_mean)
    call.update(var, new_var)
    saved_inv_std = inv_std.detach().reshape(running_var.shape)
    return [y, new_mean, new_var, batch_mean, saved_inv_std][: max(len(call.node.outputs), 1)]


@torch_op("InstanceNormalization")
def instance_norm(call: Call, x: Value, scale: Value, bias: Value) -> torch.Tensor:
    """Per instance and channel over the spatial dimensions: scale * (x - mean) / sqrt(var + epsilon) + B."""
    t, gamma, beta = call.tensors(x, scale, bias)
    normalized, _, _ = _normalized(t, tuple(range(2, t.dim())), float(call.attr("epsilon", 1e-5)))
    return normalized * _per_channel(gamma, t.dim()) + _per_channel(beta, t.dim())


@torch_op("GroupNormalization")
def group_norm(call: Call, x: Value, scale: Value, bias: Value) -> torch.Tensor:
    """Per instance over each of `num_groups` groups of channels (and the spatial dimensions), then scale and
    bias: one per group (opset 18) or per channel (opset 21, which also has stash_type)."""
    t, gamma, beta = call.tensors(x, scale, bias)
    groups = int(call.attr("num_groups"))
    n, channels = t.shape[0], t.shape[1]
    computed = _stashed(t, int(call.attr("stash_type", 1)))
    grouped = computed.reshape(n, groups, -1)
    normalized, _, _ = _normalized(grouped, (2,), float(call.attr("epsilon", 1e-5)))
    normalized = normalized.reshape(t.shape).to(t.dtype)
    if call.opset < 21:
        gamma, beta = (v.repeat_interleave(channels // groups) for v in (gamma, beta))
    return normalized * _per_channel(gamma, t.dim()) + _per_channel(beta, t.dim())


@torch_op("LRN")
def lrn(call: Call, x: Value) -> torch.Tensor:
    """x / (bias + alpha / size * square_sum)^beta, square_sum over the channels c - floor((size - 1) / 2) to
    c + ceil((size - 1) / 2) (alpha 1e-4, beta 0.75, bias 1)."""
    t = call.tensor(x)
    size = int(call.attr("size"))
    alpha, beta, bias = float(call.attr("alpha", 1e-4)), float(call.attr("beta", 0.75)), float(call.attr("bias", 1.0))
    before, after = (size - 1) // 2, math.ceil((size - 1) / 2)
    squares = F.pad(t * t, [0, 0] * (t.dim() - 2) + [before, after])
    channels = t.shape[1]
    square_sum = sum(squares.narrow(1, k, channels) for k in range(size))
    return t / (bias + alpha / size * square_sum) ** beta


@torch_op("MeanVarianceNormalization")
def mean_variance_normalization(call: Call, x: Value) -> torch.Tensor:
    """(X - E[X]) / (sqrt(E[X²] - E[X]²) + 1e-9) over `axes` (default [0, 2, 3])."""
    t = call.tensor(x)
    dims = tuple(axes_of(call.attr("axes", [0, 2, 3]), t.dim()))
    mean = t.mean(dim=dims, keepdim=True)
    std = torch.sqrt((t * t).mean(dim=dims, keepdim=True) - mean * mean)
    return (t - mean) / (std + 1e-9)


@torch_op("LpNormalization")
def lp_normalization(call: Call, x: Value) -> torch.Tensor:
    """x / (sum |x|^p)^(1/p) along `axis` (default -1), p 1 or 2 (default)."""
    t = call.tensor(x)
    p = int(call.attr("p", 2))
    dim = axis_of(int(call.attr("axis", -1)), t.dim())
    norm = t.abs().sum(dim=dim, keepdim=True) if p == 1 else torch.sqrt((t * t).sum(dim=dim, keepdim=True))
    return t / norm


def _nll(call: Call, log_prob: torch.Tensor, target: Value, weight: Value | None) -> torch.Tensor:
    """-log_prob[n, target[n], d...] (times weight[target]), reduced by `reduction` ('mean' default: divided by
    the summed weights of the counted elements; 'sum'; 'none'); elements whose target is `ignore_index` count
    for nothing. The class weights are constants: ONNX Runtime's gradient has no output for them either, and
    torch's nll_loss cannot differentiate them."""
    ignore = call.attr("ignore_index")
    return F.nll_loss(
        log_prob.contiguous(),  # torch's 2-D nll_loss backward refuses a strided input
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
