"""A pass-through that observes a tensor's forward value and, in backward, its gradient."""

from __future__ import annotations

from collections.abc import Callable

import torch

Observer = Callable[[torch.Tensor], object]  # what it returns is ignored (a writer returns its path)


class _GradientTap(torch.autograd.Function):
    """Identity whose backward shows the incoming gradient to ``on_backward`` before passing it on unchanged."""

    @staticmethod
    def forward(ctx, on_backward: Observer, tensor: torch.Tensor) -> torch.Tensor:
        ctx.on_backward = on_backward
        # A detached alias, not the input itself: autograd forbids in-place ops on views made inside a Function,
        # and modules such as ReLU(inplace=True) modify the previous module's output in place.
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.on_backward(grad.detach())
        return None, grad


def tap(tensor: torch.Tensor, on_forward: Observer, on_backward: Observer | None) -> torch.Tensor:
    """Call ``on_forward(tensor)`` now and return a tensor equal to ``tensor``.

    When autograd will differentiate through it (grad mode on and ``tensor.requires_grad``) and ``on_backward`` is
    given, the returned tensor is a new alias whose gradient is shown to ``on_backward`` during backward;
    otherwise ``tensor`` itself is returned. Observers run synchronously, so no copy of the tensor is kept.
    """
    on_forward(tensor.detach())
    if on_backward is None or not (torch.is_grad_enabled() and tensor.requires_grad):
        return tensor
    return _GradientTap.apply(on_backward, tensor)
