"""How an ORTTrainer gets what it runs: the model exported (PyTorch, on the first step) or taken as given (ONNX),
post-processed, compiled into the training graph (`compile.py`) and opened on ONNX Runtime. The result is one
`Built` object; every function here takes the trainer's typed configuration, never the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import onnx
import torch

from .._require import require
from ..debug.subscriber import no_increase_global_step
from . import export as export_mod
from . import ort_private
from .activations import ActivationStatistics
from .compile import CompiledModel, CompileRequest, DataParallelPlan, compile_model
from .config import TrainerConfig, recompute_plan
from .distributed import Communicator, broadcast_from_rank0, check_ranks_agree, partition_parameters
from .gradient.choice import BuilderChoice, choose_builder, ort_only_options
from .gradient.errors import GradientBuildError
from .gradient.onnx_module import OnnxModule
from .gradient.ort_options import GradientOptions
from .gradient.torch_graphs import TorchSource
from .graph.data_parallel import DataParallelGraphs, GradientStepGraph
from .graph.postprocess import run_postprocess
from .graph.training import TrainingGraph
from .inputs import check_inputs
from .locks import TRACING
from .model_types import describe_mixed_precision, record_export_types, record_graph_types
from .ort_session import writable_debug_path
from .parameters import split_parameters
from .rng import DropoutStreams
from .runtime import has_training_build
from .session import EvalGraphs, SessionBase, SessionConfig, TrainingSession
from .session_dp import DataParallelSession
from .shapes import named_dims, same_size_groups, shape_signature
from .torch_forward import ForwardSource, TorchEvalGraphs, module_state, state_model

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchExportInfo:
    """What exporting the PyTorch module learned that later steps need (None for an ONNX model)."""

    state_dict_keys: list[str]  # the module's state_dict order, for `state_dict(pytorch_format=True)`
    aliases: dict[str, str]  # state_dict key -> initializer holding the same (tied) tensor
    unused_state: dict[str, torch.Tensor]  # state_dict entries the graph does not use (copies; they never change)
    sample_outputs: list[torch.Tensor]  # PyTorch's outputs for the first batch (debug.check_model_export)
    dropout_off: bool  # the module was in eval mode: it trains without dropout, BatchNorm on running statistics


@dataclass
class Built:
    """Everything building produced. `forward` is the post-processed forward model (the legacy `_onnx_model`):
    `save_as_onnx` writes it with the current weights; the torch route exports it when first asked
    (`torch_forward.TorchEvalGraphs`). `session` owns the weights and optimizer state."""

    forward_source: onnx.ModelProto | Callable[[], onnx.ModelProto]
    compiled: CompiledModel
    session: SessionBase
    zero_owners: dict[str, int] | None  # ZeRO stage 1: which rank updates each trainable tensor
    torch_export: TorchExportInfo | None
    streams: DropoutStreams  # the trainer's dropout stream and its position (rng.py)

    @property
    def forward(self) -> onnx.ModelProto:
        """The post-processed forward model."""
        source = self.forward_source
        return source if isinstance(source, onnx.ModelProto) else source()

    @property
    def builder(self) -> BuilderChoice:
        """The gradient builder that made the graph, and why."""
        return self.compiled.builder

    @property
    def state_names(self) -> list[str]:
        """Every trained and frozen tensor the session holds."""
        return list(self.compiled.trainable) + list(self.compiled.frozen)


def build_from_torch(
    config: TrainerConfig, module: torch.nn.Module, sample_inputs: list, activations: ActivationStatistics
) -> Built:
    """Export `module` (+ loss) with the first batch, post-process, compile and open the session (one thread at a
    time: locks.TRACING).

    Routes ('auto''s rule, README § Gradient builders): a dry run in PyTorch finds the custom autograd Functions
    and `choose_builder` decides. The torch builder's route (`_torch_route`) never runs the TorchScript exporter.
    'ort', and 'auto' otherwise, export with TorchScript and differentiate with ONNX Runtime; 'auto' switches to
    the torch route when that export fails or ONNX Runtime has no gradient for an op (unless ort-only options
    are set: then it raises)."""
    with TRACING:
        return _build_from_torch(config, module, sample_inputs, activations)


def _build_from_torch(
    config: TrainerConfig, module: torch.nn.Module, sample_inputs: list, activations: ActivationStatistics
) -> Built:
    desc, options = config.model_desc, config.options
    check_inputs(sample_inputs, desc.inputs)
    with no_increase_global_step():  # counts no debug step and writes no file
        reads = options._internal_use.gradient_builder == "torch" or not has_training_build()  # the torch route's
        dry = export_mod.dry_run(module, config.loss_fn, desc, sample_inputs, record_reads=reads)
    ort_only = ort_only_options(options) + (["orttrainer.debug statistics"] if activations.subscribed else [])
    choice = choose_builder(
        options._internal_use.gradient_builder,
        custom_functions=dry.custom_functions,
        ort_only=ort_only,
        training_build=has_training_build(),
    )
    record_export_types(desc, dry)
    if choice.builder != "torch":
        try:
            return _torchscript_route(config, module, sample_inputs, activations, dry, choice)
        except (export_mod.TorchScriptExportError, GradientBuildError) as err:
            reason = _auto_fallback(choice, err)
            if reason is None:
                raise
            _logger.info("%s; building with the torch gradient builder", reason)
            choice = BuilderChoice("torch", reason)
    return _torch_route(config, module, sample_inputs, dry, choice)


def _auto_fallback(choice: BuilderChoice, err: Exception) -> str | None:
    """Why 'auto' switches to the torch builder after `err` on the TorchScript route, or None (no switch)."""
    if choice.builder == "auto" and isinstance(err, export_mod.TorchScriptExportError):
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"auto: the TorchScript exporter failed ({first_line})"
    if choice.builder == "auto" and isinstance(err, GradientBuildError) and err.op_type is not None:
        return f"auto: ONNX Runtime's gradient builder cannot differentiate op '{err.op_type}'"
    return None


def _torchscript_route(
    config: TrainerConfig,
    module: torch.nn.Module,
    sample_inputs: list,
    activations: ActivationStatistics,
    dry: export_mod.DryRun,
    choice: BuilderChoice,
) -> Built:
    desc, options = config.model_desc, config.options
    internal = options._internal_use
    with activations.marking():  # counts no debug step; marks subscribed activations
        exported = export_mod.export_model(
            module,
            config.loss_fn,
            desc,
            sample_inputs,
            opset_version=internal.onnx_opset_version,
            enable_contrib_ops=internal.enable_onnx_contrib_ops,
            dry=dry,
        )
    forward = activations.prepare(exported.model, config.loss_fn, desc, sample_inputs)
    forward = postprocess(config, forward)
    trainable, frozen = split_parameters(
        forward, list(options.utils.frozen_weights), exported.parameters, exported.buffers
    )
    info = _export_info(module, exported)
    return _open(config, _Parts(forward, trainable, frozen, choice, info, None, sample_inputs, activations))


def _torch_route(
    config: TrainerConfig, module: torch.nn.Module, sample_inputs: list, dry: export_mod.DryRun, choice: BuilderChoice
) -> Built:
    """The torch builder's route (`torch_forward.py`): state from the module itself, the training graph from
    AOTAutograd with model_desc's string dims dynamic, the forward model from torch.export when first needed."""
    desc, options = config.model_desc, config.options
    if dry.read_state is None:  # 'auto' came from the TorchScript route: the reads are recorded now
        with no_increase_global_step():
            dry = export_mod.dry_run(module, config.loss_fn, desc, sample_inputs)
    names, opset = [d.name for d in desc.inputs], options._internal_use.onnx_opset_version
    dims, outputs, amp = named_dims(desc.inputs), [d.name for d in desc.outputs], options.mixed_precision.enabled
    trainable, frozen = module_state(module, list(options.utils.frozen_weights), dry)
    source = TorchSource(module, config.loss_fn, names, opset, dry.was_training, dims, same_size_groups(desc.inputs))
    forward = ForwardSource(module, config.loss_fn, names, outputs, dims, opset, bool(amp))  # torch_amp.py
    evals = TorchEvalGraphs(
        forward, shape_signature(sample_inputs), lambda m: postprocess(config, m), trainable + frozen
    )
    weights = state_model(module, trainable + frozen)
    built = _open(config, _Parts(weights, trainable, frozen, choice, None, source, sample_inputs, None, evals))
    aliases, unused = export_mod.state_outside_graph(module, set(built.state_names))
    built.torch_export = TorchExportInfo(
        list(module.state_dict()), aliases, unused, dry.sample_outputs, not dry.was_training
    )
    return built


def _export_info(module: torch.nn.Module, exported: export_mod.ExportedModel) -> TorchExportInfo:
    return TorchExportInfo(
        list(module.state_dict().keys()),
        exported.aliases,
        exported.unused_state,
        exported.sample_outputs,
        not exported.was_training,
    )


def build_from_onnx(config: TrainerConfig, model: onnx.ModelProto) -> Built | OnnxFirstStep:
    """An ONNX model with a loss output, at construction: choose the builder, post-process, record dtypes and split
    the parameters. With 'ort', compile and open the session now. With 'torch', make the `OnnxModule` the builder
    traces (an op it cannot run is an error now) and return an `OnnxFirstStep`: the torch builder traces with a
    batch, so the trainer compiles on its first step, as for a PyTorch model."""
    options = config.options
    choice = choose_builder(
        options._internal_use.gradient_builder,
        onnx_model=True,
        ort_only=ort_only_options(options, onnx_model=True),
        training_build=has_training_build(),
    )
    forward = postprocess(config, model)
    record_graph_types(config.model_desc, forward)
    trainable, frozen = split_parameters(forward, list(options.utils.frozen_weights), None, None)
    if choice.builder != "torch":
        return _open(config, _Parts(forward, trainable, frozen, choice))
    source = _onnx_source(config, forward, trainable, frozen)
    return OnnxFirstStep(config, _Parts(forward, trainable, frozen, choice, source=source))


@dataclass(frozen=True)
class OnnxFirstStep:
    """An ONNX model the torch builder trains, prepared at construction; `build(first_batch)` compiles it."""

    config: TrainerConfig
    parts: _Parts

    def build(self, sample_inputs: list) -> Built:
        check_inputs(sample_inputs, self.config.model_desc.inputs)
        with TRACING:
            return _open(self.config, replace(self.parts, sample_inputs=sample_inputs))


def _onnx_source(
    config: TrainerConfig, forward: onnx.ModelProto, trainable: list[str], frozen: list[str]
) -> TorchSource:
    """The torch builder's source for an ONNX model: an OnnxModule of the post-processed forward model, its state
    renamed back to initializer names (gradient/onnx_module.py). The torch builder takes output 0 as the loss."""
    desc = config.model_desc
    inputs, outputs = [d.name for d in desc.inputs], [d.name for d in desc.outputs]
    if not desc.outputs[0].is_loss:
        raise ValueError(f"the 'torch' gradient builder needs the loss as the first model_desc output: {outputs}")
    module = OnnxModule(forward, inputs, outputs, trainable, frozen)
    opset = config.options._internal_use.onnx_opset_version
    return TorchSource(module, None, inputs, opset, True, state_names=module.state_names)


def postprocess(config: TrainerConfig, model: onnx.ModelProto) -> onnx.ModelProto:
    """The legacy post-processing options: internal passes, `extra_postprocess`, symbolic shape inference."""
    options = config.options
    internal = options._internal_use
    if internal.enable_internal_postprocess:
        model = run_postprocess(model)
    if internal.extra_postprocess:
        model = internal.extra_postprocess(model)
        require(
            isinstance(model, onnx.ModelProto),
            f"'extra_postprocess' must return a ONNX model (options _internal_use.extra_postprocess returned "
            f"{type(model).__name__})",
        )
    if options.utils.run_symbolic_shape_infer:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        model = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
    return model


@dataclass(frozen=True)
class _Parts:
    """What compiling needs besides the configuration."""

    forward: onnx.ModelProto
    trainable: list[str]
    frozen: list[str]
    choice: BuilderChoice
    torch_export: TorchExportInfo | None = None
    source: TorchSource | None = None
    sample_inputs: Sequence[torch.Tensor] | None = None
    activations: ActivationStatistics | None = None
    eval_graphs: TorchEvalGraphs | None = None  # the torch route: its forward model and eval graphs


def _open(config: TrainerConfig, parts: _Parts) -> Built:
    losses = [o.name for o in config.model_desc.outputs if o.is_loss]
    require(len(losses) == 1, f"Only one loss output is supported ({len(losses)} were specified)")
    plan, owners = _data_parallel_plan(config, parts.forward, parts.trainable)
    compiled = compile_model(_compile_request(config, parts, losses[0], plan))
    _logger.info("gradient builder '%s' (%s)", compiled.builder.builder, compiled.builder.reason)
    describe_mixed_precision(config, compiled)
    streams = DropoutStreams()
    ort_private.set_seed(streams.base)  # random ops other than Dropout draw from ONNX Runtime's global generator
    session = _create_session(config, compiled, owners, streams, parts.eval_graphs)
    compiled.initial_state = {}  # the session holds the state now: one copy (README § Benchmarks, memory)
    forward = parts.eval_graphs.forward_model if parts.eval_graphs is not None else parts.forward
    built = Built(forward, compiled, session, owners, parts.torch_export, streams)
    if config.distributed is not None:
        _start_from_rank0(built, config)
    return built


def _start_from_rank0(built: Built, config: TrainerConfig) -> None:
    """Ranks check that they built the same model, then take rank 0's initial weights (distributed.py)."""
    names = built.state_names
    values = built.session.get_state(names)
    signature = [(n, tuple(values[n].shape), str(values[n].dtype)) for n in names]
    check_ranks_agree(signature, config.rank, config.world_size)
    received = broadcast_from_rank0([torch.from_numpy(values[n]) for n in names])
    if config.rank != 0:
        built.session.set_state({n: t.numpy() for n, t in zip(names, received, strict=True)})


def _compile_request(config: TrainerConfig, parts: _Parts, loss: str, plan: DataParallelPlan | None) -> CompileRequest:
    opts, desc = config.options, config.model_desc
    statistics = parts.activations if parts.activations is not None and parts.activations.instrumented else None
    return CompileRequest(
        forward=parts.forward,
        loss_name=loss,
        data_inputs=[d.name for d in desc.inputs],
        outputs=[d.name for d in desc.outputs],
        trainable=parts.trainable,
        frozen=parts.frozen,
        optim_config=config.optim_config,
        accumulation_steps=config.accumulation_steps,
        clip_grad_norm=opts.utils.grad_norm_clip,
        dropout_off=bool(parts.torch_export and parts.torch_export.dropout_off),
        lazy_eval=parts.eval_graphs is not None,
        graph_save_paths=dict(opts.debug.graph_save_paths._validated_opts),
        mixed_precision=opts.mixed_precision.enabled,
        cpu=config.device.type == "cpu",
        data_parallel=plan,
        builder=parts.choice,
        torch_source=parts.source,
        sample_inputs=parts.sample_inputs,
        recompute=recompute_plan(opts),
        gradient_options=GradientOptions.from_options(opts),
        statistics=statistics,
    )


def _data_parallel_plan(
    config: TrainerConfig, forward: onnx.ModelProto, trainable: list[str]
) -> tuple[DataParallelPlan | None, dict[str, int] | None]:
    if config.distributed is None:
        return None, None
    dist_opts = config.options.distributed
    wanted = set(trainable)
    shapes = {i.name: tuple(i.dims) for i in forward.graph.initializer if i.name in wanted}
    owners = partition_parameters(shapes, config.world_size) if config.zero_stage > 0 else None
    owned = None if owners is None else [p for p in trainable if owners[p] == config.rank]
    plan = DataParallelPlan(config.world_size, dist_opts.allreduce_post_accumulation, dist_opts.enable_adasum, owned)
    return plan, owners


def _create_session(
    config: TrainerConfig,
    compiled: CompiledModel,
    owners: dict[str, int] | None,
    streams: DropoutStreams,
    eval_for: EvalGraphs | None,
) -> SessionBase:
    opts = config.options
    session_config = SessionConfig(
        device=config.device,
        mem_limit=opts.device.mem_limit,
        provider_options=dict(opts._validated_opts["provider_options"]),
        session_options=opts.session_options,
        deterministic=opts.debug.deterministic_compute,
        optimized_model_path=writable_debug_path(
            opts.debug.graph_save_paths.model_with_training_graph_after_optimization_path,
            "debug.graph_save_paths.model_with_training_graph_after_optimization_path",
        ),
    )
    state = compiled.initial_state
    if compiled.step is None:
        graph_for = cast(Callable[[Sequence[torch.Tensor]], TrainingGraph] | None, compiled.graph_for)  # one process
        return TrainingSession(
            compiled.training, compiled.eval_model, state, session_config, streams, graph_for, eval_for
        )
    graphs = DataParallelGraphs(compiled.step, compiled.training, compiled.reduced_inputs or {})
    return DataParallelSession(
        graphs,
        compiled.eval_model,
        state,
        session_config,
        Communicator(config.world_size),
        accumulation_steps=config.accumulation_steps,
        adasum=opts.distributed.enable_adasum,
        owners=owners,
        rank=config.rank,
        streams=streams,
        step_for=cast(Callable[[Sequence[torch.Tensor]], GradientStepGraph] | None, compiled.graph_for),
        eval_for=eval_for,
    )
