"""OnnxModule's torch ops for neural-network layers: Dropout, the normalizations and the two loss ops, written from
the ONNX operator specification (convolution and pooling: `onnx_ops_conv.py`).

Rules: what a node computes is decided by the graph, never by the module's train/eval mode: Dropout drops only
with a true `training_mode` input (opset >= 12; before, ONNX Runtime runs Dropout as the identity), and
BatchNormalization uses batch statistics only in training mode (`training_mode` from opset 14; before, a node with
more than one output is a training one). Dropout draws its mask with torch's random generator (the traced graph's
random op), so PyTorch's autograd sees the mask it applied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from .base import Call, Value, axis_of, torch_op


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
