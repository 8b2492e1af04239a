"""Loss scaling for mixed-precision training (pure Python: no torch, no onnxruntime).

Same names as the legacy ``onnxruntime.training.amp``; the sub-module is importable as
``orttrainer.amp.loss_scaler``.
"""

from __future__ import annotations

from . import loss_scaler
from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["LossScaler", "DynamicLossScaler", "loss_scaler"]
