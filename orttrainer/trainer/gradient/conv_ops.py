"""The per-position convolution weight gradient of gradient/torch_decompositions.py as a PyTorch custom op:
`orttrainer::conv_weight_gradient(x, g, kernel, stride, padding, dilation)` computes what
`torch_decompositions.weight_gradient_per_offset` computes (its eager kernel is that function) and is traced as one
node. The decomposition is about 40 traced ops per convolution (a slice pair, a reshape and a batched product per
kernel position, then a stack, a sum and a permute), each paid through AOTAutograd's functionalization, proxy and fake
tensors; the direct translation writes the same ONNX nodes from the one node (gradient/aten_onnx.py
`_conv_weight_gradient`). Traces for torch.onnx keep the decomposition.

Imported, and so registered, by `torch_decompositions.conv_ops()` when a trace first writes the op.
"""

from __future__ import annotations

import torch

from .torch_decompositions import weight_gradient_per_offset

__all__ = ["conv_weight_gradient"]


@torch.library.custom_op("orttrainer::conv_weight_gradient", mutates_args=())
def conv_weight_gradient(
    x: torch.Tensor, g: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int]
) -> torch.Tensor:
    """The weight gradient [g's channels, x's channels, *kernel] of a convolution without groups whose input is `x`
    and whose output's gradient is `g` (`weight_gradient_per_offset`)."""
    return weight_gradient_per_offset(x, g, kernel, stride, padding, dilation).contiguous()


@conv_weight_gradient.register_fake
def _conv_weight_gradient_shape(x, g, kernel, stride, padding, dilation):  # noqa: ANN001, ANN202 - torch.library's signature
    return x.new_empty((g.shape[1], x.shape[1], *kernel))
