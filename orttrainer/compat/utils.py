"""Legacy ``onnxruntime.training._utils``: state-dict key names, device and dtype helpers.

The key functions name the levels of a trainer state dict and of a checkpoint file (docs/legacy_api.md §9.1); they
return the constants of :mod:`orttrainer.checkpoint.layout`, where the layout is described once.
``dtype_onnx_to_torch`` is fixed: legacy mapped UINT8 to ``torch.int8`` and BFLOAT16 to the nonexistent
``torch.bfloat`` (an ``AttributeError``); here they map to ``torch.uint8`` and ``torch.bfloat16``.
The dtype tables start from :mod:`orttrainer.dtypes` and list where legacy departs from it. This module never
imports onnxruntime.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch
from onnx import TensorProto

from ..checkpoint import layout
from ..dtypes import ELEMENT_TYPES

# --- state-dict key names (§9.1): the legacy accessors of checkpoint.layout ---------------------------------------


def state_dict_model_key() -> str:
    """Key of the model states: ``state_dict['model'][precision][weight]``."""
    return layout.MODEL


def state_dict_optimizer_key() -> str:
    """Key of the optimizer states: ``state_dict['optimizer'][weight][state]``."""
    return layout.OPTIMIZER


def state_dict_partition_info_key() -> str:
    """Key of the ZeRO/Megatron partition map: ``state_dict['partition_info'][weight]``."""
    return layout.PARTITION_INFO


def state_dict_trainer_options_key() -> str:
    """Key of the trainer options saved with the states."""
    return layout.TRAINER_OPTIONS


def state_dict_full_precision_key() -> str:
    """Precision key of the fp32 master weights (``'fp32'`` before ≈1.7)."""
    return layout.FULL_PRECISION


def state_dict_original_dimension_key() -> str:
    """Key of a partitioned weight's original shape inside ``partition_info[weight]``."""
    return layout.ORIGINAL_DIM


def state_dict_sharded_optimizer_keys() -> set[str]:
    """Optimizer states that ZeRO partitions (concatenated again on aggregation); a new set on every call."""
    return set(layout.SHARDED_OPTIMIZER_KEYS)


def state_dict_user_dict_key() -> str:
    """Key of the pickled (hex string) user dict inside a checkpoint file."""
    return layout.USER_DICT


def state_dict_trainer_options_mixed_precision_key() -> str:
    """``trainer_options`` key: whether the run used mixed precision."""
    return layout.MIXED_PRECISION


def state_dict_trainer_options_zero_stage_key() -> str:
    """``trainer_options`` key: the DeepSpeed ZeRO stage (0: no partitioning)."""
    return layout.ZERO_STAGE


def state_dict_trainer_options_world_rank_key() -> str:
    """``trainer_options`` key: the rank that saved the states."""
    return layout.WORLD_RANK


def state_dict_trainer_options_world_size_key() -> str:
    """``trainer_options`` key: the number of ranks of the run."""
    return layout.WORLD_SIZE


def state_dict_trainer_options_data_parallel_size_key() -> str:
    """``trainer_options`` key: the data-parallel group size (absent before ≈1.7)."""
    return layout.DATA_PARALLEL_SIZE


def state_dict_trainer_options_horizontal_parallel_size_key() -> str:
    """``trainer_options`` key: the Megatron (horizontal) group size (absent before ≈1.7)."""
    return layout.HORIZONTAL_PARALLEL_SIZE


def state_dict_trainer_options_optimizer_name_key() -> str:
    """``trainer_options`` key: the optimizer's name (``'AdamOptimizer'``, ...)."""
    return layout.OPTIMIZER_NAME


def state_dict_train_step_info_key() -> str:
    """Key of the saved ``TrainStepInfo`` counters."""
    return layout.TRAIN_STEP_INFO


def state_dict_train_step_info_optimization_step_key() -> str:
    """``train_step_info`` key: the number of optimizer updates."""
    return layout.OPTIMIZATION_STEP


def state_dict_train_step_info_step_key() -> str:
    """``train_step_info`` key: the number of ``train_step`` calls."""
    return layout.TRAIN_STEP


# --- devices ------------------------------------------------------------------------------------------------------


