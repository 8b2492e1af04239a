"""OnnxModule's random ops: RandomNormal, RandomUniform, their -Like forms, Bernoulli and Multinomial, written from
the ONNX operator specification.

Rule: values are drawn from torch's random generator (as Dropout's masks are, nn.py), so a traced graph holds the
random op and `torch.manual_seed` makes runs repeatable; a node's `seed` attribute does not select a stream (no
two generators give the same numbers, so ONNX's test data cannot be matched value by value — only in
distribution). dtype: the attribute's type (default float, or the input's for the -Like forms; Bernoulli's
default is its input's).
"""

from __future__ import annotations

import torch

from .base import Call, Value, torch_dtype, torch_op


def _dtype(call: Call, like: torch.Tensor | None, default: torch.dtype = torch.float32) -> torch.dtype:
    given = call.attr("dtype")
    if given is not None:
        return torch_dtype(int(given))
    return like.dtype if like is not None else default


def _shape(call: Call, like: torch.Tensor | None) -> tuple[int, ...]:
    return tuple(like.shape) if like is not None else tuple(int(d) for d in call.attr("shape"))


def _normal(call: Call, like: torch.Tensor | None) -> torch.Tensor:
    """mean + scale * N(0, 1) (mean 0, scale 1)."""
    dtype = _dtype(call, like)
    values = torch.randn(_shape(call, like), device=call.device, dtype=torch.float32)
    return (float(call.attr("mean", 0.0)) + float(call.attr("scale", 1.0)) * values).to(dtype)


def _uniform(call: Call, like: torch.Tensor | None) -> torch.Tensor:
    """U[low, high) (low 0, high 1)."""
    dtype = _dtype(call, like)
    low, high = float(call.attr("low", 0.0)), float(call.attr("high", 1.0))
    values = torch.rand(_shape(call, like), device=call.device, dtype=torch.float32)
    return (low + (high - low) * values).to(dtype)


@torch_op("RandomNormal")
def random_normal(call: Call) -> torch.Tensor:
    return _normal(call, None)


@torch_op("RandomUniform")
def random_uniform(call: Call) -> torch.Tensor:
    return _uniform(call, None)


@torch_op("RandomNormalLike")
def random_normal_like(call: Call, x: Value) -> torch.Tensor:
    return _normal(call, call.tensor(x))


@torch_op("RandomUniformLike")
def random_uniform_like(call: Call, x: Value) -> torch.Tensor:
    return _uniform(call, call.tensor(x))


@torch_op("Bernoulli")
def bernoulli(call: Call, x: Value) -> torch.Tensor:
    """1 with probability x, else 0, in `dtype` (default x's type)."""
    p = call.tensor(x)
    drawn = torch.rand(p.shape, device=p.device, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
    return (drawn < p.detach()).to(_dtype(call, p))


@torch_op("Multinomial")
def multinomial(call: Call, x: Value) -> torch.Tensor:
    """(batch, sample_size) class indices drawn with replacement from softmax(x) (x: unnormalized log
    probabilities), int32 by default."""
    logits = call.tensor(x)
    probabilities = torch.softmax(logits.detach().to(torch.float64), dim=-1)
    drawn = torch.multinomial(probabilities, int(call.attr("sample_size", 1)), replacement=True)
    return drawn.to(torch_dtype(int(call.attr("dtype", 6))))
