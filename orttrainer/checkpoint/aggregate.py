"""``aggregate_checkpoints``: merge the per-rank HDF5 checkpoints of a ZeRO and/or Megatron run into one state dict.

Algorithm of legacy ``checkpoint.aggregate_checkpoints`` (docs/legacy_api.md §9.4). Files are read one at a time
through ``orttrainer._checkpoint_storage.load`` (the legacy mock point), ordered by their saved ``world_rank``:

- ZeRO: optimizer moments of partitioned weights are concatenated in rank order and reshaped to ``original_dim``;
  fp32 weights are concatenated only under mixed precision (in full precision every rank holds the whole weight).
- Megatron: partitioned weights are concatenated along axis 0, or along the last axis when
  ``megatron_row_partition == 0``.
- ZeRO + Megatron: each data-parallel group is aggregated first (ZeRO), then the results across one horizontal
  group (Megatron). Legacy wrote the intermediate results to temporary files; here they stay in memory.

Everything that is not partitioned must be equal across files. That includes every top-level entry orttrainer
adds to the legacy layout (``train_step_info``, ``loss_scaler``, ``rng``, ``gradient_accumulation``, and any later
one): kept from the first rank, and required to be identical — same keys, same values — on every other rank.
Mismatches raise ``CheckpointAggregationError``, which names the file and the values involved.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from . import layout
from ._replicated import MERGED, is_lenient, replicated_entries, replicated_mismatches

# (trainer option, name used in the mismatch message) checked to agree across the files of one aggregation.
_MUST_AGREE = (
    (layout.MIXED_PRECISION, "Mixed precision state"),
    (layout.WORLD_SIZE, "World size state"),
    (layout.ZERO_STAGE, "Zero stage"),
    (layout.OPTIMIZER_NAME, "Optimizer name"),
)


class _AGGREGATION_MODE(Enum):  # noqa: N801 - legacy name
    Zero = 0
    Megatron = 1


class CheckpointAggregationError(ValueError, AssertionError):
    """The checkpoint files do not fit together. An AssertionError too: legacy raised these with ``assert``."""


def _require(condition: Any, message: str) -> None:
    # An explicit raise instead of `assert`: the checks must survive `python -O`.
    if not condition:
        raise CheckpointAggregationError(message)


def _load(path: Any, key: str | None = None) -> Any:
    from ..compat import checkpoint_storage  # looked up per call: patching the legacy module path takes effect

    return checkpoint_storage.load(path, key=key) if key else checkpoint_storage.load(path)


# --- public entry point -------------------------------------------------------------------------------------------


def aggregate_checkpoints(paths: Sequence[Any], pytorch_format: bool = True) -> dict[str, Any]:
    """Aggregate the checkpoint files of all ranks of a partitioned run into one state dict.

    ``paths``: one file per rank (any order), as written by ``ORTTrainer.save_checkpoint``. Returns the ORT layout
    of ``ORTTrainer.state_dict()`` (model, optimizer, trainer_options, user_dict and the replicated entries:
    train_step_info, loss_scaler, rng, gradient_accumulation) with ``pytorch_format=False``, or
    ``{name: torch.Tensor}`` of the full-precision model states with ``pytorch_format=True``. The result's
    trainer_options describe a single, unpartitioned trainer (zero_stage 0, world_size 1).
    Raises ``CheckpointAggregationError`` when the files are not partitioned, do not cover every rank exactly once,
    or disagree.
    """
    paths = list(paths)
    _require(paths, "aggregate_checkpoints needs at least one checkpoint file")
    options = _load(paths[0], key=layout.TRAINER_OPTIONS)
    data_size, horizontal_size, world_size = _parallel_sizes(options, paths[0])
    data_groups, horizontal_groups = _get_parallellism_groups(data_size, horizontal_size, world_size)
    combine_zero = int(options[layout.ZERO_STAGE]) > 0
    combine_megatron = len(horizontal_groups[0]) > 1
    _require(
        combine_zero or combine_megatron,
        f"{paths[0]} is not partitioned (zero_stage 0, horizontal_parallel_size 1): there is nothing to aggregate; "
        "load the file itself",
    )
    ordered = _order_paths(paths, data_groups, horizontal_groups)
    if combine_zero and combine_megatron:
        return _aggregate_over_D_H(ordered, data_groups, horizontal_groups, pytorch_format)
    if combine_zero:
        return _aggregate_over_ranks(ordered["D"][0], data_groups[0], pytorch_format=pytorch_format)
    return _aggregate_over_ranks(
        ordered["H"][0], horizontal_groups[0], mode=_AGGREGATION_MODE.Megatron, pytorch_format=pytorch_format
    )


def _parallel_sizes(options: Mapping[str, Any], path: Any) -> tuple[int, int, int]:
    world_size = int(options[layout.WORLD_SIZE])
    # Checkpoints from before ≈1.7 have no parallel sizes: they were pure data parallel.
    horizontal = int(options.get(layout.HORIZONTAL_PARALLEL_SIZE, 1))
    default_data = world_size // max(horizontal, 1)
    data = int(options.get(layout.DATA_PARALLEL_SIZE, default_data))
    _require(
        data >= 1 and horizontal >= 1 and data * horizontal == world_size,
        f"Inconsistent parallel sizes in {path}: data_parallel_size {data} x horizontal_parallel_size {horizontal} "
        f"!= world_size {world_size}",
    )
    return data, horizontal, world_size


def _get_parallellism_groups(
    data_parallel_size: int, horizontal_parallel_size: int, world_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Ranks of each data-parallel group (``[g + H*r]``) and of each horizontal group (``[g*H + r]``)."""
    data_groups = [
        [group + horizontal_parallel_size * r for r in range(data_parallel_size)]
        for group in range(world_size // data_parallel_size)
    ]
    horizontal_groups = [
        [group * horizontal_parallel_size + r for r in range(horizontal_parallel_size)]
        for group in range(world_size // horizontal_parallel_size)
    ]
    return data_groups, horizontal_groups


def _order_paths(
    paths: Sequence[Any],
    D_groups: list[list[int]],  # noqa: N803 - legacy names
    H_groups: list[list[int]],  # noqa: N803
) -> dict[str, list[list[Any]]]:
    """Sort the files by their saved ``world_rank`` and map every group's ranks to files.

    Rule: the files must hold each rank ``0 .. world_size-1`` exactly once.
    """
    ranks = [_scalar(_load(path, key=layout.TRAINER_OPTIONS)[layout.WORLD_RANK]) for path in paths]
    world_size = sum(len(group) for group in D_groups)
    found = ", ".join(f"{path}: rank {rank}" for path, rank in zip(paths, ranks, strict=True))
    _require(
        sorted(ranks) == list(range(world_size)),
        f"Expected one checkpoint file for each rank 0..{world_size - 1} (world_size {world_size}), got {found}",
    )
    by_rank = dict(zip(ranks, paths, strict=True))
    return {
        "D": [[by_rank[rank] for rank in group] for group in D_groups],
        "H": [[by_rank[rank] for rank in group] for group in H_groups],
    }


def _aggregate_over_D_H(
    ordered_paths: dict[str, list[list[Any]]],
    D_groups: list[list[int]],  # noqa: N803 - legacy names
    H_groups: list[list[int]],  # noqa: N803
    pytorch_format: bool,
) -> dict[str, Any]:
    """ZeRO + Megatron: aggregate each data group (keeping Megatron partition info), then one horizontal group."""
    original_dims: dict[str, Any] = {}
    partial = [
        (
            f"<data-parallel group {group_id}: ranks {group}>",
            _aggregate_over_ranks(
                ordered_paths["D"][group_id], group, original_dims, partial_aggregation=True, pytorch_format=False
            ),
        )
        for group_id, group in enumerate(D_groups)
    ]
    return _aggregate_states(
        partial, H_groups[0], original_dims, _AGGREGATION_MODE.Megatron, pytorch_format=pytorch_format
    )


def _aggregate_over_ranks(
    ordered_paths: Sequence[Any],
    ranks: Sequence[int],
    sharded_states_original_dims: dict[str, Any] | None = None,
    mode: _AGGREGATION_MODE = _AGGREGATION_MODE.Zero,
    partial_aggregation: bool = False,
    pytorch_format: bool = True,
) -> dict[str, Any]:
    """Aggregate the files of ``ranks`` (``ordered_paths[i]`` holds ``ranks[i]``), loading one file at a time."""
    named_states = ((path, _load(path)) for path in ordered_paths)
    return _aggregate_states(
        named_states, ranks, sharded_states_original_dims, mode, partial_aggregation, pytorch_format
    )


def _aggregate_states(
    named_states: Iterable[tuple[Any, Mapping[str, Any]]],
    ranks: Sequence[int],
    original_dims: dict[str, Any] | None = None,
    mode: _AGGREGATION_MODE = _AGGREGATION_MODE.Zero,
    partial_aggregation: bool = False,
    pytorch_format: bool = True,
) -> dict[str, Any]:
    original_dims = {} if original_dims is None else original_dims
    state: dict[str, Any] = {}
    agreed: dict[str, Any] = {}
    replicated: dict[str, Any] = {}  # the first rank's replicated entries, flattened
    mixed_precision = False
    for index, (name, rank_state) in _enumerate_ranks(named_states, ranks):
        _check_rank_file(rank_state, name, ranks[index], agreed)
        mixed_precision = bool(agreed[_MUST_AGREE[0][0]])
        _aggregate_model_states(rank_state, original_dims, state, mixed_precision, mode, name)
        if not pytorch_format:
            _aggregate_optimizer_states(rank_state, original_dims, state, mode, name)
            if partial_aggregation:
                _aggregate_megatron_partition_info(rank_state, state)
            if layout.TRAINER_OPTIONS not in state:
                _aggregate_trainer_options(rank_state, state, partial_aggregation)
            if layout.USER_DICT not in state and layout.USER_DICT in rank_state:
                state[layout.USER_DICT] = rank_state[layout.USER_DICT]
            if index == 0:
                replicated = replicated_entries(rank_state)
                state.update({key: value for key, value in rank_state.items() if key not in MERGED})
            else:
                _check_replicated(replicated, replicated_entries(rank_state), name, ranks[0])
    if not partial_aggregation:
        _reshape_states(original_dims, state, mixed_precision)
    return _to_pytorch_format(state) if pytorch_format else state


def _check_replicated(first: dict[str, Any], entries: dict[str, Any], name: Any, first_rank: int) -> None:
    """Refuse a rank whose replicated entries differ from the first rank's; a different dropout stream warns."""
    problems = replicated_mismatches(first, entries, name, first_rank)
    if problems and not is_lenient(problems[0][0]):
        raise CheckpointAggregationError(problems[0][1])
    if problems:
        messages = "; ".join(message for _, message in problems)
        warnings.warn(f"{messages}. The aggregated state continues rank {first_rank}'s dropout stream", stacklevel=5)


def _enumerate_ranks(
    named_states: Iterable[tuple[Any, Mapping[str, Any]]], ranks: Sequence[int]
) -> Iterator[tuple[int, tuple[Any, Mapping[str, Any]]]]:
    count = 0
    for count, item in enumerate(named_states, start=1):
        _require(count <= len(ranks), f"More checkpoint files than ranks {list(ranks)}")
        yield count - 1, item
    _require(count == len(ranks), f"Expected {len(ranks)} checkpoint files for ranks {list(ranks)}, got {count}")


def _check_rank_file(rank_state: Mapping[str, Any], name: Any, rank: int, agreed: dict[str, Any]) -> None:
    """A rank file must carry partition_info and trainer_options, hold the expected rank and agree with the
    earlier files on precision, world size, ZeRO stage and optimizer."""
    _require(layout.PARTITION_INFO in rank_state, f"Missing information: partition_info in checkpoint file {name}")
    _require(layout.TRAINER_OPTIONS in rank_state, f"Missing information: trainer_options in checkpoint file {name}")
    options = rank_state[layout.TRAINER_OPTIONS]
    found_rank = _scalar(options[layout.WORLD_RANK])
    _require(found_rank == rank, f"Unexpected rank in file at path {name}. Expected {rank}, got {found_rank}")
    for key, what in _MUST_AGREE:
        value = options[key]
        if key not in agreed:
            agreed[key] = value
            continue
        _require(
            np.array_equal(agreed[key], value),
            f"{what} mismatch among checkpoint files. File: {name} (expected {agreed[key]!r}, got {value!r})",
        )


# --- merging ------------------------------------------------------------------------------------------------------


def _add_or_update_sharded_key(
    state_key: str,
    state_value: np.ndarray,
    state_sub_dict: dict[str, Any],
    model_state_key: str,
    state_partition_info: Mapping[str, Any],
    sharded_states_original_dims: dict[str, Any],
    mode: _AGGREGATION_MODE,
) -> None:
    """Append this rank's shard (rank order); remember the weight's original shape for the final reshape."""
    sharded_states_original_dims[model_state_key] = state_partition_info[layout.ORIGINAL_DIM]
    axis = 0
    if mode == _AGGREGATION_MODE.Megatron and _scalar(state_partition_info[layout.MEGATRON_ROW_PARTITION]) == 0:
        axis = -1
    if state_key in state_sub_dict:
        state_sub_dict[state_key] = np.concatenate((state_sub_dict[state_key], state_value), axis)
    else:
        state_sub_dict[state_key] = state_value


def _add_or_validate_unsharded_key(
    state_key: str, state_value: Any, state_sub_dict: dict[str, Any], mismatch_error_string: str
) -> None:
    """A replicated state: keep the first copy, require every later copy to be equal."""
    if state_key in state_sub_dict:
        _require(np.array_equal(state_sub_dict[state_key], state_value), mismatch_error_string)
    else:
        state_sub_dict[state_key] = state_value


def _aggregate_model_states(
    rank_state: Mapping[str, Any],
    original_dims: dict[str, Any],
    state: dict[str, Any],
    mixed_precision: bool,
    mode: _AGGREGATION_MODE = _AGGREGATION_MODE.Zero,
    name: Any = "",
) -> None:
    if layout.MODEL not in rank_state:
        return
    target = state.setdefault(layout.MODEL, {}).setdefault(layout.FULL_PRECISION, {})
    partition_info = rank_state[layout.PARTITION_INFO]
    for weight, value in rank_state[layout.MODEL][layout.FULL_PRECISION].items():
        # ZeRO shards the fp32 master weights only under mixed precision; Megatron always.
        if weight in partition_info and (mode == _AGGREGATION_MODE.Megatron or mixed_precision):
            _add_or_update_sharded_key(weight, value, target, weight, partition_info[weight], original_dims, mode)
        else:
            message = f"Value mismatch for model state {weight} (file: {name})"
            _add_or_validate_unsharded_key(weight, value, target, message)


def _aggregate_optimizer_states(
    rank_state: Mapping[str, Any],
    original_dims: dict[str, Any],
    state: dict[str, Any],
    mode: _AGGREGATION_MODE = _AGGREGATION_MODE.Zero,
    name: Any = "",
) -> None:
    if layout.OPTIMIZER not in rank_state:
        return
    optimizer = state.setdefault(layout.OPTIMIZER, {})
    partition_info = rank_state[layout.PARTITION_INFO]
    for weight, weight_states in rank_state[layout.OPTIMIZER].items():
        for key, value in weight_states.items():
            target = optimizer.setdefault(weight, {})
            if key in layout.SHARDED_OPTIMIZER_KEYS and weight in partition_info:
                _add_or_update_sharded_key(key, value, target, weight, partition_info[weight], original_dims, mode)
            else:
                message = f"Value mismatch for model state {weight} and optimizer state {key} (file: {name})"
                _add_or_validate_unsharded_key(key, value, target, message)


def _aggregate_megatron_partition_info(rank_state: Mapping[str, Any], state: dict[str, Any]) -> None:
    """Partial (data-group) results keep the partition info of Megatron-partitioned weights for the second pass."""
    kept = state.setdefault(layout.PARTITION_INFO, {})
    for weight, info in rank_state[layout.PARTITION_INFO].items():
        if (
            weight not in kept
            and layout.MEGATRON_ROW_PARTITION in info
            and _scalar(info[layout.MEGATRON_ROW_PARTITION]) >= 0
        ):
            kept[weight] = info


def _aggregate_trainer_options(rank_state: Mapping[str, Any], state: dict[str, Any], partial_aggregation: bool) -> None:
    """The result is a single unpartitioned trainer; a partial result keeps its group's first rank."""
    options = rank_state[layout.TRAINER_OPTIONS]
    state[layout.TRAINER_OPTIONS] = layout.trainer_options(
        mixed_precision=options[layout.MIXED_PRECISION],
        zero_stage=0,
        world_rank=options[layout.WORLD_RANK] if partial_aggregation else 0,
        world_size=1,
        optimizer_name=options[layout.OPTIMIZER_NAME],
        data_parallel_size=1,
        horizontal_parallel_size=1,
    )


def _reshape_states(original_dims: dict[str, Any], state: dict[str, Any], mixed_precision: bool) -> None:
    """Give sharded tensors their original shape: model states under mixed precision, moments always."""
    for weight, dims in original_dims.items():
        model_states = state.get(layout.MODEL, {}).get(layout.FULL_PRECISION, {})
        if mixed_precision and weight in model_states:
            model_states[weight] = _reshaped(model_states[weight], dims, f"model state {weight}")
        for key, value in state.get(layout.OPTIMIZER, {}).get(weight, {}).items():
            if key in layout.SHARDED_OPTIMIZER_KEYS:
                where = f"optimizer state {key} of {weight}"
                state[layout.OPTIMIZER][weight][key] = _reshaped(value, dims, where)


def _reshaped(value: np.ndarray, dims: Any, where: str) -> np.ndarray:
    shape = tuple(int(d) for d in np.asarray(dims).reshape(-1))
    _require(
        value.size == int(np.prod(shape)),
        f"Cannot reshape the aggregated {where} ({value.size} elements) to its original shape {list(shape)}: "
        "is a rank file missing or from another run?",
    )
    return value.reshape(shape)


def _to_pytorch_format(state: Mapping[str, Any]) -> dict[str, Any]:
    """The flat ``{name: torch.Tensor}`` of the full-precision model states (loadable by ``nn.Module``)."""
    model_states = state.get(layout.MODEL, {}).get(layout.FULL_PRECISION, {})
    return {name: torch.tensor(value) for name, value in model_states.items()}


def _scalar(value: Any) -> int:
    # Saved as a Python int, a one-element list, or (after HDF5) a numpy scalar or array.
    return int(np.asarray(value).reshape(-1)[0])
