"""The trainer's state in the legacy state_dict layout, both ways (docs/legacy_api.md §3.10–§3.11).

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
  rng/seed, rng/positions/<graph key>         the trainer's dropout stream (state.DropoutStreams), so a resumed
                                              run draws the masks the uninterrupted run would have drawn

Loading (`apply_state_dict`) takes the legacy layout, a plain PyTorch module state_dict, or (`load_flat_state`) the
experimental API's flat `{name: tensor}`. Every value is checked before any is applied (`set_state`), so a bad
state leaves the trainer as it was.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..checkpoint import layout
from .compile.contract import accumulation_buffer_name
from .config import TrainerConfig
from .model import Built
from .state import DropoutStreams, StepCounters, TrainerState, uninterrupted

BUFFER_SUFFIX = accumulation_buffer_name("")  # buffer of weight w: f"{w}{BUFFER_SUFFIX}"


def build_state_dict(
    built: Built, config: TrainerConfig, state: TrainerState, pytorch_format: bool = False
) -> dict[str, Any]:
    """The trainer's current state."""
    counters = state.counters
    model = built.session.get_state(_model_state_names(built, config))
    if pytorch_format:
        return _pytorch_state_dict(built, model)
    saved: dict[str, Any] = {
        layout.MODEL: {layout.FULL_PRECISION: model},
        layout.OPTIMIZER: _optimizer_state(built, config, counters),
        layout.TRAINER_OPTIONS: _trainer_options(config),
        layout.TRAIN_STEP_INFO: {
            layout.OPTIMIZATION_STEP: counters.info.optimization_step,
            layout.TRAIN_STEP: counters.info.step,
        },
    }
    accumulation = _accumulation_state(built, config, state)
    if accumulation:
        saved[layout.GRADIENT_ACCUMULATION] = accumulation
    partition_info = _partition_info(built, config)
    if partition_info is not None:
        saved[layout.PARTITION_INFO] = partition_info
    if state.streams.active:
        saved[layout.RNG] = state.streams.state()
    scaler = state.loss_scaler
    if scaler is not None:
        stable_steps = int(getattr(scaler, "_stable_steps_count", 0))  # only DynamicLossScaler counts them
        saved[layout.LOSS_SCALER] = {layout.LOSS_SCALE: float(scaler.loss_scale), layout.STABLE_STEPS: stable_steps}
    return saved


def _accumulation_state(built: Built, config: TrainerConfig, state: TrainerState) -> dict[str, np.ndarray]:
    """The running gradient sums, taken only in the middle of an accumulation window."""
    buffers = built.compiled.accumulation_buffers
    if not buffers or not state.window.mid_window(state.counters.info.step):
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


def is_pytorch_state_dict(state_dict: dict[str, Any]) -> bool:
    """A plain module state_dict: flat names -> tensors/arrays, none of the legacy top-level keys."""
    return (
        bool(state_dict)
        and not ({layout.MODEL, layout.OPTIMIZER, layout.TRAINER_OPTIONS} & set(state_dict))
        and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in state_dict.values())
    )


@dataclass(frozen=True)
class _Load:
    """Everything a state dict changes, read and checked: `values` by `SessionBase.checked_state` and finite; the
    rest parsed. Applying it cannot fail halfway (`_apply`)."""

    values: dict[str, np.ndarray]
    optimizer_updates: int | None = None  # the next update's number minus one
    loss_scaler: tuple[float, int] | None = None  # loss scale, stable steps
    rng: tuple[int, dict[str, int]] | None = None  # state.DropoutStreams.parsed
    progress: tuple[int, int] | None = None  # optimization_step, step


def apply_state_dict(
    built: Built, config: TrainerConfig, state: TrainerState, state_dict: dict[str, Any], strict: bool
) -> None:
    """Load `state_dict` (legacy layout, or a plain PyTorch module state_dict) into the live session. All or
    nothing: every part (weights, optimizer state, counters, loss scaler, dropout stream) is read and checked before
    any is applied, and the application is not split by an interrupt (`state.uninterrupted`)."""
    if is_pytorch_state_dict(state_dict):
        load = _Load(_checked(built, _pytorch_weights(built, state_dict, strict)))
    else:
        load = _legacy_load(built, config, state, state_dict, strict)
    _apply(built, state, load)


