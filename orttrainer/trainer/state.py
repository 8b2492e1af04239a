"""The trainer's state in the legacy state_dict layout (legacy_api.md §3.10–§3.11), both ways.

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
"""

from __future__ import annotations

import numpy as np
import torch

FULL_PRECISION = "full_precision"
LEGACY_FULL_PRECISION = "fp32"  # checkpoints written before ≈1.7
SHARED = "shared_optimizer_state"
ACCUMULATION = "gradient_accumulation"
LOSS_SCALER = "loss_scaler"


def build_state_dict(trainer, pytorch_format: bool = False) -> dict:
    """The trainer's current state; the session must exist."""
    session, compiled = trainer._training_session, trainer._compiled
    model = session.get_state(_model_state_names(trainer))
    if pytorch_format:
        return _pytorch_state_dict(trainer, model)
    state = {
        "model": {FULL_PRECISION: model},
        "optimizer": _optimizer_state(trainer),
        "trainer_options": _trainer_options(trainer),
        "train_step_info": {
            "optimization_step": trainer._train_step_info.optimization_step,
            "step": trainer._train_step_info.step,
        },
    }
    mid_window = trainer._train_step_info.step % trainer.options.batch.gradient_accumulation_steps
    if compiled.accumulation_buffers and mid_window:
        if trainer._world_size > 1:
            raise RuntimeError(
                "a state_dict in the middle of a gradient-accumulation window cannot be taken with data parallelism: "
                "each rank holds its own partial gradient sum. Save at an optimizer step (when "
                "_train_step_info.step % batch.gradient_accumulation_steps == 0)"
            )
        buffers = session.get_state(compiled.accumulation_buffers)
        state[ACCUMULATION] = {name[: -len("_grad_accumulation_buffer")]: value for name, value in buffers.items()}
    partition_info = _partition_info(trainer)
    if partition_info is not None:
        state["partition_info"] = partition_info
    scaler = _loss_scaler(trainer)
    if scaler is not None:
        state[LOSS_SCALER] = {
            "loss_scale": float(scaler.loss_scale),
            "stable_steps": int(getattr(scaler, "_stable_steps_count", 0)),
        }
    return state


def _model_state_names(trainer) -> list[str]:
    """Every trained and frozen tensor — except that a ZeRO rank under mixed precision saves only the master
    weights it owns (the legacy layout shards them; aggregation concatenates the ranks' files)."""
    trainable = trainer._compiled.trainable
    owners = getattr(trainer, "_zero_owners", None)
    if owners is not None and trainer.options.mixed_precision.enabled:
        trainable = [p for p in trainable if owners[p] == trainer._rank]
    return list(trainable) + list(trainer._frozen)


def _partition_info(trainer) -> dict | None:
    owners = getattr(trainer, "_zero_owners", None)
    if trainer.options.distributed.deepspeed_zero_optimization.stage == 0 or owners is None:
        return None
    shapes = trainer._compiled.shapes
    return {
        p: {"original_dim": np.array(shapes[p], dtype=np.int64), "megatron_row_partition": np.int64(-1)}
        for p, owner in owners.items()
        if owner == trainer._rank
    }


def _loss_scaler(trainer):
    mixed_precision = trainer.options.mixed_precision
    return mixed_precision.loss_scaler if mixed_precision.enabled else None


