"""`ORTTrainer`: the legacy training front end (docs/legacy_api.md §3) on orttrainer's compiler and session.

The trainer's state lives in four typed fields with one owner each (module map: docs/architecture.md):
- `_config` (`config.TrainerConfig`): the validated arguments and options, fixed at construction;
- `_model` (`model.Unbuilt` or `model.Built`): a PyTorch model (or an ONNX model the torch gradient builder trains)
  waits for its first batch; once built it holds the forward model, the compiled graphs, the session that holds
  weights and optimizer state, and what the export learned;
- `_state` (`state.TrainerState`): step counters, the gradient-accumulation window, the loss scaler, the dropout
  stream, and a state loaded before the session existed;
- `_activations` (`activations.ActivationStatistics`): the `orttrainer.debug` statistics collected in the graphs.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

import onnx
import torch
from onnx import numpy_helper

from .. import amp
from .._require import require
from ..checkpoint._atomic import atomic_write
from ..debug.subscriber import WATCHED
from ..optim.config import _OptimizerConfig
from ..schema.model_desc import _ORTTrainerModelDesc
from ..schema.options import ORTTrainerOptions
from ..train_step_info import TrainStepInfo
from . import state_dict as state_dicts
from .activations import ActivationStatistics
from .build.export import check_model_export
from .build.external_data import prepare_model
from .config import TrainerConfig, make_config
from .graph.editor import copy_model
from .inputs import check_inputs, check_outputs, order_inputs
from .model import Built, Unbuilt, build_model, build_onnx_model, reexport_for_shapes
from .runtime.session import SessionBase
from .state import AccumulationWindow, PendingLoad, StepCounters, TrainerState, uninterrupted

_logger = logging.getLogger(__name__)

Outputs = torch.Tensor | list[torch.Tensor]
Method = TypeVar("Method", bound=Callable[..., Any])


def _locked(method: Method) -> Method:
    """The method runs holding the trainer's lock (`TrainerState.lock`): steps, loads and saves of one trainer
    called from several threads run one after another (docs/design.md § Failure atomicity)."""

    @functools.wraps(method)
    def locked(self: ORTTrainer, *args: Any, **kwargs: Any) -> Any:
        with self._state.lock:
            return method(self, *args, **kwargs)

    return cast(Method, locked)


class ORTTrainer:
    """Train a PyTorch model (plus loss function) or an ONNX model with a loss output, on ONNX Runtime.

    Args:
        model: a `torch.nn.Module`, or an `onnx.ModelProto` whose model_desc marks one output `is_loss=True`.
        model_desc: `{'inputs': [(name, shape), ...], 'outputs': [(name, shape[, is_loss]), ...]}`.
        optim_config: `optim.AdamConfig`, `optim.LambConfig` or `optim.SGDConfig`.
        loss_fn: `loss_fn(predictions, label)`; the label is the last model_desc input.
        options: `ORTTrainerOptions`.
    """

    def __init__(
        self,
        model: torch.nn.Module | onnx.ModelProto,
        model_desc: dict[str, Any],
        optim_config: _OptimizerConfig,
        loss_fn: Callable[..., Any] | None = None,
        options: ORTTrainerOptions | None = None,
    ) -> None:
        self._config: TrainerConfig = make_config(model, model_desc, optim_config, loss_fn, options)
        mixed_precision = self._config.options.mixed_precision
        self._state = TrainerState(
            StepCounters(TrainStepInfo(optim_config)),
            AccumulationWindow(self._config.accumulation_steps),
            loss_scaler=mixed_precision.loss_scaler if mixed_precision.enabled else None,
        )
        module = model if isinstance(model, torch.nn.Module) else None
        self._activations = ActivationStatistics(module)  # orttrainer.debug subscribers, in the graph
        self._model: Built | Unbuilt = Unbuilt(module=module)
        if isinstance(model, onnx.ModelProto):
            # checked before anything reads it, external data confined (docs/reliability.md §1)
            self._model = build_onnx_model(self._config, self._state, prepare_model(model))

    @property
    def model_desc(self) -> _ORTTrainerModelDesc:
        """The validated model description; dtypes are filled in once the model is exported."""
        model = self._model
        return model.model_desc if isinstance(model, Built) else self._config.model_desc

    @property
    def optim_config(self) -> _OptimizerConfig:
        """The optimizer configuration the trainer was built with."""
        return self._config.optim_config

    @property
    def options(self) -> ORTTrainerOptions:
        """The validated options."""
        return self._config.options

    @property
    def loss_fn(self) -> Callable[..., Any] | None:
        """The loss function (None for an ONNX model or a model that returns its loss)."""
        return self._config.loss_fn

    @property
    def torch_sample_outputs(self) -> list[torch.Tensor] | None:
        """PyTorch's outputs for the first batch (a PyTorch model, after the first step; after a build from the
        compile cache they are computed when first read, from the module, whose weights the trainer never changes)."""
        built = self._built
        return built.torch_export.sample_outputs() if built and built.torch_export else None

    @property
    def step(self) -> int:
        """`train_step` calls so far (micro-steps; with gradient accumulation, several per optimizer step)."""
        return self._state.counters.info.step

    @property
    def optimization_step(self) -> int:
        """Optimizer steps that updated the weights so far (a skipped non-finite mixed-precision step does not
        count)."""
        return self._state.counters.info.optimization_step

    @property
    def gradient_builder(self) -> str | None:
        """The gradient builder that made the training graph ('ort' or 'torch'); None before it is built."""
        built = self._built
        return built.builder.builder if built else None

    @property
    def _train_step_info(self) -> TrainStepInfo:
        """The legacy TrainStepInfo: step counters, `fetches`, `all_finite`."""
        return self._state.counters.info

    @property
    def _training_session(self) -> SessionBase | None:
        """The session holding weights and optimizer state (legacy attribute; None before the first step)."""
        built = self._built
        return built.session if built else None

    @property
    def _onnx_model(self) -> onnx.ModelProto | None:
        """The post-processed forward model (legacy attribute; for a PyTorch model, None before the first step). An
        ONNX model has it from construction, whichever builder compiles it (the torch builder on the first step)."""
        model = self._model
        if isinstance(model, Built):
            return model.forward
        return model.onnx.forward if model.onnx is not None else None

    @property
    def _built(self) -> Built | None:
        """The built model, or None before it is built."""
        model = self._model
        return model if isinstance(model, Built) else None

    def train_step(self, *args: Any, **kwargs: Any) -> Outputs:
        """One training micro-step; returns the model_desc outputs (or `_train_step_info.fetches`).

        A step that raises (bad input, an ONNX Runtime error) changes nothing: counters, accumulation buffers,
        weights and the dropout stream stay as they were, so the same step can be retried."""
        return self._train(order_inputs(args, kwargs, self.model_desc.inputs))

    @_locked
    def _train(self, inputs: list, lr: float | None = None) -> Outputs:
        """`train_step` on ordered inputs; `lr` is this step's learning rate instead of `optim_config.lr` or the
        `lr_scheduler` (the older API, `orttrainer.capi`, takes the rate as an input).

        Atomic: a step is applied whole or not at all (docs/design.md § Failure atomicity). Until ONNX Runtime has
        run, nothing changes; from then until the counters have moved, interrupts are deferred
        (`state.uninterrupted`). Steps of one trainer called from several threads run one at a time."""
        built = self._built_for(inputs, check_export=self.options.debug.check_model_export)
        sizes = check_inputs(inputs, built.model_desc.inputs)
        state = self._state
        info = state.counters.info
        names = self._requested_outputs(info.fetches)
        data = self._data(inputs)
        built.session.prepare(data)  # a graph for new input shapes (torch builder) fails before any count
        step = info.step + 1
        optimizer_step = state.window.ends_at(step)
        if lr is None:
            lr = state.learning_rate(self.optim_config.lr, self.options.lr_scheduler)
        scaler = state.loss_scaler
        watched = self._activations.model in WATCHED  # no statistics bookkeeping unless a manager watches the model
        statistics = self._activations.begin_step("train") if watched else []
        scale = scaler.loss_scale if scaler else None
        try:
            with uninterrupted():
                results, finite = built.session.train(
                    data, lr, state.counters.next_update, names + statistics, optimizer_step, scale
                )
                info.step = step  # counted only now: a step that raised above changed nothing
                if optimizer_step:
                    self._after_optimizer_step(finite, scaler)
        except Exception as err:
            if not self._graphs_for_shapes(built, inputs, err):
                raise
            return self._train(inputs, lr)  # nothing changed: the step runs again, on the graphs for its shapes
        if watched:
            self._activations.end_step(results)
        check_outputs(results, built.model_desc.outputs, sizes)
        ordered = [results[n] for n in (info.fetches or names)]
        return ordered[0] if len(ordered) == 1 else ordered

    def _after_optimizer_step(self, finite: bool, scaler: amp.LossScaler | None) -> None:
        """Count the update (only a finite one under mixed precision) and let the loss scaler see every optimizer
        step — with or without fetches, unlike the original, whose scaler silently stopped updating with fetches."""
        counters = self._state.counters
        if scaler is not None:
            counters.info.all_finite = torch.tensor([finite])
            scaler.update(counters.info)
        if finite:
            counters.count_update()

    @_locked
    def eval_step(self, *args: Any, **kwargs: Any) -> Outputs:
        """Forward pass with dropout off; changes no state. Returns outputs in model_desc order (one unwrapped).

        The inputs may stop short of model_desc's, as the original's did (a label the loss needs left out): then
        the outputs are the fetched ones, each of which must not need a missing input, or without fetches every
        model_desc output that does not (README § Legacy scripts)."""
        descs = self.model_desc.inputs
        inputs = order_inputs(args, kwargs, descs, allow_fewer=True)
        complete = len(inputs) == len(descs)
        built = self._built_for(inputs, check_export=False) if complete else self._built_without(inputs)
        sizes = check_inputs(inputs, built.model_desc.inputs[: len(inputs)])
        fetches = self._state.counters.info.fetches
        names = self._requested_outputs(fetches)
        data = self._data(inputs)
        watched = self._activations.model in WATCHED
        if watched and complete:
            built.session.prepare_eval(data)  # the torch route exports its eval graph (and statistics) when needed
        if not complete:
            names = self._outputs_without(built, data, names, bool(fetches), watched)
        statistics = self._activations.begin_step("eval") if watched else []
        try:
            results = built.session.evaluate(data, names + statistics)
        except Exception as err:
            if not complete or not self._graphs_for_shapes(built, inputs, err):
                raise
            results = built.session.evaluate(data, names + statistics)
        if watched:
            self._activations.end_step(results)
        check_outputs(results, built.model_desc.outputs, sizes)
        ordered = [results[n] for n in names]
        return ordered[0] if len(ordered) == 1 else ordered

    def _graphs_for_shapes(self, built: Built, inputs: list, err: Exception) -> bool:
        """After ONNX Runtime failed (`err`) on a batch whose shapes differ from the first batch's, a model exported
        with TorchScript (the 'ort' builder) is exported again with this batch, and its graphs serve these shapes
        from now on (`model.reexport_for_shapes`; the first graph held a size the exporter had fixed). True when
        that happened, so that the caller runs the step again; False for any other error, or when these shapes
        have graphs of their own already."""
        module, info = self._activations.model, built.torch_export
        data = self._data(inputs)
        shapes = tuple(tuple(t.shape) for t in inputs)
        if not (
            type(err).__module__.startswith("onnxruntime")
            and built.builder.builder == "ort"
            and info is not None
            and isinstance(module, torch.nn.Module)
            and shapes != info.sample_shapes
            and not built.session.pinned(data)
        ):
            return False
        axes = _changed_axes(self.model_desc.inputs, info.sample_shapes, shapes)
        _logger.info(
            "ONNX Runtime failed on input shapes %s with the graph exported for %s (%s): the TorchScript export "
            "fixed the size of %s; exporting the model again for these shapes (one graph per such input-shape "
            "signature)",
            [list(s) for s in shapes],
            [list(s) for s in info.sample_shapes],
            str(err).strip().splitlines()[0][:200],
            axes or "an axis",
        )
        try:
            compiled = reexport_for_shapes(self._config, built, module, inputs, self._activations)
        except Exception as again:
            raise RuntimeError(
                f"ONNX Runtime failed on the input shapes {[list(s) for s in shapes]} with the graph exported for "
                f"{[list(s) for s in info.sample_shapes]} (the TorchScript export fixed {axes or 'an axis'}), and "
                f"exporting the model again for them failed: {again}"
            ) from err
        built.session.pin_graphs(data, compiled.step_graph, compiled.eval_model)
        return True

    def _built_without(self, inputs: list) -> Built:
        """The built model for an eval step given only the first inputs; ValueError before the first step."""
        built = self._built
        names = [d.name for d in self.model_desc.inputs]
        if built is None:
            raise ValueError(
                f"eval_step got the inputs {names[: len(inputs)]} without {names[len(inputs) :]}: the first step "
                f"builds the model and needs every input {names}; evaluate with the inputs alone after it"
            )
        return built

    def _outputs_without(
        self, built: Built, data: dict[str, torch.Tensor], names: list[str], fetched: bool, watched: bool
    ) -> list[str]:
        """The outputs an eval step without some inputs returns (`eval_step`'s rule)."""
        missing = [d.name for d in self.model_desc.inputs if d.name not in data]
        if watched:
            raise ValueError(
                f"eval_step without {missing} while orttrainer.debug records the model's statistics: pass every input"
            )
        computable = built.session.computable(data, names)
        needing = [name for name in names if name not in computable]
        if (fetched and needing) or not computable:
            raise ValueError(
                f"eval_step without {missing}: the outputs {needing} need them; pass them, or set "
                f"_train_step_info.fetches to outputs that do not (here: {computable})"
            )
        return computable

    def _built_for(self, inputs: list, check_export: bool) -> Built:
        """The built model; a PyTorch model (or an ONNX model on the torch builder) is exported, compiled and
        opened with its first batch (trainer/model.py)."""
        model = self._model
        if isinstance(model, Built):
            return model
        built = build_model(self._config, self._state, model, inputs, self._activations)
        self._model = built
        self._apply_pending(built)
        if check_export and built.torch_export is not None:
            outputs = [d.name for d in built.model_desc.outputs]
            check_model_export(
                outputs, built.session.evaluate(self._data(inputs), outputs), built.torch_export.sample_outputs()
            )
        return built

    def _data(self, inputs: list) -> dict[str, torch.Tensor]:
        """The inputs by name; an eval step may give only the first ones (`eval_step`)."""
        return {d.name: t for d, t in zip(self._config.model_desc.inputs[: len(inputs)], inputs, strict=True)}

    @_locked
    def save_as_onnx(self, path: str) -> None:
        """Write the forward (+loss) ONNX model with the current weights to `path`."""
        built = self._built
        if built is None:
            warnings.warn(
                "Training session is not initialized yet. 'train_step' or 'eval_step' methods must be "
                "executed at least once before calling 'save_as_onnx()'.",
                stacklevel=2,
            )
            return
        require(isinstance(path, str), "'path' must be a valid path string")
        directory, filename = os.path.split(path)
        if (directory and not os.path.isdir(directory)) or not filename:
            warnings.warn("'path' is not valid or does not exist", stacklevel=2)
            return
        data = _with_weights(built).SerializeToString()  # through no planted name: docs/reliability.md §3
        atomic_write(path, lambda handle: handle.write(data), overwrite=True, what="ONNX model file")

    @_locked
    def state_dict(self, pytorch_format: bool = False) -> dict[str, Any]:
        """Model, optimizer, trainer options and step counters in the legacy layout (see `trainer/state_dict.py`),
        or with `pytorch_format=True` a flat `{name: torch.Tensor}` that the original module's `load_state_dict`
        accepts."""
        built, pending = self._built, self._state.pending
        if built is None:
            warnings.warn(
                "ONNX Runtime training session is not initialized yet. Please run train_step or eval_step at "
                "least once before calling ORTTrainer.state_dict().",
                stacklevel=2,
            )
            return pending.state if pending is not None and not pending.flat else {}
        if pytorch_format:
            if self._config.zero_stage > 0:
                warnings.warn("Incomplete state_dict: ZeRO enabled", stacklevel=2)
            if self.options.distributed.horizontal_parallel_size > 1:
                warnings.warn("Incomplete state_dict: Megatron enabled", stacklevel=2)
        return state_dicts.build_state_dict(built, self._config, self._state, pytorch_format)

    @_locked
    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a state_dict in the legacy layout, or a plain PyTorch `state_dict` of the model.

        Before the first step (PyTorch model) it is kept and applied, with the same checks, once the session exists.
        """
        built = self._built
        if built is None:
            self._state.pending = PendingLoad(state_dict, strict)
            return
        state_dicts.apply_state_dict(built, self._config, self._state, state_dict, strict)

    @_locked
    def save_checkpoint(
        self,
        path: str | os.PathLike | Any,
        user_dict: dict[str, Any] | None = None,
        include_optimizer_states: bool = True,
    ) -> None:
        """Write `state_dict()` (plus `user_dict`) to an HDF5 file or file-like object. The file appears only when
        fully written; an existing path raises FileExistsError. `user_dict` is stored without pickle where it is
        plain data (`checkpoint/user_dict.py`); other values are pickled one by one, with a warning that loading
        them needs `trusted=True`."""
        from ..checkpoint import storage  # HDF5 is loaded only by a run that checkpoints (docs/engine.md §24)
        from ..checkpoint.user_dict import encode_user_dict

        if self._built is None:
            raise RuntimeError(
                "save_checkpoint before the first train_step or eval_step: a PyTorch model is exported and its "
                "training state created on its first step, so there is nothing to save yet. Run a step first (or "
                "save the PyTorch module itself with torch.save(model.state_dict()))"
            )
        saved = self.state_dict()
        if user_dict:
            saved["user_dict"] = encode_user_dict(user_dict)
        if not include_optimizer_states:
            saved.pop("optimizer", None)
        storage.save(saved, path)

    @_locked
    def load_checkpoint(
        self, *paths: str | os.PathLike | Any, strict: bool = True, trusted: bool = False
    ) -> dict[str, Any]:
        """Load checkpoint file(s) written by `save_checkpoint` (or the original ORTTrainer); per-rank ZeRO files are
        aggregated. Returns the `user_dict` saved with it.

        Without `trusted`, only plain data in `user_dict` is restored (numbers, strings, bytes, None, lists, tuples,
        dicts, numpy arrays, torch tensors); a pickled value needing anything else raises `UnsafePickleError`
        naming its key, before the trainer's state changes and without running it. `trusted=True` unpickles
        whatever the file holds: only for files you trust, since unpickling can run any code.
        """
        from ..checkpoint import aggregate_checkpoints, storage
        from ..checkpoint.user_dict import decode_user_dict

        options = storage.load(paths[0], key="trainer_options")
        if options["zero_stage"] > 0 or options["horizontal_parallel_size"] > 1:
            loaded = aggregate_checkpoints(list(paths), pytorch_format=False)
        else:
            require(len(paths) == 1, f"Expected number of files to load: 1, got {len(paths)}")
            loaded = storage.load(paths[0])
        user_dict = {}
        if "user_dict" in loaded:
            shown_as = os.fsdecode(paths[0]) if isinstance(paths[0], (str, bytes, os.PathLike)) else repr(paths[0])
            user_dict = decode_user_dict(loaded.pop("user_dict"), trusted=trusted, shown_as=shown_as)
        self.load_state_dict(loaded, strict=strict)
        return user_dict

    @property
    def _torch_state_dict_keys(self) -> list[str] | None:
        """The PyTorch module's state_dict keys (known once exported)."""
        built = self._built
        return built.torch_export.state_dict_keys if built and built.torch_export else None

    @property
    def _state_dict(self) -> dict[str, Any] | None:
        """The flat state parked by `experimental_load_state_dict` before the first step (legacy attribute)."""
        pending = self._state.pending
        return pending.state if pending is not None and pending.flat else None

    @property
    def _load_state_dict_strict(self) -> bool:
        """The `strict` flag of the parked flat state (legacy attribute)."""
        pending = self._state.pending
        return bool(pending and pending.flat and pending.strict)

    @_locked
    def _flat_state(self) -> dict[str, torch.Tensor]:
        """Weights and optimizer tensors by their graph names; the session must exist."""
        return state_dicts.flat_state(self._require_built(), self._config, self._state.counters)

    @_locked
    def _load_flat_state(self, flat: dict[str, Any], strict: bool) -> None:
        """Load (or before the first step: park) the experimental API's flat state."""
        built = self._built
        if built is None:
            self._state.pending = PendingLoad(flat, strict, flat=True)
            return
        state_dicts.load_flat_state(built, self._state, flat, strict)

    def _apply_pending(self, built: Built) -> None:
        pending, self._state.pending = self._state.pending, None
        if pending is None:
            return
        if pending.flat:
            state_dicts.load_flat_state(built, self._state, pending.state, pending.strict)
        else:
            state_dicts.apply_state_dict(built, self._config, self._state, pending.state, pending.strict)

    def _require_built(self) -> Built:
        built = self._built
        if built is None:
            raise RuntimeError("the training session does not exist yet: run train_step or eval_step first")
        return built

    def _requested_outputs(self, fetches: list[str]) -> list[str]:
        names = [d.name for d in self._config.model_desc.outputs]
        if not fetches:
            return names
        selected = [n for n in names if n in fetches]
        if len(selected) != len(fetches):
            raise RuntimeError("The specified fetches list contains invalid output names")
        return selected


def _changed_axes(descs: Any, first: tuple, shapes: tuple) -> list[str]:
    """model_desc's dynamic axes (string dims) whose size differs between the input shapes `first` and `shapes`."""
    changed = []
    for desc, old, new in zip(descs, first, shapes, strict=False):
        for dim, a, b in zip(desc.shape, old, new, strict=False):
            if isinstance(dim, str) and a != b and dim not in changed:
                changed.append(dim)
    return changed


def _with_weights(built: Built) -> onnx.ModelProto:
    """The forward model with the session's current weights in its initializers."""
    model = copy_model(built.forward)
    values = built.session.get_state(built.state_names)
    for i, init in enumerate(model.graph.initializer):
        if init.name in values:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    return model
