"""The older `onnxruntime.capi.ort_trainer.ORTTrainer` (docs/legacy_api.md §14.3–§14.4), running on the new trainer.

There is no second engine: the constructor maps its arguments onto `ORTTrainerOptions` and an optimizer config
(`argument_mapping.py`) and builds an `orttrainer.ORTTrainer` (`ort_trainer`); steps, state and checkpoints go
through it. What stays here are the older API's conventions:

- `train_step(*inputs[, lr][, loss_scale], fetches=None)`: the learning rate is an input (named by
  `learning_rate_description`) unless `get_lr_this_step(global_step_)` supplies it; under mixed precision without a
  `loss_scaler`, the loss scale is an input too (keyword: `default_loss_scale_input_name` or the
  graph's loss-scale input name). Inputs may be positional, keyword (by description name), or one list.
- Returns the model outputs (the loss first), or the `fetches` in fetches order; a mixed-precision optimizer step
  without a `loss_scaler` (and without fetches) also returns the all-finite flag last. One result is unwrapped.
- `global_step_` counts applied optimizer updates (skipped overflow steps do not count), starting at `global_step`.
- `eval_step` takes the model inputs; a trailing learning rate / loss scale is accepted and ignored, so one input
  list serves `__call__` in both `train()` and `eval()` mode. As in the original, the first inputs alone (no label)
  are accepted too (`orttrainer.ORTTrainer.eval_step`'s rule).
- `state_dict()` is flat `{name: torch.Tensor}`: weights, frozen tensors and the optimizer's `Moment_1_<w>`,
  `Moment_2_<w>`, `Update_Count_<w>` (Adam) or `Step` (LAMB).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import namedtuple
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import onnx
import torch

from ..amp import loss_scaler as amp_scaler
from ..checkpoint import experimental as flat
from ..schema.options import ORTTrainerOptions
from ..trainer import ORTTrainer as _NewORTTrainer
from ..trainer.inputs import order_inputs
from . import argument_mapping as args_mod
from .descriptions import IODescription, ModelDescription, bind_real_inputs, to_model_desc
from .input_matching import legacy_input_model
from .loss_scaler import LossScaler, as_new_loss_scaler

_Named = namedtuple("_Named", "name")
DEFAULT_LOSS_SCALE_INPUT_NAME = "default_loss_scale_input_name"


class ORTTrainer:
    """Train a torch model (with `loss_fn(prediction, label)`) or an ONNX model whose first output is the loss.

    Every argument of the 1.13.1 signature is accepted (see `argument_mapping.OPTION_OF_ARGUMENT` for where each goes);
    values this build cannot honour raise `NotImplementedError` naming the argument. `postprocess_model` (keyword;
    releases before 1.5) is accepted as the older name of `_extra_postprocess`.
    """

    def __init__(
        self,
        model: torch.nn.Module | onnx.ModelProto,
        loss_fn: Callable[..., Any] | None,
        model_desc: ModelDescription,
        training_optimizer_name: str,
        map_optimizer_attributes: Callable[[str], dict] | None,
        learning_rate_description: IODescription,
        device: torch.device | str,
        gradient_accumulation_steps: int = 1,
        world_rank: int = 0,
        world_size: int = 1,
        use_mixed_precision: bool = False,
        allreduce_post_accumulation: bool = False,
        global_step: int = 0,
        get_lr_this_step: Callable[[int], float] | None = None,
        loss_scaler: LossScaler | None = None,
        deepspeed_zero_stage: int = 0,
        enable_grad_norm_clip: bool = True,
        frozen_weights: Sequence[str] | None = (),
        _opset_version: int = args_mod.DEFAULT_OPSET_VERSION,
        _enable_internal_postprocess: bool = True,
        _extra_postprocess: Callable[[onnx.ModelProto], Any] | None = None,
        _use_deterministic_compute: bool = False,
        use_memory_efficient_gradient: bool = False,
        run_symbolic_shape_infer: bool = False,
        enable_adasum: bool = False,
        optimized_model_filepath: str = "",
        *,
        postprocess_model: Callable[[onnx.ModelProto], Any] | None = None,
    ) -> None:
        given = dict(locals())  # every argument by name: nothing else is bound yet
        del given["self"]
        loss_fn = _checked_loss_fn(given)
        new_desc = to_model_desc(model_desc)
        arguments = _option_arguments(given)
        config = args_mod.optimizer_config(
            training_optimizer_name, map_optimizer_attributes, args_mod.trainable_weight_names(model)
        )
        self._trainer = _new_trainer(model, loss_fn, model_desc, new_desc, config, arguments)
        self._keep_arguments(given, loss_fn, arguments)

    def _keep_arguments(self, given: dict[str, Any], loss_fn: Callable[..., Any] | None, arguments: dict) -> None:
        """The older API's public attributes (trailing underscores as there) and the step bookkeeping."""
        model, model_desc = given["model"], given["model_desc"]
        self.is_train = True
        self.torch_model_ = model if isinstance(model, torch.nn.Module) else None
        self.loss_fn_ = loss_fn
        self.model_desc_: ModelDescription = model_desc
        self.learning_rate_description_: IODescription = given["learning_rate_description"]
        self.training_optimizer_name_: str = given["training_optimizer_name"]
        self.map_optimizer_attributes_ = given["map_optimizer_attributes"]
        self.device_ = torch.device(arguments["device"])
        self.gradient_accumulation_steps: int = given["gradient_accumulation_steps"]
        self.world_rank: int = given["world_rank"]
        self.world_size: int = given["world_size"]
        self.use_mixed_precision: bool = given["use_mixed_precision"]
        self.deepspeed_zero_stage_: int = given["deepspeed_zero_stage"]
        self.current_step = 0
        self.global_step_: int = given["global_step"]
        self.get_lr_this_step_: Callable[[int], float] | None = given["get_lr_this_step"]
        self.loss_scaler_: LossScaler | None = given["loss_scaler"] if self.use_mixed_precision else None
        self._fed_loss_scale: amp_scaler.LossScaler | None = arguments["loss_scaler"]  # the new trainer's view
        self.loss_scale_input_name = (
            self.loss_scaler_.loss_scale_input_name_ if self.loss_scaler_ is not None else DEFAULT_LOSS_SCALE_INPUT_NAME
        )
        self.input_desc_with_lr = [*model_desc.inputs_, self.learning_rate_description_]

    # ------------------------------------------------------------------------------------------------- properties
    @property
    def ort_trainer(self) -> _NewORTTrainer:
        """The `orttrainer.ORTTrainer` doing the work."""
        return self._trainer

    @property
    def onnx_model_(self) -> onnx.ModelProto | None:
        """The exported (post-processed) forward model; None before the first step of a torch model."""
        return self._trainer._onnx_model

    @property
    def session(self) -> Any:
        """orttrainer's `TrainingSession` (not ONNX Runtime's legacy TrainingSession); None before the first step."""
        return self._trainer._training_session

    # ------------------------------------------------------------------------------------------------------ steps
    def train(self) -> None:
        """Make `__call__` run `train_step`."""
        self.is_train = True

    def eval(self) -> None:
        """Make `__call__` run `eval_step`."""
        self.is_train = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`train_step` or `eval_step` (per `train()`/`eval()`) with the same arguments."""
        return self.train_step(*args, **kwargs) if self.is_train else self.eval_step(*args, **kwargs)

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        """One micro-step: `(*model_inputs[, lr][, loss_scale], fetches=None)`; see the module docstring."""
        fetches = _check_fetches(kwargs.pop("fetches", None))
        inputs, lr, loss_scale = self._split_inputs(args, kwargs, training=True)
        self._bind_before_building(inputs)
        if self.get_lr_this_step_ is not None:
            lr = self.get_lr_this_step_(self.global_step_)
        assert lr is not None  # _split_inputs requires the learning-rate input when get_lr_this_step is not set
        if loss_scale is not None:
            assert self._fed_loss_scale is not None  # a loss-scale input is only taken under mixed precision
            self._fed_loss_scale.loss_scale = loss_scale
        info = self._trainer._train_step_info
        updates_before = info.optimization_step
        self.current_step += 1
        with self._fetches(fetches):
            results = _as_list(self._trainer._train(list(inputs), lr=float(lr)))
        self.global_step_ += info.optimization_step - updates_before
        optimizer_step = self._trainer._state.window.ends_at(info.step)
        if optimizer_step and self.use_mixed_precision and self.loss_scaler_ is None and not fetches:
            results.append(_all_finite_tensor(info.all_finite))
        return results[0] if len(results) == 1 else results

    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward pass on the model inputs (dropout off); `fetches` selects outputs, returned in fetches order."""
        fetches = _check_fetches(kwargs.pop("fetches", None))
        inputs, _, _ = self._split_inputs(args, kwargs, training=False)
        self._bind_before_building(inputs)
        with self._fetches(fetches):
            results = _as_list(self._trainer.eval_step(list(inputs)))
        if fetches:  # the new trainer answers in model_desc order; the older API in fetches order
            in_desc_order = [d.name_ for d in self.model_desc_.outputs_ if d.name_ in fetches]
            by_name = dict(zip(in_desc_order, results, strict=True))
            results = [by_name[name] for name in fetches]
        return results[0] if len(results) == 1 else results

    def _bind_before_building(self, inputs: list) -> None:
        """Before the model is built, descriptions that disagree with the tensors give way to them, with a warning
        (`descriptions.bind_real_inputs`)."""
        if self._trainer._built is None:
            bind_real_inputs(self.model_desc_.inputs_, inputs, self._trainer.model_desc.inputs)

    def _extra_input_names(self, training: bool) -> list[str]:
        names: list[str] = []
        if self.get_lr_this_step_ is None or not training:
            names.append(self.learning_rate_description_.name_)
        if self.use_mixed_precision and (self.loss_scaler_ is None or not training):
            names.append(self.loss_scale_input_name)
        return names

    def _loss_scale_aliases(self) -> set[str]:
        """Other keyword names of the loss-scale input: the original also took the default name and, once the
        session existed, the graph's input name."""
        names = {DEFAULT_LOSS_SCALE_INPUT_NAME}
        graph_name = getattr(self._fed_loss_scale, "input_name", None)
        if graph_name:
            names.add(graph_name)
        return names - {self.loss_scale_input_name}

    def _split_inputs(self, args: tuple, kwargs: dict, training: bool) -> tuple[list, float | None, float | None]:
        """(model inputs, caller's learning rate, caller's loss scale) from the older API's calling convention."""
        if len(args) == 1 and isinstance(args[0], list):
            args = tuple(args[0])
        kwargs = dict(kwargs)
        for alias in self._loss_scale_aliases():
            if alias in kwargs:
                kwargs[self.loss_scale_input_name] = kwargs.pop(alias)
        model_names = [d.name_ for d in self.model_desc_.inputs_]
        extras = self._extra_input_names(training)
        lr_name = self.learning_rate_description_.name_
        if (
            training
            and self.get_lr_this_step_ is not None
            and (lr_name in kwargs or len(args) == len(model_names) + len(extras) + 1)
        ):
            raise TypeError(
                f"a learning rate input ({lr_name!r}) was given, but get_lr_this_step is set and supplies "
                "the learning rate; pass only the model inputs"
            )
        if not training:  # eval: a trailing lr / loss scale is allowed and ignored
            for name in extras:
                kwargs.pop(name, None)
            if len(model_names) < len(args) <= len(model_names) + len(extras):
                args = args[: len(model_names)]
            extras = []
        values = order_inputs(args, kwargs, [_Named(n) for n in model_names + extras], allow_fewer=not training)
        extra = dict(zip(extras, values[len(model_names) :], strict=True))
        lr = extra.get(lr_name)
        loss_scale = extra.get(self.loss_scale_input_name)
        return (
            values[: len(model_names)],
            None if lr is None else _scalar(lr, "learning rate"),
            None if loss_scale is None else _scalar(loss_scale, "loss scale"),
        )

    @contextlib.contextmanager
    def _fetches(self, fetches: list[str] | None) -> Iterator[None]:
        info = self._trainer._train_step_info
        saved, info.fetches = info.fetches, list(fetches or [])
        try:
            yield
        finally:
            info.fetches = saved

    # ------------------------------------------------------------------------------------------------------ state
    def state_dict(self, include_optimizer_state: bool = True) -> dict[str, torch.Tensor]:
        """Flat `{name: tensor}`: weights, frozen tensors and (by default) optimizer tensors. Before the first step
        it warns and returns the state given to `load_state_dict` (or `{}`)."""
        return flat._flat_state_dict(self._trainer, include_optimizer_state)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = False) -> None:
        """Load a flat state (from `state_dict`); before the first step it is applied once the session exists.
        `strict`: a name the model does not have raises `RuntimeError`."""
        flat._load_flat_state_dict(self._trainer, state_dict, strict)

    def save_as_onnx(self, path: str) -> None:
        """The forward (+loss) ONNX model with the current weights; warns and writes nothing before the first step."""
        self._trainer.save_as_onnx(path)


