"""Legacy import path: ``onnxruntime.training.orttrainer_options`` lives on as ``orttrainer.orttrainer_options``.

The implementation is :mod:`orttrainer.schema.options`; this module only re-exports it so that code and tests
written as ``from onnxruntime.training import orttrainer_options`` keep working after a rename of the package.
"""

from __future__ import annotations

from ..schema.options import (
    _ORTTRAINER_OPTIONS_SCHEMA,
    ORTTrainerOptions,
    ORTTrainerOptionsValidator,
    PropagateCastOpsStrategy,
    _ORTTrainerOptionsInternal,
)

__all__ = [
    "_ORTTRAINER_OPTIONS_SCHEMA",
    "ORTTrainerOptions",
    "ORTTrainerOptionsValidator",
    "PropagateCastOpsStrategy",
    "_ORTTrainerOptionsInternal",
]