def _legacy_load(
    built: Built, config: TrainerConfig, state: TrainerState, state_dict: dict[str, Any], strict: bool
) -> _Load:
    state_dict = layout.normalise_precision_key(state_dict)
    if layout.OPTIMIZER in state_dict and layout.TRAINER_OPTIONS in state_dict:
        # before the key checks: a different optimizer explains every key difference (an SGD checkpoint's
        # optimizer entry is empty, and is a mismatch all the same)
        _check_optimizer_name(config, state_dict)
    if strict:
        _check_keys(build_state_dict(built, config, state), state_dict, config.zero_stage)
    values: dict[str, np.ndarray] = {}
    if layout.MODEL in state_dict:
        values.update(_model_values(built, state_dict[layout.MODEL], strict))
    updates = None
    if layout.OPTIMIZER in state_dict:
        moments, updates = _optimizer_values(built, state_dict[layout.OPTIMIZER])
        values.update(moments)
    values.update(_accumulation_values(built, state_dict.get(layout.GRADIENT_ACCUMULATION, {})))
    rng = DropoutStreams.parsed(state_dict[layout.RNG]) if layout.RNG in state_dict else None
    scaler = _loss_scaler_values(state, state_dict.get(layout.LOSS_SCALER))
    return _Load(_checked(built, values), updates, scaler, rng, _train_step_info(state_dict))


def _apply(built: Built, state: TrainerState, load: _Load) -> None:
    """Apply a checked load: the session's tensors first (all of them copied to the device before any is
    replaced), then the counters, the loss scaler and the dropout stream."""
    with uninterrupted():
        built.session.set_state(load.values)
        counters = state.counters
        if load.optimizer_updates is not None:
            counters.optimizer_updates = load.optimizer_updates
        if load.loss_scaler is not None and state.loss_scaler is not None:
            scaler = state.loss_scaler
            scaler.loss_scale = load.loss_scaler[0]
            if hasattr(scaler, "_stable_steps_count"):
                scaler._stable_steps_count = load.loss_scaler[1]
        if load.progress is not None:
            counters.info.optimization_step, counters.info.step = load.progress
        if load.rng is not None and state.streams.adopt(*load.rng):
            built.session.reopen_graphs()  # the sessions' Dropout seeds follow the loaded positions


def load_flat_state(built: Built, state: TrainerState, flat: dict[str, Any], strict: bool) -> None:
    """Inverse of `flat_state`; unknown names are an error under `strict`. All or nothing, as `apply_state_dict`."""
    graph = built.compiled.training
    known = set(built.state_names) | set(graph.optimizer_state)
    update_counts = {k: v for k, v in flat.items() if k.startswith("Update_Count_") or k == "Step"}
    unknown = sorted(set(flat) - known - set(update_counts))
    if strict and unknown:
        raise RuntimeError(f"Checkpoint tensor: {unknown[0]} is not present in the model.")
    updates = None
    if update_counts:
        counts = {_counter(v, name) for name, v in update_counts.items()}
        if len(counts) > 1:
            raise ValueError(f"the checkpoint's optimizer update counters differ ({sorted(counts)})")
        updates = counts.pop() - 1
    values = _checked(built, {k: _as_array(v) for k, v in flat.items() if k in known})
    _apply(built, state, _Load(values, updates))