def _checked_loss_fn(given: dict[str, Any]) -> Callable[..., Any] | None:
    """Check the calling convention and warn about ignored arguments; the loss_fn to use (None for an ONNX model)."""
    description = given["learning_rate_description"]
    if not isinstance(description, IODescription):
        raise TypeError(
            "learning_rate_description must be an IODescription (e.g. IODescription('Learning_Rate', "
            f"[1], torch.float32)), got {type(description).__name__}"
        )
    if given["postprocess_model"] is not None and given["_extra_postprocess"] is not None:
        raise TypeError("give either postprocess_model (its older name) or _extra_postprocess, not both")
    loss_fn = given["loss_fn"]
    # stacklevel 3: the warnings point at the line that constructs the trainer
    if isinstance(given["model"], onnx.ModelProto) and loss_fn is not None:
        warnings.warn("loss_fn is not used when creating ORTTrainer because an ONNX model is provided.", stacklevel=3)
        loss_fn = None
    if given["loss_scaler"] is not None and not given["use_mixed_precision"]:
        warnings.warn("loss_scaler is ignored: it is only used with use_mixed_precision=True", stacklevel=3)
    return loss_fn


def _option_arguments(given: dict[str, Any]) -> dict[str, Any]:
    """The arguments `argument_mapping.options_dict` turns into options, as given except: the device as its id, the
    loss scaler as the new trainer's view of it (mixed precision only), frozen weights as a list and the
    postprocess hook (either name) applied in place."""
    arguments = {name: given[name] for name in args_mod.OPTION_OF_ARGUMENT}
    arguments["device"] = args_mod.device_id(given["device"])
    arguments["loss_scaler"] = as_new_loss_scaler(given["loss_scaler"]) if given["use_mixed_precision"] else None
    arguments["frozen_weights"] = list(given["frozen_weights"] or [])
    hook = given["_extra_postprocess"] or given["postprocess_model"]
    arguments["_extra_postprocess"] = args_mod.in_place_postprocess(hook)
    return arguments


