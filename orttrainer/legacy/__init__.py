"""Former name of :mod:`orttrainer.capi` (the older ``onnxruntime.capi.ort_trainer`` API), kept as an alias.

The package was renamed because everywhere else "legacy" means the 1.13 ``onnxruntime.training`` API. Rules:

- ``orttrainer.legacy.<name>`` is ``orttrainer.capi.<name>`` (the same objects); ``ORTTrainer`` is loaded on first
  access, as there, so importing this package does not import onnxruntime.
- Every former submodule imports as the renamed module itself (the same module object, registered under both names
  in ``sys.modules``): ``trainer`` -> ``ort_trainer``, ``arguments`` -> ``argument_mapping``, ``positional`` ->
  ``input_matching``; ``checkpointing``, ``descriptions`` and ``loss_scaler`` kept their names.
"""

from __future__ import annotations

import importlib
import sys
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

__all__ = [
    "DEFAULT_OPSET_VERSION",
    "CombineZeroCheckpoint",
    "IODescription",
    "LossScaler",
    "ModelDescription",
    "ORTTrainer",
    "dtype_torch_to_numpy",
    "generate_sample",
    "get_checkpoint_name",
    "list_checkpoint_files",
    "load_checkpoint",
    "resolve_symbolic_dimensions",
    "save_checkpoint",
]

# former submodule -> its module in orttrainer.capi
RENAMED = {
    "trainer": "ort_trainer",
    "arguments": "argument_mapping",
    "positional": "input_matching",
    "checkpointing": "checkpointing",
    "descriptions": "descriptions",
    "loss_scaler": "loss_scaler",
}


def alias_submodule(old_name: str) -> None:
    """Make the former submodule ``old_name`` (``orttrainer.legacy.<x>``) the renamed ``orttrainer.capi`` module.

    Called by the one-line stub modules of this package while they are being imported: the import system returns
    whatever ``sys.modules`` holds under the name once the stub ran, so ``import orttrainer.legacy.trainer`` yields
    ``orttrainer.capi.ort_trainer`` itself.
    """
    short = old_name.rpartition(".")[2]
    sys.modules[old_name] = importlib.import_module(f"orttrainer.capi.{RENAMED[short]}")


def __getattr__(name: str) -> Any:
    # ORTTrainer (torch.onnx, onnxruntime) stays lazy, as in orttrainer.capi.
    if name == "ORTTrainer":
        from ..capi.ort_trainer import ORTTrainer

        return ORTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
