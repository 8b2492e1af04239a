"""The trainer's validated configuration: what the user handed to `ORTTrainer(...)`, checked once, at construction.

`make_config` raises the legacy errors for bad arguments (docs/legacy_api.md §3.1) and refuses option values this
build cannot honour: an option is never accepted and then silently ignored — a value the trainer cannot honour
raises `NotImplementedError` naming the option and what to do instead.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx
import torch

from .. import amp
from .._require import require
from ..optim.config import _OptimizerConfig
from ..schema.model_desc import _ORTTrainerModelDesc
from ..schema.options import ORTTrainerOptions
from .gradient.choice import OPTION as BUILDER_OPTION
from .gradient.choice import ort_only_options
from .graph.recompute import RecomputePlan
from .runtime.data_parallel import DistributedContext, check_adasum_world_size, resolve_context
from .runtime.ort import (
    TRAINING_EXTRA_HINT,
    Device,
    check_cpu_arena_cap,
    check_provider_options,
    check_runtime,
    has_training_build,
)


@dataclass(frozen=True)
class TrainerConfig:
    """Everything `ORTTrainer` was configured with, validated at construction and not changed afterwards.
    `model_desc` is the description as declared; the dtypes building learns go into the copy the built model
    carries (`model.Built.model_desc`, docs/legacy_api.md §3.4)."""

    model_desc: _ORTTrainerModelDesc
    optim_config: _OptimizerConfig
    options: ORTTrainerOptions
    loss_fn: Callable[..., Any] | None
    device: Device
    distributed: DistributedContext | None  # None: one process
    accumulation_steps: int  # batch.gradient_accumulation_steps (state.AccumulationWindow decides with it)
    zero_stage: int  # distributed.deepspeed_zero_optimization.stage

    @property
    def rank(self) -> int:
        return self.distributed.rank if self.distributed else 0

    @property
    def world_size(self) -> int:
        return self.distributed.world_size if self.distributed else 1


def make_config(
    model: object,
    model_desc: object,
    optim_config: object,
    loss_fn: object,
    options: object,
) -> TrainerConfig:
    """Check `ORTTrainer`'s arguments (legacy errors first) and return the configuration; may initialise
    `torch.distributed` (see `runtime.data_parallel.resolve_context`)."""
    require(model is not None, "'model' is required and must be either a 'torch.nn.Module' or ONNX model")
    require(isinstance(model_desc, dict), "'model_desc' must be a 'dict'")
    require(
        isinstance(optim_config, _OptimizerConfig),
        "'optim_config' is required and must be any of 'AdamConfig', 'LambConfig' or 'SGDConfig'",
    )
    require(
        loss_fn is None or _takes_two_arguments(loss_fn),
        "'loss_fn' must be either 'None' or a callable with two parameters",
    )
    require(
        options is None or isinstance(options, ORTTrainerOptions),
        "'options' must be either 'None' or 'ORTTrainerOptions'",
    )
    if isinstance(model, onnx.ModelProto):
        require(loss_fn is None, "'loss_fn' must not be specified when 'model' is an ONNX model")
    elif not isinstance(model, torch.nn.Module):
        raise ValueError("'model' must be either 'torch.nn.Module' or 'onnx.ModelProto'")
    assert isinstance(model_desc, dict) and isinstance(optim_config, _OptimizerConfig)  # checked above
    checked_options = options if isinstance(options, ORTTrainerOptions) else ORTTrainerOptions()
    description = _ORTTrainerModelDesc(model_desc)
    if checked_options.mixed_precision.enabled and not checked_options.mixed_precision.loss_scaler:
        checked_options.mixed_precision.loss_scaler = amp.DynamicLossScaler()
    check_supported_options(checked_options)
    check_runtime()
    check_runtime_supports(checked_options, onnx_model=isinstance(model, onnx.ModelProto))
    check_provider_options(checked_options)
    check_graph_save_paths(checked_options)
    device = Device.parse(checked_options.device.id)
    if device.type == "cpu" and checked_options.device.mem_limit > 0:
        check_cpu_arena_cap(checked_options.device.mem_limit)  # at construction, not at the first session
    distributed = resolve_context(checked_options, device.type)
    if distributed and device.type == "cuda" and checked_options.device.id.strip().lower() == "cuda":
        device = Device("cuda", distributed.local_rank)  # one GPU per local rank
    check_data_parallel_options(checked_options, distributed.world_size if distributed else 1)
    function = loss_fn if callable(loss_fn) else None
    return TrainerConfig(
        description,
        optim_config,
        checked_options,
        function,
        device,
        distributed,
        accumulation_steps=int(checked_options.batch.gradient_accumulation_steps),
        zero_stage=int(checked_options.distributed.deepspeed_zero_optimization.stage),
    )


def _takes_two_arguments(fn: object) -> bool:
    """A loss function must accept `(predictions, label)`. Legacy demanded exactly two parameters, which rejected
    `torch.nn.functional.cross_entropy`; any callable that can bind two positional arguments is accepted."""
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature available (some builtins): trust the caller
        return True
    return True


# option path -> (predicate on the value that means "cannot be honoured", what to do instead)
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "distributed.horizontal_parallel_size": (lambda v: v > 1, "use data parallelism or a single process"),
    "distributed.pipeline_parallel.pipeline_parallel_size": (lambda v: v > 1, "use a single pipeline stage"),
    "distributed.pipeline_parallel.num_pipeline_micro_batches": (lambda v: v > 1, "use gradient accumulation"),
    "distributed.pipeline_parallel.pipeline_cut_info_string": (bool, "leave it empty (no pipeline parallelism)"),
    "distributed.pipeline_parallel.sliced_schema": (bool, "leave it empty (no pipeline parallelism)"),
    "distributed.pipeline_parallel.sliced_axes": (bool, "leave it empty (no pipeline parallelism)"),
    "distributed.pipeline_parallel.sliced_tensor_names": (bool, "leave it empty (no pipeline parallelism)"),
}


def check_supported_options(options: ORTTrainerOptions) -> None:
    """Raise NotImplementedError for the first option value this build cannot honour."""
    for path, (unsupported, instead) in _UNSUPPORTED.items():
        value = _lookup(options._validated_opts, path)
        if unsupported(value):
            raise NotImplementedError(f"options {path}={value!r} is not supported by this orttrainer build; {instead}.")
    recompute_plan(options)


def recompute_plan(options: ORTTrainerOptions) -> RecomputePlan:
    """`graph_transformer`'s recompute flags as a `RecomputePlan` (graph/recompute.py)."""
    gt = options.graph_transformer
    if gt.number_recompute_layers > 0 and not gt.transformer_layer_recompute:
        raise ValueError(
            f"options graph_transformer.number_recompute_layers={gt.number_recompute_layers} only takes "
            "effect with graph_transformer.transformer_layer_recompute=True"
        )
    layers = gt.number_recompute_layers if gt.transformer_layer_recompute else None
    return RecomputePlan(gelu=gt.gelu_recompute, attention_dropout=gt.attn_dropout_recompute, layers=layers)


