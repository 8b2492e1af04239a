"""Optimizer configurations and learning-rate schedulers (pure Python: no torch, no onnxruntime).

Same names as the legacy ``onnxruntime.training.optim``; the sub-modules ``config`` and ``lr_scheduler`` are
importable as ``orttrainer.optim.config`` and ``orttrainer.optim.lr_scheduler``.
"""

from __future__ import annotations

from . import config, lr_scheduler
from .config import AdamConfig, LambConfig, SGDConfig, _OptimizerConfig
from .lr_scheduler import (
    ConstantWarmupLRScheduler,
    CosineWarmupLRScheduler,
    LinearWarmupLRScheduler,
    PolyWarmupLRScheduler,
    _LRScheduler,
)

__all__ = [
    "_OptimizerConfig",
    "AdamConfig",
    "LambConfig",
    "SGDConfig",
    "_LRScheduler",
    "ConstantWarmupLRScheduler",
    "CosineWarmupLRScheduler",
    "LinearWarmupLRScheduler",
    "PolyWarmupLRScheduler",
    "config",
    "lr_scheduler",
]