def _pytorch_state_dict(trainer, model: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Flat {name: tensor} for `torch.nn.Module.load_state_dict`: tied names and tensors the graph does not use
    (they never change in training) are included, so the original module accepts it with strict=True."""
    flat = {name: torch.from_numpy(value) for name, value in model.items()}
    for alias, canonical in getattr(trainer, "_torch_aliases", {}).items():
        if canonical in flat:
            flat[alias] = flat[canonical].clone()
    for name, value in getattr(trainer, "_torch_unused_state", {}).items():
        flat.setdefault(name, value.clone())
    keys = getattr(trainer, "_torch_state_dict_keys", None)
    if keys:
        flat = {k: flat[k] for k in keys if k in flat} | {k: v for k, v in flat.items() if k not in keys}
    return flat


def _optimizer_state(trainer) -> dict:
    name = trainer.optim_config.name
    if name == "SGDOptimizer":
        return {}
    session, graph = trainer._training_session, trainer._compiled.training
    moments = session.get_state(list(graph.optimizer_state))
    count = np.array([trainer._optimizer_updates + 1], dtype=np.int64)
    state: dict = {}
    for weight in graph.weight_updates:  # with ZeRO: only the tensors this rank updates
        entry = {"Moment_1": moments[f"Moment_1_{weight}"], "Moment_2": moments[f"Moment_2_{weight}"]}
        if name == "AdamOptimizer":
            entry["Update_Count"] = count.copy()
        state[weight] = entry
    if name == "LambOptimizer":
        state[SHARED] = {"Step": count.copy()}
    return state


def _trainer_options(trainer) -> dict:
    distributed = trainer.options.distributed
    world_size = trainer._world_size
    return {
        "mixed_precision": bool(trainer.options.mixed_precision.enabled),
        "zero_stage": int(distributed.deepspeed_zero_optimization.stage),
        "world_rank": int(trainer._rank),
        "world_size": int(world_size),
        "optimizer_name": trainer.optim_config.name,
        "data_parallel_size": int(world_size // distributed.horizontal_parallel_size),
        "horizontal_parallel_size": int(distributed.horizontal_parallel_size),
    }


# --------------------------------------------------------------------------------------------------------- loading
def is_pytorch_state_dict(state_dict) -> bool:
    """A plain module state_dict: flat names -> tensors/arrays, none of the legacy top-level keys."""
    return (
        bool(state_dict)
        and not ({"model", "optimizer", "trainer_options"} & set(state_dict))
        and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in state_dict.values())
    )


def apply_state_dict(trainer, state_dict: dict, strict: bool) -> None:
    """Load `state_dict` (legacy layout, or a plain PyTorch module state_dict) into the live session."""
    if is_pytorch_state_dict(state_dict):
        _load_pytorch_weights(trainer, state_dict, strict)
        return
    state_dict = _normalise_precision_key(state_dict)
    if state_dict.get("optimizer"):  # before the key checks: a different optimizer explains every key difference
        _check_optimizer_name(trainer, state_dict)
    if strict:
        zero_stage = trainer.options.distributed.deepspeed_zero_optimization.stage
        _check_keys(build_state_dict(trainer), state_dict, zero_stage)
    values: dict[str, np.ndarray] = {}
    if "model" in state_dict:
        values.update(_model_values(trainer, state_dict["model"], strict))
    updates = None
    if "optimizer" in state_dict:
        moments, updates = _optimizer_values(trainer, state_dict)
        values.update(moments)
    values.update(_accumulation_values(trainer, state_dict.get(ACCUMULATION, {})))
    trainer._training_session.set_state(values)  # validates every shape before anything changes
    if updates is not None:
        trainer._optimizer_updates = updates
    _load_loss_scaler(trainer, state_dict.get(LOSS_SCALER))
    _load_train_step_info(trainer, state_dict)


def _load_loss_scaler(trainer, saved: dict | None) -> None:
    """A checkpoint from a mixed-precision run carries its loss scale; an fp32 trainer has no use for it."""
    scaler = _loss_scaler(trainer)
    if saved is None or scaler is None:
        return
    scaler.loss_scale = float(saved["loss_scale"])
    if hasattr(scaler, "_stable_steps_count"):
        scaler._stable_steps_count = int(saved["stable_steps"])


def _model_values(trainer, model: dict, strict: bool) -> dict[str, np.ndarray]:
    known = set(trainer._compiled.trainable) | set(trainer._frozen)
    values = {}
    for precision, weights in model.items():
        for name, value in weights.items():
            if name in known:
                values[name] = _as_array(value)
            elif strict:
                raise RuntimeError(f"Unexpected key: {name} in state_dict[model][{precision}]")
    return values


def _optimizer_values(trainer, state_dict: dict) -> tuple[dict[str, np.ndarray], int | None]:
    optimizer = state_dict["optimizer"]
    if not optimizer:
        return {}, None
    values, counts = {}, set()
    for weight, entry in optimizer.items():
        if weight == SHARED:
            counts.update(int(np.asarray(v).reshape(-1)[0]) for k, v in entry.items() if k in ("Step", "step"))
            continue
        for key in ("Moment_1", "Moment_2"):
            if key in entry and f"{key}_{weight}" in trainer._compiled.training.optimizer_state:
                values[f"{key}_{weight}"] = _as_array(entry[key])
        if "Update_Count" in entry:
            counts.add(int(np.asarray(entry["Update_Count"]).reshape(-1)[0]))
    if len(counts) > 1:
        raise ValueError(
            f"the checkpoint's optimizer update counters differ between weights ({sorted(counts)}); "
            "orttrainer keeps one counter for all weights"
        )
    return values, (counts.pop() - 1 if counts else None)


def _check_optimizer_name(trainer, state_dict: dict) -> None:
    theirs = state_dict["trainer_options"]["optimizer_name"]
    theirs = theirs.decode() if isinstance(theirs, bytes) else str(theirs)
    mine = trainer.optim_config.name
    if theirs != mine:
        raise AssertionError(f"Optimizer mismatch: expected {mine}, got {theirs}")


def _accumulation_values(trainer, buffers: dict) -> dict[str, np.ndarray]:
    """The saved partial sums, or zeros for every buffer (a checkpoint saved at a window boundary has none)."""
    values = {}
    for name in trainer._compiled.accumulation_buffers:
        weight = name[: -len("_grad_accumulation_buffer")]
        values[name] = (
            _as_array(buffers[weight])
            if weight in buffers
            else np.zeros(trainer._compiled.shapes[weight], dtype=np.float32)
        )
    return values


def _load_pytorch_weights(trainer, state_dict: dict, strict: bool) -> None:
    known = set(trainer._compiled.trainable) | set(trainer._frozen)
    ignorable = set(getattr(trainer, "_torch_aliases", {})) | set(getattr(trainer, "_torch_unused_state", {}))
    if strict:
        missing = sorted(known - set(state_dict))
        unexpected = sorted(set(state_dict) - known - ignorable)
        if missing:
            raise RuntimeError(f"Missing keys: {missing} in state_dict")
        if unexpected:
            raise RuntimeError(f"Unexpected keys: {unexpected} in state_dict")
    trainer._training_session.set_state({k: _as_array(v) for k, v in state_dict.items() if k in known})


def _load_train_step_info(trainer, state_dict: dict) -> None:
    import warnings

    info = state_dict.get("train_step_info")
    if info is None:
        warnings.warn("Missing key: train_step_info in state_dict", stacklevel=2)
        return
    trainer._train_step_info.optimization_step = int(info["optimization_step"])
    trainer._train_step_info.step = int(info["step"])


def _check_keys(current: dict, loaded: dict, zero_stage: int) -> None:
    """Strict mode: the legacy key checks, missing keys reported before unexpected ones."""
    import warnings

    allow_unexpected = zero_stage > 0
    if "model" not in loaded:
        warnings.warn("Missing key: model in state_dict", stacklevel=2)
    else:
        _compare(current["model"], loaded["model"], "state_dict[model]", allow_unexpected)
        for precision in current["model"]:
            _compare(
                current["model"][precision],
                loaded["model"][precision],
                f"state_dict[model][{precision}]",
                allow_unexpected,
            )
    if "optimizer" not in loaded:
        warnings.warn("Missing key: optimizer in state_dict", stacklevel=2)
        return
    _compare(current["optimizer"], loaded["optimizer"], "state_dict[optimizer]", allow_unexpected)
    for weight in current["optimizer"]:
        _compare(
            current["optimizer"][weight],
            loaded["optimizer"][weight],
            f"state_dict[optimizer][{weight}]",
            allow_unexpected,
        )


def _compare(current: dict, loaded: dict, where: str, allow_unexpected: bool) -> None:
    missing = [k for k in current if k not in loaded]
    if missing:
        raise RuntimeError(f"Missing keys: {missing} in {where}")
    unexpected = [k for k in loaded if k not in current]
    if unexpected and not allow_unexpected:
        raise RuntimeError(f"Unexpected keys: {unexpected} in {where}")


def _normalise_precision_key(state_dict: dict) -> dict:
    model = state_dict.get("model")
    if isinstance(model, dict) and LEGACY_FULL_PRECISION in model and FULL_PRECISION not in model:
        model = {FULL_PRECISION if k == LEGACY_FULL_PRECISION else k: v for k, v in model.items()}
        return {**state_dict, "model": model}
    return state_dict


def _as_array(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def flat_state(trainer) -> dict[str, torch.Tensor]:
    """The experimental API's flat view: weights and optimizer tensors by their graph names
    (`Moment_1_<w>`, `Moment_2_<w>`, `Update_Count_<w>` for Adam, `Step` for LAMB)."""
    session, graph = trainer._training_session, trainer._compiled.training
    flat = {k: torch.from_numpy(v) for k, v in session.get_state(trainer._compiled.trainable + trainer._frozen).items()}
    flat.update({k: torch.from_numpy(v) for k, v in session.get_state(list(graph.optimizer_state)).items()})
    count = torch.tensor([trainer._optimizer_updates + 1], dtype=torch.int64)
    if trainer.optim_config.name == "AdamOptimizer":
        flat.update({f"Update_Count_{w}": count.clone() for w in graph.weight_updates})  # tensors with moments
    elif trainer.optim_config.name == "LambOptimizer":
        flat["Step"] = count
    return flat


def load_flat_state(trainer, flat: dict, strict: bool) -> None:
    """Inverse of `flat_state`; unknown names are an error under `strict`."""
    graph = trainer._compiled.training
    known = set(trainer._compiled.trainable) | set(trainer._frozen) | set(graph.optimizer_state)
    counters = {k: v for k, v in flat.items() if k.startswith("Update_Count_") or k == "Step"}
    unknown = sorted(set(flat) - known - set(counters))
    if strict and unknown:
        raise RuntimeError(f"Checkpoint tensor: {unknown[0]} is not present in the model.")
    trainer._training_session.set_state({k: _as_array(v) for k, v in flat.items() if k in known})
    if counters:
        values = {int(_as_array(v).reshape(-1)[0]) for v in counters.values()}
        if len(values) > 1:
            raise ValueError(f"the checkpoint's optimizer update counters differ ({sorted(values)})")
        trainer._optimizer_updates = values.pop() - 1
