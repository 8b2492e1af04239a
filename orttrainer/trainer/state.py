"""The trainer's state in the legacy state_dict layout (docs/legacy_api.md §3.10–§3.11); loading is `state_load.py`.

Layout (pytorch_format=False):
  model/full_precision/<name>                 weights, frozen weights and buffers (float32 master weights)
  optimizer/<weight>/Moment_1, Moment_2       Adam and LAMB
  optimizer/<weight>/Update_Count             Adam: int64 [1], the 1-based number of the next update
  optimizer/shared_optimizer_state/Step       LAMB: the same counter, shared
  trainer_options/...                         mixed_precision, zero_stage, world_rank, world_size, optimizer_name,
                                              data_parallel_size, horizontal_parallel_size
  train_step_info/optimization_step, step
  gradient_accumulation/<weight>              only mid accumulation window: the running gradient sums, so a resumed
                                              run continues the window exactly (the original lost them)
  loss_scaler/loss_scale, stable_steps        mixed precision only: the loss scaler's state, so a resumed run
                                              continues with the same scale (the original restarted from 2^16)
  rng/seed, rng/positions/<graph key>         the trainer's dropout stream (trainer/rng.py), so a resumed run
                                              draws the masks the uninterrupted run would have drawn
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..checkpoint import layout
from .build import Built
from .config import TrainerConfig
from .graph.training import accumulation_buffer_name
from .progress import StepCounters

BUFFER_SUFFIX = accumulation_buffer_name("")  # buffer of weight w: f"{w}{BUFFER_SUFFIX}"


def build_state_dict(
    built: Built, config: TrainerConfig, counters: StepCounters, pytorch_format: bool = False
) -> dict[str, Any]:
    """The trainer's current state."""
    model = built.session.get_state(_model_state_names(built, config))
    if pytorch_format:
        return _pytorch_state_dict(built, model)
    state: dict[str, Any] = {
        layout.MODEL: {layout.FULL_PRECISION: model},
        layout.OPTIMIZER: _optimizer_state(built, config, counters),
        layout.TRAINER_OPTIONS: _trainer_options(config),
        layout.TRAIN_STEP_INFO: {
            layout.OPTIMIZATION_STEP: counters.info.optimization_step,
            layout.TRAIN_STEP: counters.info.step,
        },
    }
    accumulation = _accumulation_state(built, config, counters)
    if accumulation:
        state[layout.GRADIENT_ACCUMULATION] = accumulation
    partition_info = _partition_info(built, config)
    if partition_info is not None:
        state[layout.PARTITION_INFO] = partition_info
    if built.streams.active:
        state[layout.RNG] = built.streams.state()
    scaler = config.loss_scaler
    if scaler is not None:
        stable_steps = int(getattr(scaler, "_stable_steps_count", 0))  # only DynamicLossScaler counts them
        state[layout.LOSS_SCALER] = {layout.LOSS_SCALE: float(scaler.loss_scale), layout.STABLE_STEPS: stable_steps}
    return state


def _accumulation_state(built: Built, config: TrainerConfig, counters: StepCounters) -> dict[str, np.ndarray]:
    """The running gradient sums, taken only in the middle of an accumulation window."""
    buffers = built.compiled.accumulation_buffers
    if not buffers or not counters.info.step % config.accumulation_steps:
        return {}
    if config.world_size > 1:
        raise RuntimeError(
            "a state_dict in the middle of a gradient-accumulation window cannot be taken with data parallelism: "
            "each rank holds its own partial gradient sum. Save at an optimizer step (when "
            "_train_step_info.step % batch.gradient_accumulation_steps == 0)"
        )
    values = built.session.get_state(buffers)
    return {name.removesuffix(BUFFER_SUFFIX): value for name, value in values.items()}


