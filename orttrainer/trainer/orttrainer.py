"""`ORTTrainer`: the legacy training front end (legacy_api.md §3) on orttrainer's compiler and session."""

from __future__ import annotations

import inspect
import os
import warnings

import onnx
import torch

from .. import amp, optim
from .._require import require as _require
from ..checkpoint import storage
from ..schema.model_desc import _ORTTrainerModelDesc
from ..schema.options import ORTTrainerOptions
from ..train_step_info import TrainStepInfo
from . import state as state_mod
from .activations import ActivationStatistics
from .builders import BuilderChoice, TorchSource, choose_builder
from .building import SessionBuilding
from .compile import CompiledModel
from .distributed import resolve_context
from .graph.editor import copy_model
from .inputs import check_inputs, check_outputs, order_inputs
from .session import Device, TrainingSession
from .support import check_data_parallel_options, check_supported_options


class ORTTrainer(SessionBuilding):
    """Train a PyTorch model (plus loss function) or an ONNX model with a loss output, on ONNX Runtime.

    Args:
        model: a `torch.nn.Module`, or an `onnx.ModelProto` whose model_desc marks one output `is_loss=True`.
        model_desc: `{'inputs': [(name, shape), ...], 'outputs': [(name, shape[, is_loss]), ...]}`.
        optim_config: `optim.AdamConfig`, `optim.LambConfig` or `optim.SGDConfig`.
        loss_fn: `loss_fn(predictions, label)`; the label is the last model_desc input.
        options: `ORTTrainerOptions`.
    """

    def __init__(self, model, model_desc, optim_config, loss_fn=None, options=None) -> None:
        _require(model is not None, "'model' is required and must be either a 'torch.nn.Module' or ONNX model")
        _require(isinstance(model_desc, dict), "'model_desc' must be a 'dict'")
        _require(
            isinstance(optim_config, optim._OptimizerConfig),
            "'optim_config' is required and must be any of 'AdamConfig', 'LambConfig' or 'SGDConfig'",
        )
        _require(
            loss_fn is None or _takes_two_arguments(loss_fn),
            "'loss_fn' must be either 'None' or a callable with two parameters",
        )
        _require(
            options is None or isinstance(options, ORTTrainerOptions),
            "'options' must be either 'None' or 'ORTTrainerOptions'",
        )
        self._torch_model = None
        self._onnx_model = None
        if isinstance(model, torch.nn.Module):
            self._torch_model = model
            self._torch_state_dict_keys = list(model.state_dict().keys())
        elif isinstance(model, onnx.ModelProto):
            _require(loss_fn is None, "'loss_fn' must not be specified when 'model' is an ONNX model")
        else:
            raise ValueError("'model' must be either 'torch.nn.Module' or 'onnx.ModelProto'")
        self.loss_fn = loss_fn
        self.model_desc = _ORTTrainerModelDesc(model_desc)
        self.optim_config = optim_config
        self.options = options or ORTTrainerOptions()
        if self.options.mixed_precision.enabled and not self.options.mixed_precision.loss_scaler:
            self.options.mixed_precision.loss_scaler = amp.DynamicLossScaler()
        check_supported_options(self.options)
        self._device = Device.parse(self.options.device.id)
        self._distributed = resolve_context(self.options, self._device.type)
        self._rank = self._distributed.rank if self._distributed else 0
        self._world_size = self._distributed.world_size if self._distributed else 1
        self._zero_owners: dict[str, int] | None = None
        if self._distributed and self._device.type == "cuda" and self.options.device.id.strip().lower() == "cuda":
            self._device = Device("cuda", self._distributed.local_rank)  # one GPU per local rank
        check_data_parallel_options(self.options, self._world_size)
        self._train_step_info = TrainStepInfo(optim_config)
        self._training_session: TrainingSession | None = None
        self._compiled: CompiledModel | None = None
        self._optimizer_updates = 0  # updates applied so far; the next one is number `_optimizer_updates + 1`
        self._dropout_off = False
        self._frozen: list[str] = []
        self._pending_state: tuple[dict, bool] | None = None
        self.torch_sample_outputs = None
        self._activations = ActivationStatistics(self._torch_model)  # orttrainer.debug subscribers, in the graph
        self._builder_choice: BuilderChoice | None = None
        self._gradient_builder: str | None = None  # 'ort' or 'torch' once compiled
        self._torch_source: TorchSource | None = None
        self._sample_inputs: list | None = None
        if isinstance(model, onnx.ModelProto):
            self._builder_choice = choose_builder(self.options._internal_use.gradient_builder, onnx_model=True)
            self._onnx_model = self._postprocess(model, check_result=True)
            self._type_descriptions_from_graph()
            self._init_session()

    # ------------------------------------------------------------------------------------------------ public API
    def train_step(self, *args, **kwargs):
        """One training micro-step; returns the model_desc outputs (or `_train_step_info.fetches`)."""
        inputs = order_inputs(args, kwargs, self.model_desc.inputs)
        if self._training_session is None:
            self._init_onnx_model(inputs)
            if self.options.debug.check_model_export:
                self._check_model_export(inputs)
        sizes = check_inputs(inputs, self.model_desc.inputs)
        info = self._train_step_info
        names = self._requested_outputs(info.fetches)
        data = {d.name: t for d, t in zip(self.model_desc.inputs, inputs, strict=True)}
        self._training_session.prepare(data)  # a graph for new input shapes (torch builder) fails before any count
        info.step += 1
        optimizer_step = info.step % self.options.batch.gradient_accumulation_steps == 0
        lr = self._learning_rate()
        scaler = self.options.mixed_precision.loss_scaler if self.options.mixed_precision.enabled else None
        statistics = self._activations.begin_step("train")
        results, finite = self._training_session.train(
            data,
            lr,
            self._optimizer_updates + 1,
            names + statistics,
            optimizer_step,
            scaler.loss_scale if scaler else None,
        )
        self._activations.end_step(results)
        if optimizer_step:
            self._after_optimizer_step(finite, scaler)
        check_outputs(results, self.model_desc.outputs, sizes)
        ordered = [results[n] for n in (info.fetches or names)]
        return ordered[0] if len(ordered) == 1 else ordered

    def _after_optimizer_step(self, finite: bool, scaler) -> None:
        """Count the update (only a finite one under mixed precision) and let the loss scaler see every optimizer
        step — with or without fetches, unlike the original, whose scaler silently stopped updating with fetches."""
        info = self._train_step_info
        if scaler is not None:
            info.all_finite = torch.tensor([finite])
            scaler.update(info)
        if finite:
            self._optimizer_updates += 1
            info.optimization_step += 1

    def eval_step(self, *args, **kwargs):
        """Forward pass with dropout off; changes no state. Returns outputs in model_desc order."""
        inputs = order_inputs(args, kwargs, self.model_desc.inputs)
        if self._training_session is None:
            if self._torch_model is None:
                raise RuntimeError("Model is uninitialized. Only ONNX and PyTorch models are supported")
            self._init_onnx_model(inputs)
        sizes = check_inputs(inputs, self.model_desc.inputs)
        names = self._requested_outputs(self._train_step_info.fetches)
        data = {d.name: t for d, t in zip(self.model_desc.inputs, inputs, strict=True)}
        statistics = self._activations.begin_step("eval")
        results = self._training_session.evaluate(data, names + statistics)
        self._activations.end_step(results)
        check_outputs(results, self.model_desc.outputs, sizes)
        ordered = [results[n] for n in names]
        return ordered[0] if len(ordered) == 1 else ordered

    def save_as_onnx(self, path: str) -> None:
        """Write the forward (+loss) ONNX model with the current weights to `path`."""
        if self._training_session is None:
            warnings.warn(
                "Training session is not initialized yet. 'train_step' or 'eval_step' methods must be "
                "executed at least once before calling 'save_as_onnx()'.",
                stacklevel=2,
            )
            return
        _require(isinstance(path, str), "'path' must be a valid path string")
        directory, filename = os.path.split(path)
        if (directory and not os.path.isdir(directory)) or not filename:
            warnings.warn("'path' is not valid or does not exist", stacklevel=2)
            return
        model = self._onnx_model_with_current_weights()
        temporary = f"{path}.tmp-{os.getpid()}"
        try:
            with open(temporary, "wb") as f:
                f.write(model.SerializeToString())
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)

    def state_dict(self, pytorch_format: bool = False) -> dict:
        """Model, optimizer, trainer options and step counters in the legacy layout (see `trainer/state.py`), or
        with `pytorch_format=True` a flat `{name: torch.Tensor}` that the original module's `load_state_dict`
        accepts."""
        if self._training_session is None:
            warnings.warn(
                "ONNX Runtime training session is not initialized yet. Please run train_step or eval_step at "
                "least once before calling ORTTrainer.state_dict().",
                stacklevel=2,
            )
            return self._pending_state[0] if self._pending_state is not None else {}
        if pytorch_format:
            if self.options.distributed.deepspeed_zero_optimization.stage > 0:
                warnings.warn("Incomplete state_dict: ZeRO enabled", stacklevel=2)
            if self.options.distributed.horizontal_parallel_size > 1:
                warnings.warn("Incomplete state_dict: Megatron enabled", stacklevel=2)
        return state_mod.build_state_dict(self, pytorch_format)

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Load a state_dict in the legacy layout, or a plain PyTorch `state_dict` of the model.

        Before the first step (PyTorch model) it is kept and applied, with the same checks, once the session exists.
        """
        if self._training_session is None:
            self._pending_state = (state_dict, strict)
            return
        state_mod.apply_state_dict(self, state_dict, strict)

    def save_checkpoint(self, path, user_dict: dict | None = None, include_optimizer_states: bool = True) -> None:
        """Write `state_dict()` (plus `user_dict`, pickled as hex like the original) to an HDF5 file or file-like
        object. The file appears only when fully written; an existing path raises FileExistsError."""
        state = self.state_dict()
        if user_dict:
            state["user_dict"] = storage.to_serialized_hex(user_dict)
        if not include_optimizer_states:
            state.pop("optimizer", None)
        storage.save(state, path)

    def load_checkpoint(self, *paths, strict: bool = True) -> dict:
        """Load checkpoint file(s) written by `save_checkpoint` (or the original ORTTrainer); per-rank ZeRO files are
        aggregated. Returns the `user_dict` saved with it."""
        from ..checkpoint import aggregate_checkpoints

        options = storage.load(paths[0], key="trainer_options")
        if options["zero_stage"] > 0 or options["horizontal_parallel_size"] > 1:
            state = aggregate_checkpoints(list(paths), pytorch_format=False)
        else:
            _require(len(paths) == 1, f"Expected number of files to load: 1, got {len(paths)}")
            state = storage.load(paths[0])
        user_dict = {}
        if "user_dict" in state:
            user_dict = storage.from_serialized_hex(state.pop("user_dict"))
        self.load_state_dict(state, strict=strict)
        return user_dict

    _lr_override: float | None = None  # set only while `_train_step_with_lr` runs

    def _train_step_with_lr(self, inputs: list, lr: float):
        """`train_step(*inputs)` with `lr` fed as this step's learning rate instead of `optim_config.lr` or the
        `lr_scheduler` (which is not consulted). The older API (`orttrainer.legacy`) takes the rate as an input."""
        self._lr_override = float(lr)
        try:
            return self.train_step(list(inputs))
        finally:
            self._lr_override = None

    def _flat_state(self) -> dict:
        return state_mod.flat_state(self)

    def _load_flat_state(self, flat: dict, strict: bool) -> None:
        state_mod.load_flat_state(self, flat, strict)

    def _onnx_model_with_current_weights(self) -> onnx.ModelProto:
        from onnx import numpy_helper

        model = copy_model(self._onnx_model)
        values = self._training_session.get_state([n for n in self._state_tensor_names()])
        for i, init in enumerate(model.graph.initializer):
            if init.name in values:
                model.graph.initializer[i].CopyFrom(numpy_helper.from_array(values[init.name], init.name))
        return model

    def _state_tensor_names(self) -> list[str]:
        return list(self._compiled.trainable) + list(self._frozen)

    # -------------------------------------------------------------------------------------------------- helpers
    def _requested_outputs(self, fetches: list[str]) -> list[str]:
        names = [d.name for d in self.model_desc.outputs]
        if not fetches:
            return names
        selected = [n for n in names if n in fetches]
        if len(selected) != len(fetches):
            raise RuntimeError("The specified fetches list contains invalid output names")
        return selected

    def _learning_rate(self) -> float:
        if self._lr_override is not None:
            return self._lr_override
        scheduler = self.options.lr_scheduler
        if scheduler is None:
            return self.optim_config.lr
        return scheduler._step(self._train_step_info)[0]


def _takes_two_arguments(fn) -> bool:
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
