"""``inspect_activation(name, tensor)``: record any intermediate tensor, forward value and gradient.

Rules:

* The call goes to the manager whose root forward is running (innermost), else to ``GlobalSubscriberManager``;
  there every subscriber that handles inspection (``StatisticsSubscriber``) records it, in subscription order.
  Without one: ``RuntimeError("StatisticsSubscriber is not registered, cannot inspect activation.")`` (legacy).
* Files are ``<name>_forward``/``<name>_backward`` in the current step, depth -1 (no ``>`` prefix), and only for
  steps in the subscriber's ``[start_step, end_step)`` (decision: legacy ignored the range).
* Names must be unique within a step: a second call with the same name raises ``ValueError`` naming both call sites
  (``file:line``), in every step, in range or not (legacy silently overwrote the first file).
* The returned tensor has the input's value and ``requires_grad``; the gradient passes through unchanged. When no
  gradient can flow (``no_grad`` or a tensor without ``requires_grad``) the input object itself is returned.
* Inside ``no_increase_global_step()`` it only returns the tensor.
"""

from __future__ import annotations

import os
import sys

import torch

from .subscriber import current_manager


def inspect_activation(activation_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Pass ``tensor`` through, recording its statistics (and in backward its gradient's) under ``activation_name``."""
    if (
        not isinstance(activation_name, str)
        or not activation_name
        or os.sep in activation_name
        or activation_name in (".", "..")
    ):
        raise ValueError(f"activation_name must be a non-empty string usable as a file name, got {activation_name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"inspect_activation({activation_name!r}, ...) expects a torch.Tensor, got {type(tensor).__name__}"
        )
    return current_manager().inspect(activation_name, tensor, _caller_site())


def _caller_site() -> str:
    frame = sys._getframe(2)  # 0: here, 1: inspect_activation, 2: the user's call
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
