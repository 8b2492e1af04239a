"""`ORTTrainer`: the legacy training front end (legacy_api.md §3) on orttrainer's compiler and session."""

from __future__ import annotations

import inspect
import logging
import os
import warnings

import onnx
import torch

from .. import amp, optim
from ..schema.model_desc import _ORTTrainerModelDesc
from ..schema.options import ORTTrainerOptions
from ..train_step_info import TrainStepInfo
from ..checkpoint import storage
from . import export as export_mod
from . import state as state_mod
from .activations import ActivationStatistics
from .builders import BuilderChoice, TorchSource, choose_builder, ort_only_options
from .compile import (
    CompiledModel,
    CompileRequest,
    DataParallelPlan,
    compile_model,
    output_elem_types,
    split_parameters,
)
from .distributed import Communicator, partition_parameters, resolve_context
from .graph.data_parallel import DataParallelGraphs
from .graph.editor import copy_model, tensor_elem_type
from .graph.postprocess import run_postprocess
from .inputs import check_inputs, check_outputs, order_inputs
from .session import Device, SessionConfig, TrainingSession
from .session_dp import DataParallelSession
from .support import (
    check_data_parallel_options,
    check_supported_options,
    gradient_options,
    onnx_to_torch_dtype,
    recompute_plan,
)