def _checked(built: Built, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`values` checked by the session (names, shapes, element types), and finite: orttrainer never loads NaN or
    Inf into weights, optimizer moments or accumulation buffers (docs/design.md § Failure atomicity) — such a state
    comes from a run that had already diverged, and training on from it would only spread the NaN."""
    arrays = built.session.checked_state(values)
    bad = [n for n, a in arrays.items() if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all()]
    if bad:
        raise ValueError(
            f"the state to load holds NaN or Inf in {sorted(bad)}; orttrainer refuses to load non-finite weights, "
            "optimizer moments or gradient sums (nothing was changed). Load an earlier checkpoint"
        )
    return arrays


def _counter(value: Any, where: str) -> int:
    """An optimizer update counter (int64 [1] in the legacy layout): at least 1."""
    count = _whole_number(value)
    if count is None or count < 1:
        raise ValueError(f"state_dict {where}: expected a positive integer update counter, got {value!r}")
    return count


def _loss_scaler_values(state: TrainerState, saved: dict[str, Any] | None) -> tuple[float, int] | None:
    """A checkpoint from a mixed-precision run carries its loss scale; an fp32 trainer has no use for it."""
    if saved is None or state.loss_scaler is None:
        return None
    try:
        scale, stable = float(saved[layout.LOSS_SCALE]), int(saved.get(layout.STABLE_STEPS, 0))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"state_dict[loss_scaler] is malformed ({type(err).__name__}: {err})") from err
    if not np.isfinite(scale) or scale <= 0 or stable < 0:
        raise ValueError(f"state_dict[loss_scaler]: loss scale {scale} and stable steps {stable} are out of range")
    return scale, stable


def _model_values(built: Built, model: dict[str, Any], strict: bool) -> dict[str, np.ndarray]:
    known = set(built.state_names)
    values = {}
    for precision, weights in model.items():
        for name, value in weights.items():
            if name in known:
                values[name] = _as_array(value)
            elif strict:
                raise RuntimeError(f"Unexpected key: {name} in state_dict[model][{precision}]")
    return values


def _optimizer_values(built: Built, optimizer: dict[str, Any]) -> tuple[dict[str, np.ndarray], int | None]:
    if not optimizer:
        return {}, None
    values: dict[str, np.ndarray] = {}
    counts: set[int] = set()
    moments = built.compiled.training.optimizer_state
    for weight, entry in optimizer.items():
        if weight == layout.SHARED_OPTIMIZER_STATE:
            counts.update(
                _counter(v, f"[optimizer][{weight}][{k}]") for k, v in entry.items() if k in (layout.STEP, "step")
            )
            continue
        for moment in (layout.MOMENT_1, layout.MOMENT_2):
            if moment in entry and f"{moment}_{weight}" in moments:
                values[f"{moment}_{weight}"] = _as_array(entry[moment])
        if layout.UPDATE_COUNT in entry:
            counts.add(_counter(entry[layout.UPDATE_COUNT], f"[optimizer][{weight}][{layout.UPDATE_COUNT}]"))
    if len(counts) > 1:
        raise ValueError(
            f"the checkpoint's optimizer update counters differ between weights ({sorted(counts)}); "
            "orttrainer keeps one counter for all weights"
        )
    return values, (counts.pop() - 1 if counts else None)


def _check_optimizer_name(config: TrainerConfig, state_dict: dict[str, Any]) -> None:
    theirs, mine = layout.optimizer_name_of(state_dict), config.optim_config.name
    if theirs != mine:
        raise AssertionError(f"Optimizer mismatch: expected {mine}, got {theirs}")


def _accumulation_values(built: Built, buffers: dict[str, Any]) -> dict[str, np.ndarray]:
    """The saved partial sums, or zeros for every buffer (a checkpoint saved at a window boundary has none)."""
    values = {}
    for name in built.compiled.accumulation_buffers:
        weight = name.removesuffix(BUFFER_SUFFIX)
        saved = buffers.get(weight)
        values[name] = _as_array(saved) if saved is not None else np.zeros(built.compiled.shapes[weight], np.float32)
    return values


def _pytorch_weights(built: Built, state_dict: dict[str, Any], strict: bool) -> dict[str, np.ndarray]:
    known = set(built.state_names)
    info = built.torch_export
    ignorable = set(info.aliases) | set(info.unused_state) if info is not None else set()
    if strict:
        missing = sorted(known - set(state_dict))
        unexpected = sorted(set(state_dict) - known - ignorable)
        if missing:
            raise RuntimeError(f"Missing keys: {missing} in state_dict")
        if unexpected:
            raise RuntimeError(f"Unexpected keys: {unexpected} in state_dict")
    return {k: _as_array(v) for k, v in state_dict.items() if k in known}


def _train_step_info(state_dict: dict[str, Any]) -> tuple[int, int] | None:
    """(optimization_step, step) of the state dict; a state dict without them warns (legacy) and leaves the
    counters alone."""
    info = state_dict.get(layout.TRAIN_STEP_INFO)
    if info is None:
        warnings.warn("Missing key: train_step_info in state_dict", stacklevel=3)
        return None
    counts = []
    for key in (layout.OPTIMIZATION_STEP, layout.TRAIN_STEP):
        value = info.get(key) if isinstance(info, dict) else None
        count = _whole_number(value)
        if count is None or count < 0:
            missing = "" if value is not None else " (missing)"
            raise ValueError(
                f"state_dict[train_step_info][{key}] must be a non-negative integer, got {value!r}{missing}"
            )
        counts.append(count)
    return counts[0], counts[1]


def _whole_number(value: Any) -> int | None:
    """A whole number stored as an int (numpy or Python, or a one-element array of one) or an integral float; None
    for anything else."""
    array = np.asarray(value) if value is not None else None
    if array is None or array.size != 1 or array.dtype == np.bool_:
        return None
    number = array.reshape(-1)[0].item()
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return number if isinstance(number, int) else None


def _check_keys(current: dict[str, Any], loaded: dict[str, Any], zero_stage: int) -> None:
    """Strict mode: the legacy key checks, missing keys reported before unexpected ones."""
    allow_unexpected = zero_stage > 0
    if layout.MODEL not in loaded:
        warnings.warn("Missing key: model in state_dict", stacklevel=2)
    else:
        _compare(current[layout.MODEL], loaded[layout.MODEL], "state_dict[model]", allow_unexpected)
        for precision in current[layout.MODEL]:
            where = f"state_dict[model][{precision}]"
            expected = _without_older_counters(current[layout.MODEL][precision], loaded[layout.MODEL][precision])
            _compare(expected, loaded[layout.MODEL][precision], where, allow_unexpected)
    if layout.OPTIMIZER not in loaded:
        warnings.warn("Missing key: optimizer in state_dict", stacklevel=2)
        return
    _compare(current[layout.OPTIMIZER], loaded[layout.OPTIMIZER], "state_dict[optimizer]", allow_unexpected)
    for weight in current[layout.OPTIMIZER]:
        where = f"state_dict[optimizer][{weight}]"
        _compare(current[layout.OPTIMIZER][weight], loaded[layout.OPTIMIZER][weight], where, allow_unexpected)


_COUNTER_SUFFIX = "num_batches_tracked"


def _without_older_counters(current: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    """`current` without the BatchNorm batch counters `loaded` lacks, with a warning: the original ORTTrainer, and
    orttrainer before it updated BatchNorm's statistics, saved no `num_batches_tracked`; such a checkpoint loads
    strictly, and the counters keep their values."""
    older = sorted(k for k in current if k.endswith(_COUNTER_SUFFIX) and k not in loaded)
    if older:
        warnings.warn(
            f"the state dict has no {older} (saved before they were trained); they keep their values", stacklevel=4
        )
    return {k: v for k, v in current.items() if k not in older}


def _compare(current: dict[str, Any], loaded: dict[str, Any], where: str, allow_unexpected: bool) -> None:
    missing = [k for k in current if k not in loaded]
    if missing:
        raise RuntimeError(f"Missing keys: {missing} in {where}")
    unexpected = [k for k in loaded if k not in current]
    if unexpected and not allow_unexpected:
        raise RuntimeError(f"Unexpected keys: {unexpected} in {where}")


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)
