"""The deprecated ``checkpoint.experimental_*`` API: flat ``{name: torch.Tensor}`` state saved with ``torch.save``.

Behaviour of legacy ``onnxruntime.training.checkpoint`` (docs/legacy_api.md §9.3); every public function warns
``DeprecationWarning("experimental_X() will be deprecated soon. Please use ORTTrainer.X() instead.")``.

Trainer contract (``FlatStateTrainer`` below; ``ORTTrainer`` implements it): ``_training_session`` (None before
the first step), ``_flat_state()`` -> ``{name: Tensor}`` (weights and optimizer tensors ``Moment_1_<w>``,
``Moment_2_<w>``, ``Update_Count_<w>``, ``Step``), ``_load_flat_state(state, strict)`` — which, before the session
exists, parks the state and applies it once the session exists —, ``_state_dict`` (the parked state, the legacy
attribute), ``_torch_state_dict_keys`` (None when unknown) and ``options``.

Each public function is a deprecation warning around a quiet implementation (``_flat_state_dict``,
``_load_flat_state_dict``, ``_save_flat_checkpoint``, ``_load_flat_checkpoint``); the older API
(``orttrainer.capi``, whose checkpoints are the same files) uses those directly.

Files are ``torch.save`` pickles. Loading uses ``torch.load(weights_only=True)`` — tensors, numbers, strings, lists,
tuples, dicts, sets, ``torch.Size`` and dtypes, plus numpy arrays and scalars (allowed here, as in ``user_dict``)
— and refuses anything else with ``safe_pickle.UnsafePickleError`` naming the file and the global; the load
functions take ``trusted=True`` to unpickle everything, as legacy did (``weights_only=False``: only for files you
trust, since unpickling can run any code).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..schema.options import ORTTrainerOptions
from ._atomic import atomic_write
from .safe_pickle import torch_load

_OPTIMIZER_PREFIXES = ("Moment_1_", "Moment_2_", "Update_Count_", "Step")
_ZERO_NAME = re.compile(r"\.ZeRO\.(\d+)\.(\d+)\.ort\.pt$")


class FlatStateTrainer(Protocol):
    """What the experimental API needs from a trainer."""

    @property
    def options(self) -> ORTTrainerOptions: ...

    @property
    def _training_session(self) -> object | None: ...

    @property
    def _state_dict(self) -> dict[str, Any] | None: ...

    @property
    def _torch_state_dict_keys(self) -> list[str] | None: ...

    def _flat_state(self) -> dict[str, torch.Tensor]: ...

    def _load_flat_state(self, state: dict[str, Any], strict: bool) -> None: ...


def _deprecated(name: str) -> None:
    warnings.warn(
        f"experimental_{name}() will be deprecated soon. Please use ORTTrainer.{name}() instead.",
        DeprecationWarning,
        stacklevel=3,
    )


def _zero_stage(trainer: Any) -> int:
    return trainer.options.distributed.deepspeed_zero_optimization.stage


# --- state dict ---------------------------------------------------------------------------------------------------


def experimental_state_dict(ort_trainer: FlatStateTrainer, include_optimizer_state: bool = True) -> dict[str, Any]:
    """Flat ``{name: torch.Tensor}`` of the trainer's weights and (by default) optimizer tensors.

    Rules: before the first step it warns and returns the state parked by ``experimental_load_state_dict`` (or
    ``{}``). Without optimizer state, the result keeps the torch model's ``state_dict()`` keys when they are known,
    otherwise every name that is not an optimizer tensor (legacy kept the optimizer tensors then).
    """
    _deprecated("state_dict")
    return _flat_state_dict(ort_trainer, include_optimizer_state)


def _flat_state_dict(ort_trainer: FlatStateTrainer, include_optimizer_state: bool = True) -> dict[str, Any]:
    """``experimental_state_dict`` without the deprecation warning."""
    if not ort_trainer._training_session:
        warnings.warn(
            "ONNX Runtime training session is not initialized yet. "
            "Please run train_step or eval_step at least once before calling state_dict().",
            stacklevel=2,
        )
        return ort_trainer._state_dict or {}
    state = dict(ort_trainer._flat_state())
    if include_optimizer_state:
        return state
    torch_keys = ort_trainer._torch_state_dict_keys
    if torch_keys:
        return {key: state[key] for key in torch_keys if key in state}
    split = _split_state_dict(state)
    return {**split["fp32_param"], **split["fp16_param"]}


def experimental_load_state_dict(
    ort_trainer: FlatStateTrainer, state_dict: dict[str, Any], strict: bool = False
) -> None:
    """Load a flat state (as from ``experimental_state_dict``) into the trainer.

    Rules: before the first step the state is parked and applied when the session is created. With ``strict``, a
    name the trainer does not have raises ``RuntimeError("Checkpoint tensor: {name} is not present in the model.")``.
    """
    _deprecated("load_state_dict")
    _load_flat_state_dict(ort_trainer, state_dict, strict)


def _load_flat_state_dict(ort_trainer: FlatStateTrainer, state_dict: dict[str, Any], strict: bool = False) -> None:
    """``experimental_load_state_dict`` without the deprecation warning."""
    if strict and ort_trainer._training_session:
        known = ort_trainer._flat_state()
        for name in state_dict:
            if name not in known:
                raise RuntimeError(f"Checkpoint tensor: {name} is not present in the model.")
    ort_trainer._load_flat_state(state_dict, strict)  # before the first step: parked, applied at the first step


# --- checkpoint files ---------------------------------------------------------------------------------------------


def experimental_save_checkpoint(
    ort_trainer: FlatStateTrainer,
    checkpoint_dir: str,
    checkpoint_prefix: str = "ORT_checkpoint",
    checkpoint_state_dict: dict[str, Any] | None = None,
    include_optimizer_state: bool = True,
) -> None:
    """``torch.save`` ``{**checkpoint_state_dict, 'model': experimental_state_dict(...)}`` into ``checkpoint_dir``.

    Rules: the directory must exist (``AssertionError``). The file is ``<prefix>.ort.pt``, or
    ``<prefix>.ZeRO.<rank>.<world_size-1>.ort.pt`` under ZeRO. An existing file is replaced (with a warning), but
    atomically: a failed save leaves the old file intact. The caller's dict is not modified (legacy updated it).
    """
    _deprecated("save_checkpoint")
    _save_flat_checkpoint(
        ort_trainer, checkpoint_dir, checkpoint_prefix, checkpoint_state_dict, include_optimizer_state
    )


def _save_flat_checkpoint(
    ort_trainer: FlatStateTrainer,
    checkpoint_dir: str,
    checkpoint_prefix: str = "ORT_checkpoint",
    checkpoint_state_dict: dict[str, Any] | None = None,
    include_optimizer_state: bool = True,
) -> None:
    """``experimental_save_checkpoint`` without the deprecation warning."""
    to_save = dict(checkpoint_state_dict or {})
    to_save["model"] = _flat_state_dict(ort_trainer, include_optimizer_state)
    if not os.path.exists(checkpoint_dir):
        raise AssertionError(f"checkpoint_dir ({checkpoint_dir}) directory doesn't exist")
    distributed = ort_trainer.options.distributed
    name = _get_checkpoint_name(
        checkpoint_prefix, _zero_stage(ort_trainer), distributed.world_rank, distributed.world_size
    )
    checkpoint_file = os.path.join(checkpoint_dir, name)
    if os.path.exists(checkpoint_file):
        warnings.warn(f"{checkpoint_file} already exists, overwriting.", stacklevel=2)
    atomic_write(checkpoint_file, lambda handle: torch.save(to_save, handle), overwrite=True)


def experimental_load_checkpoint(
    ort_trainer: FlatStateTrainer,
    checkpoint_dir: str,
    checkpoint_prefix: str = "ORT_checkpoint",
    strict: bool = False,
    *,
    trusted: bool = False,
) -> dict[str, Any]:
    """Load the ``<prefix>*.ort.pt`` checkpoint(s) of ``checkpoint_dir``; return the saved dict without ``'model'``.

    Rules: several files mean a ZeRO checkpoint (warning). A trainer without ZeRO aggregates them all
    (``_CombineZeroCheckpoint``) and gets the other keys of every file merged; a ZeRO trainer loads its own rank's
    file. No matching file raises ``AssertionError``. Without ``trusted`` only plain data loads (module docstring).
    """
    _deprecated("load_checkpoint")
    return _load_flat_checkpoint(ort_trainer, checkpoint_dir, checkpoint_prefix, strict, trusted=trusted)


def _load_flat_checkpoint(
    ort_trainer: FlatStateTrainer,
    checkpoint_dir: str,
    checkpoint_prefix: str = "ORT_checkpoint",
    strict: bool = False,
    *,
    trusted: bool = False,
) -> dict[str, Any]:
    """``experimental_load_checkpoint`` without the deprecation warning."""
    checkpoint_files = _list_checkpoint_files(checkpoint_dir, checkpoint_prefix)
    is_partitioned = len(checkpoint_files) > 1
    if is_partitioned:
        warnings.warn(
            f"Found more than one file with prefix {checkpoint_prefix} in directory {checkpoint_dir}."
            " Attempting to load ZeRO checkpoint.",
            stacklevel=2,
        )
    if not _zero_stage(ort_trainer) and is_partitioned:
        return _load_multi_checkpoint(ort_trainer, checkpoint_dir, checkpoint_prefix, strict, trusted)
    return _load_single_checkpoint(ort_trainer, checkpoint_dir, checkpoint_prefix, is_partitioned, strict, trusted)


def _torch_load(path: str, trusted: bool = False) -> Any:
    return torch_load(path, trusted, "experimental_load_checkpoint")


def _load_single_checkpoint(
    ort_trainer: FlatStateTrainer,
    checkpoint_dir: str,
    checkpoint_prefix: str,
    is_partitioned: bool,
    strict: bool,
    trusted: bool = False,
) -> dict[str, Any]:
    distributed = ort_trainer.options.distributed
    name = _get_checkpoint_name(checkpoint_prefix, is_partitioned, distributed.world_rank, distributed.world_size)
    checkpoint_file = os.path.join(checkpoint_dir, name)
    if not os.path.exists(checkpoint_file):
        message = f"Couldn't find checkpoint file {checkpoint_file}."
        if is_partitioned:
            message += (
                " Optimizer partitioning is enabled using ZeRO. Please make sure the checkpoint file exists "
                f"for rank {distributed.world_rank} of {distributed.world_size}"
            )
        raise AssertionError(message)
    checkpoint_state = _torch_load(checkpoint_file, trusted)
    _load_flat_state_dict(ort_trainer, checkpoint_state.pop("model"), strict=strict)
    return checkpoint_state


def _load_multi_checkpoint(
    ort_trainer: FlatStateTrainer, checkpoint_dir: str, checkpoint_prefix: str, strict: bool, trusted: bool = False
) -> dict[str, Any]:
    checkpoint_files = _list_checkpoint_files(checkpoint_dir, checkpoint_prefix)
    aggregate_state_dict = _CombineZeroCheckpoint(checkpoint_files, trusted=trusted)._aggregate_files()
    _load_flat_state_dict(ort_trainer, aggregate_state_dict, strict=strict)
    # The other keys of all files, later ranks winning on equal keys (legacy).
    extra: dict[str, Any] = {}
    for checkpoint_file in checkpoint_files:
        checkpoint_state = _torch_load(checkpoint_file, trusted)
        checkpoint_state.pop("model", None)
        extra.update(checkpoint_state)
    return extra


def _list_checkpoint_files(checkpoint_dir: str, checkpoint_prefix: str, extension: str = ".ort.pt") -> list[str]:
    """Files of ``checkpoint_dir`` starting with the prefix and ending in the extension, in rank order."""
    names = [f for f in os.listdir(checkpoint_dir) if f.startswith(checkpoint_prefix) and f.endswith(extension)]
    if not names:
        raise AssertionError(f"No checkpoint found with prefix '{checkpoint_prefix}' at '{checkpoint_dir}'")
    return [os.path.join(checkpoint_dir, f) for f in sorted(names, key=_rank_sort_key)]


def _rank_sort_key(name: str) -> tuple[int, str]:
    # Numeric rank order, so that rank 10 comes after rank 9 (os.listdir's order is arbitrary).
    match = _ZERO_NAME.search(name)
    return (int(match.group(1)) if match else -1, name)


def _get_checkpoint_name(
    prefix: str, is_partitioned: Any, world_rank: int | None = None, world_size: int | None = None
) -> str:
    """``<prefix>.ZeRO.<rank>.<world_size-1>.ort.pt`` when partitioned, else ``<prefix>.ort.pt``."""
    if is_partitioned:
        if world_rank is None or world_size is None:
            raise ValueError("a partitioned (ZeRO) checkpoint name needs world_rank and world_size")
        return f"{prefix}.ZeRO.{world_rank}.{world_size - 1}.ort.pt"
    return f"{prefix}.ort.pt"


def _split_state_dict(state_dict: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Split a flat state into ``optimizer`` (``Moment_1_``/``Moment_2_``/``Update_Count_``/``Step`` prefixes),
    ``fp16_param`` (``_fp16`` suffix) and ``fp32_param`` (the rest)."""
    split: dict[str, dict[str, Any]] = {"optimizer": {}, "fp32_param": {}, "fp16_param": {}}
    for key, value in state_dict.items():
        group = "optimizer" if key.startswith(_OPTIMIZER_PREFIXES) else "fp32_param"
        if key.endswith("_fp16"):
            group = "fp16_param"
        split[group][key] = value
    return split


