"""The older API's `LossScaler` (docs/legacy_api.md §14.2) and its bridge to the new trainer's `amp.LossScaler`.

Rules:
- `LossScaler(loss_scale_input_name, is_dynamic_scale, loss_scale=2**16, up_scale_window=2000, min_loss_scale=1.0,
  max_loss_scale=2**24)` keeps the legacy attribute names with trailing underscores.
- `update_loss_scale(is_all_finite)` does nothing when the scale is static; otherwise it applies exactly the rule of
  `amp.DynamicLossScaler.update` (grow ×2 after `up_scale_window` finite steps, capped at `max_loss_scale`; halve
  on overflow, floored at `min_loss_scale`). It returns nothing, as in the original.
- The older trainer runs on the new one, which feeds `options.mixed_precision.loss_scaler.loss_scale` and calls its
  `update(train_step_info)` after a mixed-precision optimizer step. `as_new_loss_scaler` adapts a legacy scaler to
  that contract; `CallerFedLossScale` carries the scale a caller passes as an input (no scaler given).
"""

from __future__ import annotations

from typing import Any

from ..amp import loss_scaler as amp_scaler


class LossScaler:
    """Loss scale for mixed precision, dynamic (`is_dynamic_scale=True`) or static."""

    def __init__(
        self,
        loss_scale_input_name: str,
        is_dynamic_scale: bool,
        loss_scale: float = float(1 << 16),
        up_scale_window: int = 2000,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = float(1 << 24),
    ) -> None:
        self.loss_scale_input_name_ = loss_scale_input_name
        self.is_dynamic_scale_ = is_dynamic_scale
        self.initial_loss_scale_ = loss_scale
        self.up_scale_window_ = up_scale_window
        self.min_loss_scale_ = min_loss_scale
        self.max_loss_scale_ = max_loss_scale
        self.loss_scale_ = loss_scale
        self.stable_steps_ = 0

    def update_loss_scale(self, is_all_finite: Any) -> None:
        """Apply one step's all-finite flag (a bool or a one-element tensor/array) to a dynamic scale."""
        if not self.is_dynamic_scale_:
            return
        if amp_scaler._is_all_finite(is_all_finite):
            self.stable_steps_ += 1
            if self.stable_steps_ >= self.up_scale_window_:
                self.loss_scale_ = min(self.max_loss_scale_, self.loss_scale_ * 2)
                self.stable_steps_ = 0
        else:
            self.loss_scale_ = max(self.min_loss_scale_, self.loss_scale_ / 2)
            self.stable_steps_ = 0

    def reset(self) -> None:
        """Back to the initial scale, with no stable steps counted."""
        self.loss_scale_ = self.initial_loss_scale_
        self.stable_steps_ = 0


class _LegacyScalerAsNew(amp_scaler.LossScaler):
    """A legacy `LossScaler` seen through the new `amp.LossScaler` interface; the legacy object holds the state."""

    def __init__(self, legacy: LossScaler) -> None:
        self._legacy = legacy
        super().__init__(legacy.loss_scale_)

    @property
    def loss_scale(self) -> float:
        return float(self._legacy.loss_scale_)

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._legacy.loss_scale_ = amp_scaler._check_loss_scale(value)

    def reset(self) -> None:
        self._legacy.reset()

    def update(self, train_step_info: Any) -> float:
        self._legacy.update_loss_scale(train_step_info.all_finite)
        return self.loss_scale


class CallerFedLossScale(amp_scaler.LossScaler):
    """The scale the caller passes with each `train_step` (set by the older trainer before the step); `update`
    leaves it alone — the caller reads `all_finite` from the outputs and picks the next scale."""

    def __init__(self) -> None:
        super().__init__(float(1 << 16))

    def update(self, train_step_info: Any) -> float:
        """The scale as the caller last set it (unchanged)."""
        return self.loss_scale


def as_new_loss_scaler(loss_scaler: LossScaler | None) -> amp_scaler.LossScaler:
    """The `options.mixed_precision.loss_scaler` the new trainer drives for the older one."""
    if loss_scaler is None:
        return CallerFedLossScale()
    if not isinstance(loss_scaler, LossScaler):
        raise TypeError(
            f"loss_scaler must be an onnxruntime.capi.ort_trainer.LossScaler (orttrainer.capi."
            f"LossScaler), got {type(loss_scaler).__name__}"
        )
    return _LegacyScalerAsNew(loss_scaler)
