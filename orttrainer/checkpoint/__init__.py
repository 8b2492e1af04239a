"""Checkpoints: the legacy ``onnxruntime.training.checkpoint`` module, plus its HDF5 storage and a command line.

- ``aggregate_checkpoints(paths, pytorch_format=True)``: merge the per-rank HDF5 files of a ZeRO/Megatron run.
- ``experimental_state_dict / experimental_load_state_dict / experimental_save_checkpoint /
  experimental_load_checkpoint``: the deprecated torch.save-based API (each warns DeprecationWarning).
- ``storage``: ``save``/``load`` of nested dicts as HDF5 (atomic, never overwrites, checksummed),
  ``to_serialized_hex``, ``from_serialized_hex``; also importable as ``orttrainer._checkpoint_storage``.
- ``user_dict``: a checkpoint's ``user_dict`` stored without pickle where it is plain data; ``safe_pickle``: the
  unpickler that loads plain data only (``UnsafePickleError`` otherwise, unless ``trusted=True``).
- ``layout``: the legacy state_dict / checkpoint tree, described once, and a constant for every key in it.
- ``python -m orttrainer.checkpoint info PATH`` / ``to-pytorch PATH... OUT.pt``: inspect and convert checkpoints.
"""

# ruff: noqa: F401 - the private helpers are re-exported on purpose: legacy code and tests reach them here

from __future__ import annotations

import importlib
from typing import Any

from . import layout, safe_pickle, user_dict
from .aggregate import (
    _AGGREGATION_MODE,
    CheckpointAggregationError,
    _add_or_update_sharded_key,
    _add_or_validate_unsharded_key,
    _aggregate_megatron_partition_info,
    _aggregate_model_states,
    _aggregate_optimizer_states,
    _aggregate_over_D_H,
    _aggregate_over_ranks,
    _aggregate_trainer_options,
    _get_parallellism_groups,
    _order_paths,
    _reshape_states,
    _to_pytorch_format,
    aggregate_checkpoints,
)
from .experimental import (
    _CombineZeroCheckpoint,
    _get_checkpoint_name,
    _list_checkpoint_files,
    _load_multi_checkpoint,
    _load_single_checkpoint,
    _split_state_dict,
    experimental_load_checkpoint,
    experimental_load_state_dict,
    experimental_save_checkpoint,
    experimental_state_dict,
)
from .safe_pickle import UnsafePickleError

__all__ = [
    "CheckpointAggregationError",
    "CheckpointCorruptError",  # noqa: F822 - served by __getattr__, with `storage`
    "CheckpointNotFoundError",  # noqa: F822
    "UnsafePickleError",
    "aggregate_checkpoints",
    "experimental_load_checkpoint",
    "experimental_load_state_dict",
    "experimental_save_checkpoint",
    "experimental_state_dict",
    "layout",
    "safe_pickle",
    "storage",  # noqa: F822
    "user_dict",
]


_FROM_STORAGE = ("CheckpointCorruptError", "CheckpointNotFoundError")


def __getattr__(name: str) -> Any:
    """``storage`` and its errors, imported when first asked for: ``storage`` imports h5py and HDF5 (~11 MB resident,
    docs/engine.md §24), which a training run that never reads or writes a checkpoint does not need."""
    if name == "storage" or name in _FROM_STORAGE:
        storage = importlib.import_module(f"{__name__}.storage")  # also binds the attribute, for later reads
        return storage if name == "storage" else getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
