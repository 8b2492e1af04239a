"""Which tensors train, which stay frozen, and how trained tensors group by optimizer hyper-parameters."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..dtypes import FLOAT_ONNX_TYPES
from ..optim.config import _OptimizerConfig
from .graph.training import ParamGroup


def param_groups(optim_config: _OptimizerConfig, trainable: list[str]) -> list[ParamGroup]:
    """Group trainable tensors by their resolved hyper-parameters (legacy per-weight attribute rules)."""
    groups: dict[tuple, ParamGroup] = {}
    for name in trainable:
        floats, ints = optim_config.hyper_parameters(name)
        hyper = {**floats, **ints}
        key = tuple(sorted(hyper.items()))
        groups.setdefault(key, ParamGroup(hyper, []))
        groups[key].params.append(name)
    return list(groups.values())


def split_parameters(
    model: onnx.ModelProto, frozen_weights: list[str], torch_params: list[str] | None, torch_state: list[str] | None
) -> tuple[list[str], list[str]]:
    """(trainable, frozen) initializer names.

    PyTorch model: its `requires_grad` parameters minus `utils.frozen_weights` are trained; buffers, other
    parameters and the listed frozen weights are frozen state. ONNX model: every floating-point initializer not in
    `frozen_weights` is trained; other initializers stay constants of the graph.
    """
    initializers = {i.name: i for i in model.graph.initializer}
    unknown = [name for name in frozen_weights if name not in initializers]
    if unknown:
        raise RuntimeError(f"{unknown} params from 'frozen_weights' not found in the ONNX model.")
    frozen_set = set(frozen_weights)
    if torch_params is not None:
        trainable = [n for n in torch_params if n not in frozen_set]
        frozen = [n for n in (torch_state or []) if n in initializers] + [n for n in torch_params if n in frozen_set]
        return trainable, frozen
    trainable = [n for n, i in initializers.items() if n not in frozen_set and i.data_type in FLOAT_ONNX_TYPES]
    return trainable, list(frozen_weights)


def initializer_values(model: onnx.ModelProto, names: list[str]) -> dict[str, np.ndarray]:
    """The values of the initializers named in `names` (others are ignored)."""
    wanted = set(names)
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in wanted}
