"""Loss scalers for mixed precision: the scale the loss is multiplied by before the fp16 backward pass.

The trainer feeds ``loss_scaler.loss_scale`` to the training graph (input ``loss_scaler.input_name``) and, after a
mixed-precision optimizer step, calls ``loss_scaler.update(train_step_info)`` with the graph's all-finite flag in
``train_step_info.all_finite``.

Behaviour follows the legacy ``onnxruntime.training.amp.loss_scaler`` (release 1.13.1), messages included.
"""

from __future__ import annotations

from typing import Any

from .._require import require as _require

__all__ = ["LossScaler", "DynamicLossScaler"]


def _check_loss_scale(loss_scale: Any) -> float:
    _require(isinstance(loss_scale, (int, float)) and loss_scale > 0, "'loss_scale' must be a positive float")
    return float(loss_scale)


def _is_all_finite(flag: Any) -> bool:
    """Read an all-finite flag given as a bool, a numpy bool, or a one-element array / tensor.

    The trainer stores the graph's output here (a one-element bool tensor), so ``bool()`` does the work; a
    one-element list or tuple is unwrapped first because ``bool([False])`` would be True.
    """
    if isinstance(flag, (list, tuple)):
        if len(flag) != 1:
            raise ValueError(f"all_finite must hold exactly one value, got {flag!r}")
        flag = flag[0]
    return bool(flag)


class LossScaler:
    r"""Base class of loss-scaling strategies.

    Subclasses implement :meth:`update`. The base class holds the current scale (always a ``float``), the scale
    given at construction (restored by :meth:`reset`) and the name of the graph input that receives the scale.

    Args:
        loss_scale: initial scale, an int or float > 0 (stored as ``float``).
    """

    def __init__(self, loss_scale: float) -> None:
        self._loss_scale = _check_loss_scale(loss_scale)
        self._initial_loss_scale = self._loss_scale
        self._input_name: str | None = None

    @property
    def input_name(self) -> str | None:
        """Name of the training graph input fed with :attr:`loss_scale`; set by the trainer at session creation."""
        return self._input_name

    @input_name.setter
    def input_name(self, input_name: str) -> None:
        # Some legacy releases asserted `not input_name`, which rejected every real name; this is the 1.13.1 check.
        _require(isinstance(input_name, str), "'input_name' must be a string")
        _require(len(input_name) > 0, "'input_name' cannot be empty")
        self._input_name = input_name

    @property
    def loss_scale(self) -> float:
        """Current loss scale."""
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, loss_scale: float) -> None:
        self._loss_scale = _check_loss_scale(loss_scale)

    def reset(self) -> None:
        """Restore the loss scale given at construction."""
        self._loss_scale = self._initial_loss_scale

    def update(self, train_step_info: Any) -> float:
        """Update the scale from ``train_step_info`` (a :class:`orttrainer.TrainStepInfo`) and return it."""
        raise NotImplementedError


class DynamicLossScaler(LossScaler):
    r"""Dynamic loss scaling: grow the scale while gradients stay finite, shrink it on overflow.

    :meth:`update`, when ``automatic_update`` is True::

        if all_finite:
            stable_steps += 1
            if stable_steps >= up_scale_window:
                loss_scale = min(max_loss_scale, 2 * loss_scale); stable_steps = 0
        else:
            loss_scale = max(min_loss_scale, loss_scale / 2); stable_steps = 0
        return loss_scale

    With ``automatic_update=False`` the scale is static: :meth:`update` returns it unchanged (set
    :attr:`loss_scale` yourself to change it).

    Args:
        automatic_update: default **True**: :meth:`update` (called by the trainer after each mixed-precision
            optimizer step) applies the rule above. (The legacy docstring wrongly said the default was False.)
        loss_scale: initial scale, default ``2**16``.
        up_scale_window: number of consecutive finite steps before the scale doubles, default 2000.
        min_loss_scale: lower bound when halving, default 1.0.
        max_loss_scale: upper bound when doubling, default ``2**24``.

    As in the legacy API, only ``loss_scale`` is validated; the other arguments are stored as given.
    """

    def __init__(
        self,
        automatic_update: bool = True,
        loss_scale: float = float(1 << 16),
        up_scale_window: int = 2000,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = float(1 << 24),
    ) -> None:
        super().__init__(loss_scale)
        self.automatic_update = automatic_update
        self.up_scale_window = up_scale_window
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self._stable_steps_count = 0

    def reset(self) -> None:
        """Restore the initial scale and forget the count of stable steps."""
        super().reset()
        self._stable_steps_count = 0

    def update(self, train_step_info: Any) -> float:
        """Apply the rule in the class docstring to ``train_step_info.all_finite`` and return the new scale."""
        if not self.automatic_update:
            return self.loss_scale
        if _is_all_finite(train_step_info.all_finite):
            self._grow()
        else:
            self._shrink()
        return self.loss_scale

    def _grow(self) -> None:
        self._stable_steps_count += 1
        if self._stable_steps_count >= self.up_scale_window:
            self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2)
            self._stable_steps_count = 0

    def _shrink(self) -> None:
        self.loss_scale = max(self.min_loss_scale, self.loss_scale / 2)
        self._stable_steps_count = 0
