"""The older ONNX Runtime training API, ``onnxruntime.capi.ort_trainer`` (docs/legacy_api.md §14), on orttrainer.

``ORTTrainer(model, loss_fn, model_desc, training_optimizer_name, map_optimizer_attributes,
learning_rate_description, device, ...)`` with ``IODescription``/``ModelDescription``, the legacy ``LossScaler``,
``generate_sample`` and the torch.save checkpoint helpers ``save_checkpoint``/``load_checkpoint``. The trainer is a
thin layer over :class:`orttrainer.ORTTrainer` (its ``ort_trainer`` property): one engine, two calling conventions.

Modules: ``ort_trainer`` (the trainer class), ``argument_mapping`` (constructor arguments -> options and optimizer
config), ``input_matching`` (the older API's positional feeding of ``forward``), ``descriptions``, ``loss_scaler``
and ``checkpointing`` (``onnxruntime.capi.checkpointing_utils``). ``orttrainer.legacy`` is this package's former
name and still imports (an alias).

``orttrainer.compat.install()`` makes ``from onnxruntime.capi.ort_trainer import ...`` resolve here.
"""

from __future__ import annotations

from .argument_mapping import DEFAULT_OPSET_VERSION
from .checkpointing import (
    CombineZeroCheckpoint,
    get_checkpoint_name,
    list_checkpoint_files,
    load_checkpoint,
    save_checkpoint,
)
from .descriptions import (
    IODescription,
    ModelDescription,
    dtype_torch_to_numpy,
    generate_sample,
    resolve_symbolic_dimensions,
)
from .loss_scaler import LossScaler

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


def __getattr__(name: str):
    # The trainer pulls in torch.onnx and onnxruntime; the descriptions and the loss scaler do not need them.
    if name == "ORTTrainer":
        from .ort_trainer import ORTTrainer

        return ORTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
