"""The legacy state_dict / checkpoint layout, described once (docs/legacy_api.md §9.1–§9.2, §3.10–§3.11).

``ORTTrainer.state_dict(pytorch_format=False)`` and the HDF5 checkpoint files hold this tree (a checkpoint file is
the state dict plus ``user_dict``; HDF5 turns the groups into groups and the leaves into datasets)::

    model/
        full_precision/<name>               weights, frozen weights, buffers ("fp32" before ≈1.7)
    optimizer/
        <weight>/Moment_1, Moment_2         Adam and LAMB; ZeRO shards them across ranks
        <weight>/Update_Count               Adam: int64 [1], the 1-based number of the next update
        shared_optimizer_state/Step         LAMB: the same counter, once for all weights
    trainer_options/
        mixed_precision, zero_stage, world_rank, world_size, optimizer_name,
        data_parallel_size, horizontal_parallel_size        (the last two are absent before ≈1.7)
    train_step_info/
        optimization_step, step             orttrainer's addition: the TrainStepInfo counters
    partition_info/                         ZeRO / Megatron ranks only
        <weight>/original_dim               the unpartitioned shape
        <weight>/megatron_row_partition     Megatron's split axis flag (-1: not Megatron-partitioned)
    gradient_accumulation/<weight>          orttrainer's addition, only mid accumulation window: the running sums
    loss_scaler/
        loss_scale, stable_steps            orttrainer's addition, mixed precision only
    rng/
        seed, positions/<graph key>         orttrainer's addition: the trainer's dropout stream (same on every rank)
    user_dict                               checkpoint files only: a group (format, JSON tree, arrays; see
                                            ``user_dict``), or in files of the original a pickle as a hex string

Rules: every key is spelled by a constant here; code that reads or writes the layout uses them. After an HDF5
round trip strings come back as ``bytes`` and numbers as numpy scalars (see ``storage``). This module imports
neither torch nor onnxruntime.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# --- top level ------------------------------------------------------------------------------------------------------
MODEL = "model"
OPTIMIZER = "optimizer"
TRAINER_OPTIONS = "trainer_options"
TRAIN_STEP_INFO = "train_step_info"
PARTITION_INFO = "partition_info"
GRADIENT_ACCUMULATION = "gradient_accumulation"
LOSS_SCALER = "loss_scaler"
RNG = "rng"
USER_DICT = "user_dict"

# --- model/ ---------------------------------------------------------------------------------------------------------
FULL_PRECISION = "full_precision"
LEGACY_FULL_PRECISION = "fp32"  # checkpoints written before ≈1.7
PRECISION_KEYS = (FULL_PRECISION, LEGACY_FULL_PRECISION)  # current first

# --- optimizer/ -----------------------------------------------------------------------------------------------------
SHARED_OPTIMIZER_STATE = "shared_optimizer_state"
MOMENT_1 = "Moment_1"
MOMENT_2 = "Moment_2"
UPDATE_COUNT = "Update_Count"
STEP = "Step"  # LAMB's counter inside shared_optimizer_state (not train_step_info/step)
SHARDED_OPTIMIZER_KEYS = frozenset({MOMENT_1, MOMENT_2})  # what ZeRO partitions

# --- trainer_options/ -----------------------------------------------------------------------------------------------
MIXED_PRECISION = "mixed_precision"
ZERO_STAGE = "zero_stage"
WORLD_RANK = "world_rank"
WORLD_SIZE = "world_size"
OPTIMIZER_NAME = "optimizer_name"
DATA_PARALLEL_SIZE = "data_parallel_size"
HORIZONTAL_PARALLEL_SIZE = "horizontal_parallel_size"

# --- train_step_info/ -----------------------------------------------------------------------------------------------
OPTIMIZATION_STEP = "optimization_step"
TRAIN_STEP = "step"  # the number of train_step calls

# --- partition_info/<weight>/ ---------------------------------------------------------------------------------------
ORIGINAL_DIM = "original_dim"
MEGATRON_ROW_PARTITION = "megatron_row_partition"

# --- rng/ -----------------------------------------------------------------------------------------------------------
SEED = "seed"
POSITIONS = "positions"

# --- loss_scaler/ ---------------------------------------------------------------------------------------------------
LOSS_SCALE = "loss_scale"
STABLE_STEPS = "stable_steps"

TOP_LEVEL_KEYS = frozenset(
    {
        MODEL,
        OPTIMIZER,
        TRAINER_OPTIONS,
        TRAIN_STEP_INFO,
        PARTITION_INFO,
        GRADIENT_ACCUMULATION,
        LOSS_SCALER,
        RNG,
        USER_DICT,
    }
)


def optimizer_name_of(state: Mapping[str, Any]) -> str:
    """``trainer_options/optimizer_name`` of a state dict as ``str`` (HDF5 gives ``bytes``, decoded as UTF-8).

    ``KeyError`` when either level is missing.
    """
    name = state[TRAINER_OPTIONS][OPTIMIZER_NAME]
    return name.decode() if isinstance(name, bytes) else str(name)


def normalise_precision_key(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with a legacy ``model/fp32`` group renamed ``model/full_precision``.

    A state that already has ``full_precision`` (or no ``model`` dict) is returned as is; otherwise a new top-level
    dict and ``model`` dict are built (the caller's are not modified), keeping the key order.
    """
    model = state.get(MODEL)
    if not isinstance(model, dict) or LEGACY_FULL_PRECISION not in model or FULL_PRECISION in model:
        return state
    renamed = {FULL_PRECISION if key == LEGACY_FULL_PRECISION else key: value for key, value in model.items()}
    return {**state, MODEL: renamed}


def trainer_options(
    *,
    mixed_precision: Any,
    zero_stage: Any,
    world_rank: Any,
    world_size: Any,
    optimizer_name: Any,
    data_parallel_size: Any,
    horizontal_parallel_size: Any,
) -> dict[str, Any]:
    """The ``trainer_options`` group, keys in the legacy order; values are stored as given."""
    return {
        MIXED_PRECISION: mixed_precision,
        ZERO_STAGE: zero_stage,
        WORLD_RANK: world_rank,
        WORLD_SIZE: world_size,
        OPTIMIZER_NAME: optimizer_name,
        DATA_PARALLEL_SIZE: data_parallel_size,
        HORIZONTAL_PARALLEL_SIZE: horizontal_parallel_size,
    }


def is_partitioned(options: Mapping[str, Any]) -> bool:
    """Whether a ``trainer_options`` group belongs to one rank of a ZeRO (stage > 0) or Megatron (horizontal size
    > 1) run, whose files must be aggregated; a missing key means the unpartitioned default."""
    zero_stage = int(options.get(ZERO_STAGE, 0))
    horizontal = int(options.get(HORIZONTAL_PARALLEL_SIZE, 1))
    return zero_stage > 0 or horizontal > 1
