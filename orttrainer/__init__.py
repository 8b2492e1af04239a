"""orttrainer — the ONNX Runtime ``ORTTrainer`` training API, maintained as a standalone package.

Public names: ``ORTTrainer``, ``ORTTrainerOptions``, ``TrainStepInfo``, ``load_onnx_model`` (an ONNX model file read
safely: docs/reliability.md §1) and the sub-modules ``optim``, ``amp``, ``checkpoint`` and ``debug``. The
pure-Python layers (options, model description, optimizer configs, LR schedulers, loss scalers) import without
onnxruntime; ``ORTTrainer`` (and with it onnxruntime) is loaded on first access.
"""

from __future__ import annotations

from . import amp, optim
from .compat.former_names import FORMER_NAMES, install_finder
from .schema.options import ORTTrainerOptions, PropagateCastOpsStrategy
from .train_step_info import TrainStepInfo

install_finder()  # the package's former module names (orttrainer.legacy, orttrainer._utils, ...): orttrainer.compat

__version__ = "0.1.0"

__all__ = [
    "ORTTrainer",
    "load_onnx_model",
    "ORTTrainerOptions",
    "PropagateCastOpsStrategy",
    "TrainStepInfo",
    "amp",
    "checkpoint",
    "debug",
    "optim",
]


def __getattr__(name: str):
    # ORTTrainer pulls in torch.onnx and onnxruntime; importing it lazily keeps `import orttrainer.optim` light.
    if name == "ORTTrainer":
        from .trainer import ORTTrainer

        return ORTTrainer
    if name == "load_onnx_model":  # an ONNX model file, its external data confined to its directory
        from .trainer.build.external_data import load_model

        return load_model
    if name in ("checkpoint", "debug") or f"{__name__}.{name}" in FORMER_NAMES:  # a former name: compat/
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'orttrainer' has no attribute {name!r}")