class ORTTrainer:
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
        _require(isinstance(optim_config, optim._OptimizerConfig),
                 "'optim_config' is required and must be any of 'AdamConfig', 'LambConfig' or 'SGDConfig'")
        _require(loss_fn is None or _takes_two_arguments(loss_fn),
                 "'loss_fn' must be either 'None' or a callable with two parameters")
        _require(options is None or isinstance(options, ORTTrainerOptions),
                 "'options' must be either 'None' or 'ORTTrainerOptions'")
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
        results, finite = self._training_session.train(data, lr, self._optimizer_updates + 1, names + statistics,
                                                       optimizer_step, scaler.loss_scale if scaler else None)
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
            warnings.warn("Training session is not initialized yet. 'train_step' or 'eval_step' methods must be "
                          "executed at least once before calling 'save_as_onnx()'.")
            return
        _require(isinstance(path, str), "'path' must be a valid path string")
        directory, filename = os.path.split(path)
        if (directory and not os.path.isdir(directory)) or not filename:
            warnings.warn("'path' is not valid or does not exist")
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
            warnings.warn("ONNX Runtime training session is not initialized yet. Please run train_step or eval_step at "
                          "least once before calling ORTTrainer.state_dict().")
            return self._pending_state[0] if self._pending_state is not None else {}
        if pytorch_format:
            if self.options.distributed.deepspeed_zero_optimization.stage > 0:
                warnings.warn("Incomplete state_dict: ZeRO enabled")
            if self.options.distributed.horizontal_parallel_size > 1:
                warnings.warn("Incomplete state_dict: Megatron enabled")
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

    # ------------------------------------------------------------------------------------------ graph and session
    def _init_onnx_model(self, sample_inputs: list) -> None:
        """Export the PyTorch model (first step), post-process it and create the session."""
        check_inputs(sample_inputs, self.model_desc.inputs)
        internal = self.options._internal_use
        with self._activations.marking():  # counts no debug step; marks subscribed activations
            exported = export_mod.export_model(
                self._torch_model, self.loss_fn, self.model_desc, sample_inputs,
                opset_version=internal.onnx_opset_version, enable_contrib_ops=internal.enable_onnx_contrib_ops)
        ort_only = ort_only_options(self.options) + (["orttrainer.debug statistics"] if self._activations.marked
                                                      else [])
        self._builder_choice = choose_builder(internal.gradient_builder, custom_functions=exported.custom_functions,
                                              ort_only=ort_only)
        for i, dtype in enumerate(exported.input_dtypes):
            self.model_desc.add_type_to_input_description(i, dtype)
        for i, dtype in enumerate(exported.output_dtypes):
            self.model_desc.add_type_to_output_description(i, dtype)
        self.torch_sample_outputs = exported.sample_outputs
        self._check_loss_is_scalar(exported)
        self._torch_split = (exported.parameters, exported.buffers)
        self._torch_aliases, self._torch_unused_state = exported.aliases, exported.unused_state
        self._dropout_off = not exported.was_training
        self._torch_source = TorchSource(self._torch_model, self.loss_fn, [d.name for d in self.model_desc.inputs],
                                         internal.onnx_opset_version, exported.was_training)
        forward = self._activations.prepare(exported.model, self.loss_fn, self.model_desc, sample_inputs)
        self._onnx_model = self._postprocess(forward, check_result=False)
        self._sample_inputs = sample_inputs
        try:
            self._init_session()
        finally:
            self._sample_inputs = None  # the torch builder traced them; keep no batch alive

    def _postprocess(self, model: onnx.ModelProto, check_result: bool) -> onnx.ModelProto:
        internal = self.options._internal_use
        if internal.enable_internal_postprocess:
            model = run_postprocess(model)
        if internal.extra_postprocess:
            model = internal.extra_postprocess(model)
            if check_result:
                _require(isinstance(model, onnx.ModelProto), "'extra_postprocess' must return a ONNX model")
        if self.options.utils.run_symbolic_shape_infer:
            from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

            model = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
        return model

    def _init_session(self) -> None:
        losses = [o.name for o in self.model_desc.outputs if o.is_loss]
        _require(len(losses) == 1, f"Only one loss output is supported ({len(losses)} were specified)")
        torch_params, torch_state = getattr(self, "_torch_split", (None, None))
        trainable, frozen = split_parameters(self._onnx_model, list(self.options.utils.frozen_weights), torch_params,
                                             torch_state)
        opts = self.options
        request = CompileRequest(
            forward=self._onnx_model, loss_name=losses[0], data_inputs=[d.name for d in self.model_desc.inputs],
            outputs=[d.name for d in self.model_desc.outputs], trainable=trainable, frozen=frozen,
            optim_config=self.optim_config, accumulation_steps=opts.batch.gradient_accumulation_steps,
            clip_grad_norm=opts.utils.grad_norm_clip, dropout_off=self._dropout_off,
            graph_save_paths=dict(opts.debug.graph_save_paths._validated_opts),
            mixed_precision=opts.mixed_precision.enabled, cpu=self._device.type == "cpu",
            data_parallel=self._data_parallel_plan(trainable), builder=self._builder_choice,
            torch_source=self._torch_source, sample_inputs=self._sample_inputs, recompute=recompute_plan(opts),
            gradient_options=gradient_options(opts))
        self._compiled = compile_model(request)
        self._activations.instrument(self._compiled)
        self._frozen = request.frozen  # compile freezes parameters that cannot reach the loss
        self._gradient_builder = self._compiled.builder.builder
        _logger.info("gradient builder '%s' (%s)", self._gradient_builder, self._compiled.builder.reason)
        self._describe_mixed_precision()
        state = self._compiled.initial_state
        config = SessionConfig(
            device=self._device, mem_limit=opts.device.mem_limit,
            provider_options=dict(opts._validated_opts["provider_options"]), session_options=opts.session_options,
            deterministic=opts.debug.deterministic_compute,
            optimized_model_path=opts.debug.graph_save_paths.model_with_training_graph_after_optimization_path)
        _seed_onnxruntime()
        self._training_session = self._create_session(state, config)
        if self._pending_state is not None:  # load_state_dict before the first step: apply it fully now
            pending, self._pending_state = self._pending_state, None
            state_mod.apply_state_dict(self, *pending)
        from ..checkpoint import _apply_pending_state_dict

        _apply_pending_state_dict(self)  # the same for the experimental_load_state_dict API

    def _data_parallel_plan(self, trainable: list[str]) -> DataParallelPlan | None:
        if self._distributed is None:
            return None
        dist_opts = self.options.distributed
        shapes = {p: tuple(i.dims) for i in self._onnx_model.graph.initializer for p in [i.name] if p in trainable}
        self._zero_owners = (partition_parameters(shapes, self._world_size)
                             if dist_opts.deepspeed_zero_optimization.stage > 0 else None)
        owned = None if self._zero_owners is None else [p for p in trainable if self._zero_owners[p] == self._rank]
        return DataParallelPlan(self._world_size, dist_opts.allreduce_post_accumulation, dist_opts.enable_adasum, owned)

    def _create_session(self, state: dict, config: SessionConfig) -> TrainingSession:
        compiled = self._compiled
        if compiled.step is None:
            return TrainingSession(compiled.training, compiled.eval_model, state, config, compiled.graph_for)
        return DataParallelSession(
            DataParallelGraphs(compiled.step, compiled.training, compiled.reduced_inputs), compiled.eval_model, state,
            config, Communicator(self._world_size), accumulation_steps=self.options.batch.gradient_accumulation_steps,
            adasum=self.options.distributed.enable_adasum, owners=self._zero_owners, rank=self._rank,
            step_for=compiled.graph_for)

    def _describe_mixed_precision(self) -> None:
        """Record the loss-scale input, the all-finite output and the float16 outputs in model_desc (legacy §3.4)."""
        opts = self.options.mixed_precision
        if not opts.enabled:
            if opts.loss_scaler is not None:
                raise ValueError("Loss Scaler cannot be specified when Mixed Precision is not enabled")
            return
        graph = self._compiled.training
        self.model_desc.loss_scale_input = graph.loss_scale_input
        self.model_desc.all_finite = graph.all_finite_output
        opts.loss_scaler.input_name = graph.loss_scale_input
        types = output_elem_types(self._compiled.eval_model)
        for i, desc in enumerate(self.model_desc.outputs):
            if getattr(desc, "dtype", None) == torch.float32 and types.get(desc.name) == onnx.TensorProto.FLOAT16:
                self.model_desc.add_type_to_output_description(i, desc.dtype, torch.float16)

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

    def _type_descriptions_from_graph(self) -> None:
        """ONNX model: input and output dtypes come from the graph."""
        graph = self._onnx_model.graph
        known = {v.name for v in list(graph.input) + list(graph.output)}
        for kind, descs, add in (("input", self.model_desc.inputs, self.model_desc.add_type_to_input_description),
                                 ("output", self.model_desc.outputs, self.model_desc.add_type_to_output_description)):
            for i, desc in enumerate(descs):
                _require(desc.name in known, f"ONNX model with unknown {kind} type ({desc.name})")
                add(i, onnx_to_torch_dtype(tensor_elem_type(self._onnx_model, desc.name)))

    def _check_loss_is_scalar(self, exported) -> None:
        for desc, value in zip(self.model_desc.outputs, exported.sample_outputs, strict=False):
            if desc.is_loss and isinstance(value, torch.Tensor) and value.dim() != 0:
                raise ValueError(f"the loss output {desc.name!r} must be a scalar (shape []), but the model returns "
                                 f"shape {list(value.shape)}; reduce it (e.g. mean) in the model or loss_fn")

    def _check_model_export(self, inputs: list) -> None:
        """debug.check_model_export: the exported graph (eval mode) must reproduce PyTorch's outputs."""
        import numpy as np

        outputs = [d.name for d in self.model_desc.outputs]
        results = self._training_session.evaluate(dict(zip([d.name for d in self.model_desc.inputs], inputs,
                                                           strict=True)), outputs)
        for name, expected in zip(outputs, self.torch_sample_outputs, strict=False):
            try:
                np.testing.assert_allclose(results[name].cpu().numpy(), expected.cpu().numpy(), rtol=1e-2, atol=1e-6)
            except AssertionError as err:
                raise AssertionError(
                    f"Mismatch between outputs of PyTorch model and exported ONNX model for output {name!r}. Note "
                    "that different backends may exhibit small computational differences. If this is within "
                    "acceptable margin, or if there is random generator in the model causing inevitable mismatch, "
                    f"you can proceed training by setting the flag debug.check_model_export to False.\n{err}"
                ) from err


_logger = logging.getLogger(__name__)


def _require(condition: bool, message: str) -> None:
    # The legacy API raised AssertionError with these messages; raise explicitly so `python -O` keeps the checks.
    if not condition:
        raise AssertionError(message)


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


def _seed_onnxruntime() -> None:
    """Seed ONNX Runtime's RNG (dropout masks) from torch's seed, so `torch.manual_seed` makes runs repeatable.

    Rule: the ONNX Runtime seed is `1 + torch.initial_seed() mod 2**30`. Why: the k-th Dropout computation seeds
    its engine (minstd_rand0) with `seed + k - 1`, and that engine treats a seed ≡ 0 mod 2**31 - 1 as 1, so seed 0
    (`torch.manual_seed(0)`) drew the same mask in the first two steps (verified on 1.19.2)."""
    from onnxruntime.capi import _pybind_state as C

    C.set_seed(1 + torch.initial_seed() % (1 << 30))