def _new_trainer(
    model: torch.nn.Module | onnx.ModelProto,
    loss_fn: Callable[..., Any] | None,
    model_desc: ModelDescription,
    new_desc: dict,
    config: Any,
    arguments: dict[str, Any],
) -> _NewORTTrainer:
    """The `orttrainer.ORTTrainer` for the older API's arguments; its NotImplementedError names our argument."""
    fed_model = model
    if isinstance(model, torch.nn.Module):
        fed_model = legacy_input_model(model, loss_fn, [d.name_ for d in model_desc.inputs_])
    try:
        options = ORTTrainerOptions(args_mod.options_dict(arguments))
        return _NewORTTrainer(fed_model, new_desc, config, loss_fn=loss_fn, options=options)
    except NotImplementedError as error:
        raise args_mod.name_the_argument(error, arguments) from error


def _check_fetches(fetches: Any) -> list[str] | None:
    if fetches is None:
        return None
    if not (isinstance(fetches, (list, tuple)) and all(isinstance(f, str) for f in fetches)):
        raise TypeError(f"fetches must be a list of output names, got {fetches!r}")
    return list(fetches)


def _scalar(value: Any, what: str) -> float:
    """A learning rate or loss scale given as a one-element tensor (legacy: shape [1]) or a number."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"the {what} input must hold one value, got shape {list(value.shape)}")
        return float(value.reshape(-1)[0])
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"the {what} input must be a one-element tensor or a number, got {type(value).__name__}")


def _as_list(outputs: Any) -> list[Any]:
    return list(outputs) if isinstance(outputs, list) else [outputs]


def _all_finite_tensor(all_finite: Any) -> torch.Tensor:
    """The older API returned the all-finite flag as a bool tensor of shape [1]."""
    if isinstance(all_finite, torch.Tensor):
        return all_finite.reshape(1).to(torch.bool)
    return torch.tensor([bool(all_finite)])