def check_data_parallel_options(options: ORTTrainerOptions, world_size: int) -> None:
    """Distributed options that only make sense together (checked once the world size is known)."""
    dist = options.distributed
    if dist.data_parallel_size not in (1, world_size):
        raise ValueError(
            f"options distributed.data_parallel_size={dist.data_parallel_size} must equal the world size "
            f"({world_size}): every rank is a data-parallel rank"
        )
    if dist.enable_adasum:
        check_adasum_world_size(world_size)
        if not dist.allreduce_post_accumulation and options.batch.gradient_accumulation_steps > 1:
            raise NotImplementedError(
                "options distributed.enable_adasum with allreduce_post_accumulation=False and gradient accumulation: "
                "Adasum combines each rank's accumulated gradient once per optimizer step; set "
                "distributed.allreduce_post_accumulation=True"
            )


def check_runtime_supports(options: ORTTrainerOptions, onnx_model: bool = False) -> None:
    """Options that need onnxruntime-training (its gradient builder and the graph transformations that act on its
    gradient graph) raise NotImplementedError at construction where only the maintained onnxruntime is installed,
    naming the options and the extra to install."""
    if has_training_build():
        return
    builder = options._internal_use.gradient_builder
    if builder == "ort":
        raise NotImplementedError(
            f"options {BUILDER_OPTION}='ort' needs ONNX Runtime's gradient builder, which only onnxruntime-training "
            f"has: {TRAINING_EXTRA_HINT}; or use 'torch' or 'auto' (which picks 'torch' here)"
        )
    needs_training = ort_only_options(options, onnx_model)
    if needs_training:
        raise NotImplementedError(
            f"options {needs_training} need onnxruntime-training (they transform ONNX Runtime's gradient graph), "
            f"and the maintained onnxruntime installed here trains with the torch gradient builder: turn them off, or "
            f"{TRAINING_EXTRA_HINT}"
        )


_DEFAULT_NAME_MAX = 255
_DEFAULT_PATH_MAX = 4096


def check_graph_save_paths(options: ORTTrainerOptions) -> None:
    """`check_file_name` on every non-empty path of `options.debug.graph_save_paths`.

    Why at construction (docs/reliability.md §5): ONNX Runtime would otherwise fail at the first step with
    "SystemError : 2" or "SystemError : 36", naming nothing. Whether the directory exists and is writable stays a
    warning at the step (a debug dump never stops training)."""
    paths = options.debug.graph_save_paths._validated_opts
    for key, path in paths.items():
        if path:
            check_file_name(path, f"debug.graph_save_paths.{key}")


def check_file_name(path: str, option: str) -> None:
    """Refuse a path the operating system cannot take; `option` names it. Rule: a string without a NUL character,
    whose every component fits the filesystem's NAME_MAX and whose whole length (as bytes, made absolute) stays
    under its PATH_MAX; the limits are read with `os.pathconf` from the nearest existing directory of the path (255
    and 4096 where the system does not say)."""
    if "\0" in path:
        raise ValueError(f"options {option}={path!r} contains a NUL character, which no file name can hold")
    absolute = os.path.abspath(path)
    existing = _nearest_directory(absolute)
    name_max = _limit(existing, "PC_NAME_MAX", _DEFAULT_NAME_MAX)
    path_max = _limit(existing, "PC_PATH_MAX", _DEFAULT_PATH_MAX)
    for component in absolute.split(os.sep):
        if len(os.fsencode(component)) > name_max:
            raise ValueError(
                f"options {option}: the path component {component[:40]!r}... is {len(os.fsencode(component))} "
                f"bytes long; this filesystem allows {name_max}"
            )
    if len(os.fsencode(absolute)) >= path_max:
        raise ValueError(
            f"options {option}: the path is {len(os.fsencode(absolute))} bytes long; this system allows {path_max - 1}"
        )


def _nearest_directory(path: str) -> str:
    directory = os.path.dirname(path)
    while not os.path.isdir(directory):
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return directory


def _limit(directory: str, name: str, default: int) -> int:
    try:
        return int(os.pathconf(directory, name))
    except (OSError, ValueError):
        return default


def _lookup(tree: dict, path: str) -> Any:
    value: Any = tree
    for key in path.split("."):
        value = value[key]
    return value