class _CombineZeroCheckpoint:
    """Aggregate the ``<prefix>.ZeRO.<rank>.<world_size-1>.ort.pt`` files of all ranks into one flat state.

    Names with ``_view_<k>`` are shards: concatenated along dim 0 in rank order (``Update_Count_`` keeps the first
    shard) and reshaped to the shape of an unsharded copy of the same weight. Unsharded duplicates must be equal.
    """

    def __init__(
        self,
        checkpoint_files: list[str],
        clean_state_dict: Callable[[dict], dict] | None = None,
        *,
        trusted: bool = False,
    ) -> None:
        if not checkpoint_files:
            raise AssertionError("No checkpoint files passed")
        self.checkpoint_files = list(checkpoint_files)
        self.clean_state_dict = clean_state_dict
        self.trusted = trusted  # torch.load(weights_only=False) when True (see the module docstring)
        self.world_size = self._parse_name(self.checkpoint_files[0])[1] + 1
        if len(self.checkpoint_files) != self.world_size:
            raise AssertionError(f"Could not find {self.world_size} files")
        self.weight_shape_map: dict[str, Any] = {}
        self.sharded_params: set[str] = set()
        self.aggregate_state_dict: dict[str, Any] = {}

    @staticmethod
    def _parse_name(path: str) -> tuple[int, int]:
        match = _ZERO_NAME.search(os.path.basename(path))
        if not match:
            raise ValueError(f"{path} is not named like a ZeRO checkpoint (<prefix>.ZeRO.<rank>.<last rank>.ort.pt)")
        return int(match.group(1)), int(match.group(2))

    def _split_name(self, name: str) -> tuple[str, str, int | None, str]:
        """``(weight, optimizer prefix, view index, '_fp16' or '')`` of a flat state name."""
        base, _, view = name.partition("_view_")
        view_num = int(view) if view else None
        optimizer_key = next((p for p in ("Moment_1_", "Moment_2_", "Update_Count_") if base.startswith(p)), "")
        mp_suffix = "_fp16" if not optimizer_key and base.endswith("_fp16") else ""
        weight = base.removeprefix(optimizer_key).removesuffix("_fp16")
        return weight, optimizer_key, view_num, mp_suffix

    def _aggregate(self, param_dict: dict[str, Any]) -> None:
        for key, value in param_dict.items():
            weight, optimizer_key, view_num, mp_suffix = self._split_name(key)
            if view_num is None:
                if key in self.aggregate_state_dict:
                    if not torch.equal(self.aggregate_state_dict[key], value):
                        raise AssertionError(f"Unsharded params must have the same value: {key}")
                else:
                    self.aggregate_state_dict[key] = value
                self.weight_shape_map.setdefault(weight, value.size())
                continue
            name = optimizer_key + weight + mp_suffix
            if name in self.aggregate_state_dict and optimizer_key != "Update_Count_":
                self.sharded_params.add(name)
                self.aggregate_state_dict[name] = torch.cat((self.aggregate_state_dict[name], value))
            elif name not in self.aggregate_state_dict:
                self.aggregate_state_dict[name] = value

    def _reshape_tensor(self, key: str) -> None:
        weight = self._split_name(key)[0]
        if weight not in self.weight_shape_map:
            raise AssertionError(f"Cannot restore the shape of sharded {key}: no rank holds an unsharded {weight}")
        self.aggregate_state_dict[key] = self.aggregate_state_dict[key].reshape(self.weight_shape_map[weight])

    def aggregate_checkpoints(self) -> dict[str, Any]:
        """Load every rank's file (its ``'model'`` entry), merge fp16, fp32 then optimizer entries; reshape shards."""
        warnings.warn(
            "_CombineZeroCheckpoint.aggregate_checkpoints() will be deprecated soon. "
            "Please use aggregate_checkpoints() instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._aggregate_files()

    def _aggregate_files(self) -> dict[str, Any]:
        """``aggregate_checkpoints`` without the deprecation warning."""
        self.aggregate_state_dict = {}
        by_rank = {self._parse_name(path)[0]: path for path in self.checkpoint_files}
        for rank in range(self.world_size):
            if rank not in by_rank:
                raise AssertionError(f"Could not find the checkpoint file of rank {rank} among {self.checkpoint_files}")
            rank_state = _torch_load(by_rank[rank], self.trusted)
            rank_state = rank_state.get("model", rank_state)
            if self.clean_state_dict:
                rank_state = self.clean_state_dict(rank_state)
            split = _split_state_dict(rank_state)
            for group in ("fp16_param", "fp32_param", "optimizer"):
                self._aggregate(split[group])
        for key in self.sharded_params:
            self._reshape_tensor(key)
        return self.aggregate_state_dict
