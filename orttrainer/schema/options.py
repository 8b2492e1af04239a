"""``ORTTrainerOptions``: the legacy option tree, validated and normalised by cerberus.

Behaviour follows ``onnxruntime.training.orttrainer_options`` of release 1.13.1 (docs/legacy_api.md §5): the
same schema and defaults, the same ``ValueError("Invalid options: {...}")`` carrying cerberus's error dict, and the
same attribute-access wrappers. This module never imports onnxruntime; types owned by other packages are checked
lazily, at validation time.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import cerberus

if TYPE_CHECKING:
    from ..optim.lr_scheduler import _LRScheduler


class PropagateCastOpsStrategy(enum.IntEnum):
    """Cast propagation strategy (same names and values as ``onnxruntime.training.PropagateCastOpsStrategy``)."""

    NONE = 0
    INSERT_AND_REDUCE = 1
    FLOOD_FILL = 2


def _is_ort_propagate_strategy(value: Any) -> bool:
    # onnxruntime's pybind11 enum; recognised by name so that this module never has to import onnxruntime.
    cls = type(value)
    return cls.__name__ == "PropagateCastOpsStrategy" and cls.__module__.startswith("onnxruntime")


def _normalize_propagate_strategy(value: Any) -> Any:
    """cerberus ``coerce`` hook: onnxruntime's enum becomes ours (by member name); anything else is left to the
    type rule, which reports it."""
    if _is_ort_propagate_strategy(value) and getattr(value, "name", None) in PropagateCastOpsStrategy.__members__:
        return PropagateCastOpsStrategy[value.name]
    return value


class _LazyInstanceCheck(type):
    """Metaclass whose ``isinstance`` test runs the class's ``_matches``: lets a cerberus ``TypeDefinition`` name a
    class that lives in a module we must not (onnxruntime) or cannot yet (a sibling package) import."""

    _matches: Callable[[Any], bool]  # each class using this metaclass defines it (a staticmethod)

    def __instancecheck__(cls, value: Any) -> bool:
        return cls._matches(value)


class _AnyLRScheduler(metaclass=_LazyInstanceCheck):
    @staticmethod
    def _matches(value: Any) -> bool:
        from ..optim.lr_scheduler import _LRScheduler

        return isinstance(value, _LRScheduler)


class _AnyLossScaler(metaclass=_LazyInstanceCheck):
    @staticmethod
    def _matches(value: Any) -> bool:
        from ..amp.loss_scaler import LossScaler

        return isinstance(value, LossScaler)


class _AnySessionOptions(metaclass=_LazyInstanceCheck):
    @staticmethod
    def _matches(value: Any) -> bool:
        # A user holding a SessionOptions object has imported onnxruntime already; if it is not imported, the value
        # cannot be one.
        ort = sys.modules.get("onnxruntime")
        return ort is not None and isinstance(value, ort.SessionOptions)


class ORTTrainerOptionsValidator(cerberus.Validator):
    """cerberus validator knowing the custom types of the option schema.

    ``lr_scheduler``: an ``orttrainer.optim.lr_scheduler._LRScheduler``; ``loss_scaler``: an
    ``orttrainer.amp.loss_scaler.LossScaler``; ``session_options``: an ``onnxruntime.SessionOptions``;
    ``propagate_cast_ops_strategy``: a :class:`PropagateCastOpsStrategy` (onnxruntime's enum is coerced to it).
    """

    types_mapping = cerberus.Validator.types_mapping.copy()
    types_mapping["lr_scheduler"] = cerberus.TypeDefinition("lr_scheduler", (_AnyLRScheduler,), ())
    types_mapping["loss_scaler"] = cerberus.TypeDefinition("loss_scaler", (_AnyLossScaler,), ())
    types_mapping["session_options"] = cerberus.TypeDefinition("session_options", (_AnySessionOptions,), ())
    types_mapping["propagate_cast_ops_strategy"] = cerberus.TypeDefinition(
        "propagate_cast_ops_strategy", (PropagateCastOpsStrategy,), ()
    )


def _check_is_callable(field: str, value: Any, error: Callable[[str, str], None]) -> None:
    """cerberus ``check_with`` for ``_internal_use.extra_postprocess``."""
    if not (value is None or callable(value)):
        error(field, "Must be callable or None")


PROVIDER_OPTION_TYPES = (str, int, float, bool)  # what ONNX Runtime's provider options take (as strings)


def _check_provider_options(field: str, value: Any, error: Callable[[str, str], None]) -> None:
    """cerberus ``check_with`` for ``provider_options``: ``{provider name (str): {option (str): str | int | float |
    bool}}``. Not in the legacy schema, which accepted any dict and let ONNX Runtime fail later (or crashed on a
    non-str key here); which providers exist is checked by the trainer, which knows the onnxruntime build."""
    if not isinstance(value, dict):
        return  # the type rule reports it
    for provider, options in value.items():
        # Worded as the trainer's own check (trainer/config.py), which would otherwise report the same problems.
        if not isinstance(provider, str):
            error(field, f"provider name {_kind(provider)} is not a str: keys are names like 'CUDAExecutionProvider'")
        elif not isinstance(options, dict):
            error(
                field,
                f"provider_options.{provider} must be a dict of option names to values, got {type(options).__name__}",
            )
        else:
            bad = [k for k, v in options.items() if not isinstance(k, str) or not isinstance(v, PROVIDER_OPTION_TYPES)]
            if bad:
                error(
                    field,
                    f"provider_options.{provider}: option names must be str and values str, int, float or bool; "
                    f"these are not: {bad} (values: {[options[k] for k in bad]})",
                )


def _kind(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


# Schema-building helpers. They produce exactly the rule dicts of the legacy schema; list and dict defaults use
# `default_setter` so that every ORTTrainerOptions gets fresh containers (cerberus inserts a plain `default` object
# as is, which would share one list between all instances and let a mutation leak into later ones).
def _new_dict(_: Any) -> dict:
    return {}


def _new_list(_: Any) -> list:
    return []


def _group(schema: dict) -> dict:
    return {"type": "dict", "default_setter": _new_dict, "required": False, "schema": schema}


# Bounds of the integers ONNX Runtime's bindings take: a larger value would reach them raw (an overflow there).
UINT64_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1


def _integer(default: int, lo: int | None = None, hi: int | None = None) -> dict:
    rule: dict = {"type": "integer"}
    if lo is not None:
        rule["min"] = lo
    if hi is not None:
        rule["max"] = hi
    rule["default"] = default
    return rule


def _boolean(default: bool) -> dict:
    return {"type": "boolean", "default": default}


def _string(default: str) -> dict:
    return {"type": "string", "default": default}


def _string_list() -> dict:
    return {"type": "list", "schema": {"type": "string"}, "default_setter": _new_list}


def _nullable(type_name: str) -> dict:
    return {"type": type_name, "nullable": True, "default": None}


_PIPELINE_PARALLEL_SCHEMA = {
    "pipeline_parallel_size": _integer(1, lo=1),
    "num_pipeline_micro_batches": _integer(1, lo=1),
    "pipeline_cut_info_string": _string(""),
    "sliced_schema": {
        "type": "dict",
        "default_setter": _new_dict,
        "keysrules": {"type": "string"},
        "valuesrules": {"type": "list", "schema": {"type": "integer"}},
    },
    "sliced_axes": {
        "type": "dict",
        "default_setter": _new_dict,
        "keysrules": {"type": "string"},
        "valuesrules": {"type": "integer"},
    },
    "sliced_tensor_names": _string_list(),
}

_DISTRIBUTED_SCHEMA = {
    "world_rank": _integer(0, lo=0),
    "world_size": _integer(1, lo=1),
    "local_rank": _integer(0, lo=0),
    "data_parallel_size": _integer(1, lo=1),
    "horizontal_parallel_size": _integer(1, lo=1),
    "pipeline_parallel": _group(_PIPELINE_PARALLEL_SCHEMA),
    "allreduce_post_accumulation": _boolean(False),
    "deepspeed_zero_optimization": _group({"stage": _integer(0, lo=0, hi=1)}),
    "enable_adasum": _boolean(False),
}

# Source choice: the seed document (001_*.txt) is garbled here. It names the keys `propagate_cast_ops_strategy`,
# `propagate_cast_ops_level` and `propagate_cast_ops_allow`, places `allow_layer_norm_mod_precision` inside this
# group, and nests `utils`/`debug`/`_internal_use` under `graph_transformer` with a second, conflicting
# `_internal_use` (opset 12-13, default 12). We follow docs/legacy_api.md §5.2 (release 1.13.1) instead: keys
# `strategy`/`level`/`allow`, level >= -1, no `allow_layer_norm_mod_precision`, every group at the top level,
# opset 12-14 with default 14. The seed's own prose ("propagate_cast_ops_config.strategy ... default FLOOD_FILL")
# agrees with §5.2.
_PROPAGATE_CAST_OPS_SCHEMA = {
    "strategy": {
        "type": "propagate_cast_ops_strategy",
        "coerce": _normalize_propagate_strategy,
        "nullable": True,
        "default": PropagateCastOpsStrategy.FLOOD_FILL,
    },
    "level": _integer(1, lo=-1, hi=INT64_MAX),
    "allow": _string_list(),
}

GRADIENT_BUILDERS = ("ort", "torch", "auto")

_GRAPH_SAVE_PATHS_SCHEMA = {
    "model_after_graph_transforms_path": _string(""),
    "model_with_gradient_graph_path": _string(""),
    "model_with_training_graph_path": _string(""),
    "model_with_training_graph_after_optimization_path": _string(""),
}

_ORTTRAINER_OPTIONS_SCHEMA: dict = {
    "batch": _group({"gradient_accumulation_steps": _integer(1, lo=1)}),
    "device": _group({"id": _string("cuda"), "mem_limit": _integer(0, lo=0, hi=UINT64_MAX)}),
    "distributed": _group(_DISTRIBUTED_SCHEMA),
    "lr_scheduler": _nullable("lr_scheduler"),
    "mixed_precision": _group({"enabled": _boolean(False), "loss_scaler": _nullable("loss_scaler")}),
    "graph_transformer": _group(
        {
            "attn_dropout_recompute": _boolean(False),
            "gelu_recompute": _boolean(False),
            "transformer_layer_recompute": _boolean(False),
            "number_recompute_layers": _integer(0, lo=0),
            "propagate_cast_ops_config": _group(_PROPAGATE_CAST_OPS_SCHEMA),
        }
    ),
    "utils": _group(
        {
            "frozen_weights": _string_list(),  # legacy: any list (a nested list failed later, unhashable)
            "grad_norm_clip": _boolean(True),
            "memory_efficient_gradient": _boolean(False),
            "run_symbolic_shape_infer": _boolean(False),
        }
    ),
    "debug": _group(
        {
            "deterministic_compute": _boolean(False),
            "check_model_export": _boolean(False),
            "graph_save_paths": _group(_GRAPH_SAVE_PATHS_SCHEMA),
        }
    ),
    "_internal_use": _group(
        {
            "enable_internal_postprocess": _boolean(True),
            "extra_postprocess": {"check_with": _check_is_callable, "nullable": True, "default": None},
            "onnx_opset_version": _integer(14, lo=12, hi=14),
            "enable_onnx_contrib_ops": _boolean(True),
            # orttrainer's own key (not in the legacy schema): which gradient builder differentiates a PyTorch
            # model. 'ort': ONNX Runtime's C++ builder on the exported graph; 'torch': PyTorch autograd traced
            # into the graph (custom autograd.Functions keep their backward); 'auto': 'torch' when the model uses
            # a custom autograd.Function or an op ONNX Runtime cannot differentiate, 'ort' otherwise.
            "gradient_builder": {"type": "string", "allowed": list(GRADIENT_BUILDERS), "default": "auto"},
        }
    ),
    # Execution-provider name -> provider options (legacy: any dict; the shape is checked here, see the function).
    "provider_options": {
        "type": "dict",
        "default_setter": _new_dict,
        "required": False,
        "allow_unknown": True,
        "check_with": _check_provider_options,
    },
    "session_options": _nullable("session_options"),
}

# Attributes that are bookkeeping, not options; __repr__ leaves them out.
_REPR_EXCLUDED = ("_original_opts", "_validated_opts", "_main_class_name")


class ORTTrainerOptions:
    r"""Settings used by the ONNX Runtime training backend.

    Options are grouped by feature (``batch``, ``device``, ``distributed``, ``lr_scheduler``, ``mixed_precision``,
    ``graph_transformer``, ``utils``, ``debug``, ``_internal_use``, ``provider_options``, ``session_options``); the
    full tree with types and defaults is ``_ORTTRAINER_OPTIONS_SCHEMA`` (docs/legacy_api.md §5.2). Every group
    and leaf is optional: omitted ones get their defaults, so ``ORTTrainerOptions({})`` is a complete configuration.

    Validation happens in the constructor; invalid input raises ``ValueError("Invalid options: {errors}")`` where
    ``errors`` is cerberus's error dict. The validated tree is ``self._validated_opts``; each top-level key is also
    an attribute, dicts wrapped for attribute access::

        opts = ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 128},
                                  "mixed_precision": {"enabled": True}})
        opts.batch.gradient_accumulation_steps          # 128
        opts.distributed.world_size                     # 1 (default)
        opts._validated_opts["provider_options"]        # {} (dict leaves are wrapped too; use this for the dict)

    Attributes may be assigned; such writes are not reflected in ``_validated_opts``.

    Args:
        options: nested dict of training options; ``None`` means ``{}``.
    """

    # The top-level groups, set from the validated tree in __init__. A nested group is an _ORTTrainerOptionsInternal
    # (its keys as attributes); a leaf is its value.
    batch: _ORTTrainerOptionsInternal
    device: _ORTTrainerOptionsInternal
    distributed: _ORTTrainerOptionsInternal
    lr_scheduler: _LRScheduler | None
    mixed_precision: _ORTTrainerOptionsInternal
    graph_transformer: _ORTTrainerOptionsInternal
    utils: _ORTTrainerOptionsInternal
    debug: _ORTTrainerOptionsInternal
    _internal_use: _ORTTrainerOptionsInternal
    provider_options: _ORTTrainerOptionsInternal
    session_options: Any  # an onnxruntime.SessionOptions (this module does not import onnxruntime) or None

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        # Kept for debugging: what the user passed, before defaults.
        self._original_opts = dict(options if options is not None else {})
        self._main_class_name = self.__class__.__name__

        validator = ORTTrainerOptionsValidator(_ORTTRAINER_OPTIONS_SCHEMA)
        self._validated_opts = validator.validated(dict(self._original_opts))
        if self._validated_opts is None:
            raise ValueError(f"Invalid options: {validator.errors}")

        for key, value in self._validated_opts.items():
            setattr(self, key, self._wrap(value))

    def __repr__(self) -> str:
        items = (f"'{k}': {v!r}" for k, v in self.__dict__.items() if k not in _REPR_EXCLUDED)
        return "{" + ", ".join(items) + "}"

    def _wrap(self, value: Any) -> Any:
        """Turn dicts (also inside lists, tuples and sets) into attribute-access objects; other values pass through."""
        if isinstance(value, (tuple, list, set, frozenset)):
            return type(value)([self._wrap(item) for item in value])
        if isinstance(value, dict):
            return _ORTTrainerOptionsInternal(self._main_class_name, value)
        return value


class _ORTTrainerOptionsInternal(ORTTrainerOptions):
    r"""Attribute-access view of one nested option group; created by :class:`ORTTrainerOptions` only.

    It is not validated again: its parent already was. The raw dict is kept in ``_validated_opts``.
    """

    if TYPE_CHECKING:
        # A group's keys are known only from the schema at run time: any attribute is one of its values (and, as on
        # ORTTrainerOptions, may be assigned).
        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def __init__(self, main_class_name: str, options: dict[str, Any]) -> None:
        self._main_class_name = main_class_name
        self._validated_opts = options
        for key, value in self._validated_opts.items():
            setattr(self, key, self._wrap(value))