def get_device_index(device: str | int | torch.device) -> int:
    """Index of a device: an ``int`` as is, a string through ``torch.device``; no index (``'cpu'``) gives 0."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    return 0 if device.index is None else device.index


def get_device_index_from_input(input: Any) -> int:
    """Device index of a tensor, or of the first tensor of a list or tuple."""
    if isinstance(input, (list, tuple)):
        return get_device_index(input[0].device)
    return get_device_index(input.device)


# --- dtypes -------------------------------------------------------------------------------------------------------

# The element-type table (orttrainer.dtypes) plus legacy's departures from it, which user code relies on: numpy has
# no bfloat16 and no complex32, so legacy mapped them to the nearest type that numpy and ORT's
# NumpyTypeToOnnxRuntimeType both accept; and it gave int64 as `np.longlong` (the same width, a distinct type object).
_TORCH_TO_NUMPY: dict[torch.dtype, type] = {t.torch: t.numpy for t in ELEMENT_TYPES if t.numpy is not None} | {
    torch.bfloat16: np.float16,
    torch.complex32: np.complex64,
    torch.int64: np.longlong,
}


def dtype_torch_to_numpy(torch_dtype: torch.dtype) -> type:
    """numpy scalar type for a torch dtype (legacy table, docs/legacy_api.md §10); others raise ValueError."""
    try:
        return _TORCH_TO_NUMPY[torch_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"torch_dtype ({torch_dtype}) type is not supported by Numpy") from None


# The ONNX TensorProto.DataType names in number order, as legacy listed them (it stops at BFLOAT16 = 16).
_ONNX_TYPES = tuple(TensorProto.DataType.Name(number) for number in range(TensorProto.BFLOAT16 + 1))

# The element-type table plus legacy's entries outside it: UNDEFINED and STRING have no torch dtype, and torch lacked
# uint16/32/64 when legacy wrote its table, so those keep its signed mapping.
_ONNX_TO_TORCH: dict[str, Any] = {TensorProto.DataType.Name(t.onnx): t.torch for t in ELEMENT_TYPES} | {
    "UNDEFINED": None,
    "STRING": str,
    "UINT16": torch.int16,
    "UINT32": torch.int32,
    "UINT64": torch.int64,
}


def dtype_onnx_to_torch(onnx_type: int | str) -> Any:
    """torch dtype for an ONNX ``DataType`` given as its number or (case-insensitive) name.

    Rules: out-of-range numbers raise ``AssertionError("Invalid onnx_type integer")``, unknown names
    ``AssertionError("Invalid onnx_type string")``, other argument types ``ValueError``. ``UNDEFINED`` gives None,
    ``STRING`` gives ``str``.
    """
    if isinstance(onnx_type, bool) or not isinstance(onnx_type, (int, str)):
        raise ValueError("'onnx_type' must be an ONNX type represented by either a string or integer")
    if isinstance(onnx_type, int):
        if not 0 <= onnx_type < len(_ONNX_TYPES):
            raise AssertionError("Invalid onnx_type integer")
        name = _ONNX_TYPES[onnx_type]
    else:
        name = onnx_type.upper()
        if name not in _ONNX_TO_TORCH:
            raise AssertionError("Invalid onnx_type string")
    return _ONNX_TO_TORCH[name]


# --- misc ---------------------------------------------------------------------------------------------------------


def static_vars(**kwargs: Any) -> Callable[[Callable], Callable]:
    """Decorator setting ``kwargs`` as attributes of the decorated function (function-level "static" state)."""

    def decorate(func: Callable) -> Callable:
        for key, value in kwargs.items():
            setattr(func, key, value)
        return func

    return decorate


def import_module_from_file(file_path: str, module_name: str | None = None) -> ModuleType:
    """Import a Python file as a module, register it in ``sys.modules`` and return it.

    The module name defaults to the file's base name up to its first dot. Bad arguments raise AssertionError
    (legacy messages); a file Python cannot import (no ``.py``-like suffix) raises ImportError (legacy crashed with an
    AttributeError).
    """
    if not (isinstance(file_path, str) and os.path.exists(file_path)):
        raise AssertionError("'file_path' must be a full path string with the python file to load")
    if not (module_name is None or (isinstance(module_name, str) and module_name)):
        raise AssertionError("'module_name' must be a string with the python module name to load")
    module_name = module_name or os.path.basename(file_path).split(".")[0]
    spec = importlib.util.spec_from_file_location(module_name, file_path)
    if spec is None or spec.loader is None:  # a file name without a Python source or extension-module suffix
        raise ImportError(f"{file_path} cannot be imported as a Python module", path=file_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
