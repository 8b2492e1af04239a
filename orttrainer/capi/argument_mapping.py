"""Map the older ORTTrainer's constructor arguments (docs/legacy_api.md §14.3) onto the new trainer's inputs.

Rules:
- Every argument becomes an `ORTTrainerOptions` entry (table `OPTION_OF_ARGUMENT`) or part of the optimizer
  config; nothing is checked twice: what the new trainer cannot honour raises its `NotImplementedError`, which
  `name_the_argument` rewrites to name the older API's argument.
- `training_optimizer_name` picks `SGDConfig`/`AdamConfig`/`LambConfig`; `map_optimizer_attributes(weight)` is
  called once per trainable weight, and weights with the same attributes form one parameter group. Attributes left
  out take the backend defaults, which are the config defaults. The learning rate is fed every step, so the
  config's `lr` is unused (0).
- `_extra_postprocess(model)` was applied in place (its return value ignored): a returned `ModelProto` is used,
  anything else means "the argument was modified in place".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import onnx
import torch

from .. import optim
from ..dtypes import FLOAT_ONNX_TYPES

DEFAULT_OPSET_VERSION = 14

# older-API argument -> new option path
OPTION_OF_ARGUMENT = {
    "device": "device.id",
    "gradient_accumulation_steps": "batch.gradient_accumulation_steps",
    "world_rank": "distributed.world_rank",
    "world_size": "distributed.world_size",
    "use_mixed_precision": "mixed_precision.enabled",
    "loss_scaler": "mixed_precision.loss_scaler",
    "allreduce_post_accumulation": "distributed.allreduce_post_accumulation",
    "deepspeed_zero_stage": "distributed.deepspeed_zero_optimization.stage",
    "enable_adasum": "distributed.enable_adasum",
    "enable_grad_norm_clip": "utils.grad_norm_clip",
    "frozen_weights": "utils.frozen_weights",
    "use_memory_efficient_gradient": "utils.memory_efficient_gradient",
    "run_symbolic_shape_infer": "utils.run_symbolic_shape_infer",
    "_use_deterministic_compute": "debug.deterministic_compute",
    "optimized_model_filepath": "debug.graph_save_paths.model_with_training_graph_after_optimization_path",
    "_opset_version": "_internal_use.onnx_opset_version",
    "_enable_internal_postprocess": "_internal_use.enable_internal_postprocess",
    "_extra_postprocess": "_internal_use.extra_postprocess",
}

_CONFIGS = {"SGDOptimizer": optim.SGDConfig, "AdamOptimizer": optim.AdamConfig, "LambOptimizer": optim.LambConfig}


def options_dict(arguments: dict[str, Any]) -> dict:
    """The nested `ORTTrainerOptions` dict for the argument values (argument name -> value)."""
    tree: dict = {}
    for argument, path in OPTION_OF_ARGUMENT.items():
        if argument not in arguments:
            continue
        node = tree
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = arguments[argument]
    return tree


def device_id(device: torch.device | str) -> str:
    """`torch.device`/str -> `device.id` ('cpu' or 'cuda:<index>'; a bare 'cuda' is index 0, as legacy)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index or 0}"
    raise ValueError(f"device {device}: the older ORTTrainer trains on 'cpu' or 'cuda[:index]'")


def in_place_postprocess(
    fn: Callable[[onnx.ModelProto], Any] | None,
) -> Callable[[onnx.ModelProto], onnx.ModelProto] | None:
    """Wrap `_extra_postprocess`/`postprocess_model` (legacy: called for its side effect on the model)."""
    if fn is None:
        return None

    def postprocess(model: onnx.ModelProto) -> onnx.ModelProto:
        result = fn(model)
        return result if isinstance(result, onnx.ModelProto) else model

    return postprocess


def optimizer_config(
    name: str, map_optimizer_attributes: Callable[[str], dict] | None, weights: list[str]
) -> optim._OptimizerConfig:
    """`SGDConfig`/`AdamConfig`/`LambConfig` with one parameter group per distinct attribute dict."""
    if name not in _CONFIGS:
        raise ValueError(f"training_optimizer_name {name!r}: expected one of {sorted(_CONFIGS)}")
    config_class = _CONFIGS[name]
    known = set(config_class().defaults) - {"lr"}
    groups: dict[tuple, dict] = {}
    for weight in weights:
        attributes = dict(map_optimizer_attributes(weight) or {}) if map_optimizer_attributes else {}
        _check_attributes(name, weight, attributes, known)
        if attributes:
            key = tuple(sorted(attributes.items()))
            groups.setdefault(key, {**attributes, "params": []})["params"].append(weight)
    return config_class(params=list(groups.values()), lr=0.0) if groups else config_class(lr=0.0)


def _check_attributes(name: str, weight: str, attributes: dict, known: set[str]) -> None:
    where = f"map_optimizer_attributes({weight!r})"
    if "lr" in attributes:
        raise ValueError(
            f"{where} returned 'lr': per-weight learning rates are not supported; the rate comes from "
            "the learning-rate input or get_lr_this_step"
        )
    unknown = sorted(set(attributes) - known)
    if unknown:
        allowed = sorted(known) or "none"
        raise ValueError(f"{where} returned {unknown}, which {name} does not take (its attributes: {allowed})")
    for key, value in attributes.items():
        if not isinstance(value, (int, float)):
            raise ValueError(f"Optimizer attributes must be either float or int. ({where}[{key!r}] = {value!r})")


def trainable_weight_names(model: torch.nn.Module | onnx.ModelProto) -> list[str]:
    """Names `map_optimizer_attributes` is asked about: the torch model's parameters, or an ONNX model's floating
    initializers (the new trainer freezes the ones that cannot reach the loss; their attributes are unused)."""
    if isinstance(model, torch.nn.Module):
        return [name for name, _ in model.named_parameters()]
    return [i.name for i in model.graph.initializer if i.data_type in FLOAT_ONNX_TYPES]


_OPTION_IN_MESSAGE = re.compile(r"options ([\w.]+)=")


def name_the_argument(error: NotImplementedError, arguments: dict[str, Any]) -> NotImplementedError:
    """The new trainer's "options <path>=<value> is not supported" error, restated with the older API's argument."""
    match = _OPTION_IN_MESSAGE.search(str(error))
    by_path = {path: argument for argument, path in OPTION_OF_ARGUMENT.items()}
    argument = by_path.get(match.group(1)) if match else None
    if argument is None:
        return error
    return NotImplementedError(
        f"ORTTrainer argument {argument}={arguments[argument]!r} is not supported by this orttrainer build ({error})"
    )
