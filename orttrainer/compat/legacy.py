"""``orttrainer.legacy``, the former name of :mod:`orttrainer.capi` (the older ``onnxruntime.capi.ort_trainer`` API).

The package was renamed because everywhere else "legacy" means the 1.13 ``onnxruntime.training`` API. Rules:

- ``orttrainer.legacy.<name>`` is ``orttrainer.capi.<name>`` (the same objects); ``ORTTrainer`` is loaded on first
  access, as there, so importing this package does not import onnxruntime.
- Every former submodule imports as the renamed module itself (compat/former_names.py): ``trainer`` ->
  ``ort_trainer``, ``arguments`` -> ``argument_mapping``, ``positional`` -> ``input_matching``; ``checkpointing``,
  ``descriptions`` and ``loss_scaler`` kept their names.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..capi import (
    DEFAULT_OPSET_VERSION,
    CombineZeroCheckpoint,
    IODescription,
    LossScaler,
    ModelDescription,
    dtype_torch_to_numpy,
    generate_sample,
    get_checkpoint_name,
    list_checkpoint_files,
    load_checkpoint,
    resolve_symbolic_dimensions,
    save_checkpoint,
)
from .former_names import FORMER_NAMES

__all__ = [
    "DEFAULT_OPSET_VERSION",
    "CombineZeroCheckpoint",
    "IODescription",
    "LossScaler",
    "ModelDescription",
    "ORTTrainer",  # noqa: F822 - served by __getattr__ (lazy, as in orttrainer.capi)
    "dtype_torch_to_numpy",
    "generate_sample",
    "get_checkpoint_name",
    "list_checkpoint_files",
    "load_checkpoint",
    "resolve_symbolic_dimensions",
    "save_checkpoint",
]

__path__: list[str] = []  # a package: its former submodules are served by compat/former_names.py


def __getattr__(name: str) -> Any:
    # ORTTrainer (torch.onnx, onnxruntime) stays lazy, as in orttrainer.capi.
    if name == "ORTTrainer":
        from ..capi.ort_trainer import ORTTrainer

        return ORTTrainer
    if f"orttrainer.legacy.{name}" in FORMER_NAMES:  # `from orttrainer.legacy import arguments`
        return importlib.import_module(f"orttrainer.legacy.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