def _model_state_names(built: Built, config: TrainerConfig) -> list[str]:
    """Every trained and frozen tensor — except that a ZeRO rank under mixed precision saves only the master
    weights it owns (the legacy layout shards them; aggregation concatenates the ranks' files)."""
    trainable = built.compiled.trainable
    owners = built.zero_owners
    if owners is not None and config.options.mixed_precision.enabled:
        trainable = [p for p in trainable if owners[p] == config.rank]
    return list(trainable) + list(built.compiled.frozen)


def _partition_info(built: Built, config: TrainerConfig) -> dict[str, dict[str, Any]] | None:
    owners = built.zero_owners
    if config.zero_stage == 0 or owners is None:
        return None
    shapes = built.compiled.shapes
    return {
        p: {layout.ORIGINAL_DIM: np.array(shapes[p], dtype=np.int64), layout.MEGATRON_ROW_PARTITION: np.int64(-1)}
        for p, owner in owners.items()
        if owner == config.rank
    }


def _pytorch_state_dict(built: Built, model: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Flat {name: tensor} for `torch.nn.Module.load_state_dict`: tied names and tensors the graph does not use
    (they never change in training) are included, so the original module accepts it with strict=True."""
    flat = {name: torch.from_numpy(value) for name, value in model.items()}
    info = built.torch_export
    if info is None:
        return flat
    for alias, canonical in info.aliases.items():
        if canonical in flat:
            flat[alias] = flat[canonical].clone()
    for name, value in info.unused_state.items():
        flat.setdefault(name, value.clone())
    keys = info.state_dict_keys
    return {k: flat[k] for k in keys if k in flat} | {k: v for k, v in flat.items() if k not in keys}


def _optimizer_state(built: Built, config: TrainerConfig, counters: StepCounters) -> dict[str, Any]:
    name = config.optim_config.name
    if name == "SGDOptimizer":
        return {}
    graph = built.compiled.training
    moments = built.session.get_state(list(graph.optimizer_state))
    count = np.array([counters.next_update], dtype=np.int64)
    state: dict[str, Any] = {}
    for weight in graph.weight_updates:  # with ZeRO: only the tensors this rank updates
        entry = {layout.MOMENT_1: moments[f"Moment_1_{weight}"], layout.MOMENT_2: moments[f"Moment_2_{weight}"]}
        if name == "AdamOptimizer":
            entry[layout.UPDATE_COUNT] = count.copy()
        state[weight] = entry
    if name == "LambOptimizer":
        state[layout.SHARED_OPTIMIZER_STATE] = {layout.STEP: count.copy()}
    return state


def _trainer_options(config: TrainerConfig) -> dict[str, Any]:
    distributed = config.options.distributed
    world_size = config.world_size
    return layout.trainer_options(
        mixed_precision=bool(config.options.mixed_precision.enabled),
        zero_stage=config.zero_stage,
        world_rank=int(config.rank),
        world_size=int(world_size),
        optimizer_name=config.optim_config.name,
        data_parallel_size=int(world_size // distributed.horizontal_parallel_size),
        horizontal_parallel_size=int(distributed.horizontal_parallel_size),
    )


def flat_state(built: Built, config: TrainerConfig, counters: StepCounters) -> dict[str, torch.Tensor]:
    """The experimental API's flat view: weights and optimizer tensors by their graph names
    (`Moment_1_<w>`, `Moment_2_<w>`, `Update_Count_<w>` for Adam, `Step` for LAMB)."""
    session, graph = built.session, built.compiled.training
    flat = {k: torch.from_numpy(v) for k, v in session.get_state(built.state_names).items()}
    flat.update({k: torch.from_numpy(v) for k, v in session.get_state(list(graph.optimizer_state)).items()})
    count = torch.tensor([counters.next_update], dtype=torch.int64)
    if config.optim_config.name == "AdamOptimizer":
        flat.update({f"Update_Count_{w}": count.clone() for w in graph.weight_updates})  # tensors with moments
    elif config.optim_config.name == "LambOptimizer":
        flat["Step"] = count
    return flat
