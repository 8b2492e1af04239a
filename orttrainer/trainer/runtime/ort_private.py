"""Every private or version-sensitive ONNX Runtime API orttrainer uses, behind small functions.

Rule: nothing else in orttrainer imports `onnxruntime.capi._pybind_state`, calls `InferenceSession._sess` or reads
`OrtValue._get_c_value()`; it calls these wrappers. An ONNX Runtime upgrade that moves or changes one of them then
breaks this file (and `tests/test_ort_private.py`, which pins each wrapper), not the trainer.

Two groups:
- values and sessions (every ONNX Runtime build): C-level `OrtValue`s shared with torch through DLPack, runs that
  return owned `OrtValue`s, the global random seed;
- the training build only (`onnxruntime-training`): the pre-training graph transformers, `GradientGraphBuilder`
  and `OrtModuleGraphBuilder`, used by the 'ort' gradient builder (`gradient/ort_builder.py`, `ort_options.py`).

Verified on onnxruntime-training 1.19.2 (CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np


def _capi() -> Any:
    from onnxruntime.capi import _pybind_state

    return _pybind_state


# --------------------------------------------------------------------------------------------- values and sessions
def owned_ortvalue(array: np.ndarray, device_type: str, device_index: int) -> Any:
    """A C-level OrtValue that owns a copy of `array` on the device.

    Why a copy: `OrtValue.ortvalue_from_numpy` shares the numpy buffer, and only the Python wrapper keeps it alive
    (docs/engine.md §2.3), so the value is allocated by ONNX Runtime and the data copied in."""
    import onnxruntime as ort

    array = np.ascontiguousarray(array).reshape(np.shape(array))  # ascontiguousarray makes a 0-d array 1-d
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype, device_type, device_index)
    value.update_inplace(array)
    return value._get_c_value()


def ortvalue_from_torch(tensor: Any) -> Any:
    """A C-level OrtValue sharing the memory of a contiguous torch tensor, through DLPack.

    Why two spellings: onnxruntime-training 1.19 takes `from_dlpack(capsule, is_bool)` and rejects DLPack's bool
    type ("Unsupported code 6"), so a bool tensor goes as a uint8 view flagged as bool; the maintained onnxruntime
    (verified 1.32) takes `from_dlpack(capsule)` and reads bool itself (docs/engine.md §10)."""
    import torch

    from_dlpack = _capi().OrtValue.from_dlpack
    if _from_dlpack_takes_bool_flag():
        if tensor.dtype == torch.bool:
            return from_dlpack(torch.utils.dlpack.to_dlpack(tensor.view(torch.uint8)), True)
        return from_dlpack(torch.utils.dlpack.to_dlpack(tensor), False)
    return from_dlpack(torch.utils.dlpack.to_dlpack(tensor))


@functools.cache
def _from_dlpack_takes_bool_flag() -> bool:
    return "is_bool_tensor" in (_capi().OrtValue.from_dlpack.__doc__ or "")


def run_with_ort_values(session: Any, feeds: dict[str, Any], fetches: Sequence[str], run_options: Any) -> list:
    """Run an `onnxruntime.InferenceSession` on C-level OrtValues; the results are new, owned OrtValues (never
    views of the feeds, docs/engine.md §3.2)."""
    return list(session._sess.run_with_ort_values(feeds, list(fetches), run_options))


def set_seed(seed: int) -> None:
    """Seed ONNX Runtime's process-global random generator (Dropout masks)."""
    _capi().set_seed(seed)


# ---------------------------------------------------------------------------------------------- training build
def has_training_build() -> bool:
    """Whether the installed onnxruntime is the training build (it has the gradient graph builders)."""
    try:
        capi = _capi()
    except ImportError:
        return False
    return all(hasattr(capi, name) for name in ("GradientGraphBuilder", "get_optimized_model", "OrtModuleGraphBuilder"))


def pre_training_optimized_model(model_bytes: bytes, requires_grad: set[str], session_options: Any) -> bytes:
    """The serialized model after ONNX Runtime's pre-training graph transformers (fusions, cast propagation with
    its default configuration)."""
    return _capi().get_optimized_model(model_bytes, requires_grad, session_options)


def gradient_graph(model_bytes: bytes, loss_name: str, requires_grad: set[str], session_options: Any) -> bytes:
    """`GradientGraphBuilder`: the serialized model with `<p>_grad` outputs for each name in `requires_grad`."""
    builder = _capi().GradientGraphBuilder(model_bytes, {loss_name}, requires_grad, loss_name, session_options)
    builder.build()
    return builder.get_model()


def module_graph_builder(
    model_bytes: bytes, state: Sequence[str], trainable: Sequence[str], memory_efficient: bool
) -> Any:
    """An initialised `OrtModuleGraphBuilder` (ORTModule's graph builder) for `model_bytes`, `state` as
    initializers and `trainable` as the tensors to differentiate for; `build(configuration)` it next."""
    capi = _capi()
    config = capi.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = list(state)
    config.initializer_names_to_train = list(trainable)
    config.input_names_require_grad = []
    config.build_gradient_graph = True
    config.use_memory_efficient_gradient = memory_efficient
    config.loglevel = capi.Severity.ERROR
    builder = capi.OrtModuleGraphBuilder()
    builder.initialize(model_bytes, config)
    return builder


def transformer_configuration(strategy: str, level: int, allow: Sequence[str], pre_grad_path: str = "") -> Any:
    """`TrainingGraphTransformerConfiguration` with a `PropagateCastOpsConfiguration` (`strategy` is a
    `PropagateCastOpsStrategy` member name); `pre_grad_path` receives the pre-gradient model when set."""
    capi = _capi()
    cast = capi.PropagateCastOpsConfiguration()
    cast.strategy = getattr(capi.PropagateCastOpsStrategy, strategy)
    cast.level = level
    cast.allow = list(allow)
    config = capi.TrainingGraphTransformerConfiguration()
    config.propagate_cast_ops_config = cast
    if pre_grad_path:
        config.optimized_pre_grad_filepath = pre_grad_path
    return config
