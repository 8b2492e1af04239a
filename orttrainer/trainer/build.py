"""How an ORTTrainer gets what it runs: the model exported (PyTorch, on the first step) or taken as given (ONNX),
post-processed, compiled into the training graph (`compile.py`) and opened on ONNX Runtime. The result is one
`Built` object; every function here takes the trainer's typed configuration, never the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import onnx
import torch

from .._require import require
from . import export as export_mod
from . import ort_private
from .activations import ActivationStatistics
from .compile import CompiledModel, CompileRequest, DataParallelPlan, compile_model
from .config import TrainerConfig, recompute_plan
from .distributed import Communicator, broadcast_from_rank0, check_ranks_agree, partition_parameters
from .gradient.choice import BuilderChoice, choose_builder, ort_only_options
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
from .session import SessionBase, SessionConfig, TrainingSession
from .session_dp import DataParallelSession

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
    `save_as_onnx` writes it with the current weights. `session` owns the weights and optimizer state."""

    forward: onnx.ModelProto
    compiled: CompiledModel
    session: SessionBase
    zero_owners: dict[str, int] | None  # ZeRO stage 1: which rank updates each trainable tensor
    torch_export: TorchExportInfo | None
    streams: DropoutStreams  # the trainer's dropout stream and its position (rng.py)

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
    time: locks.TRACING)."""
    with TRACING:
        return _build_from_torch(config, module, sample_inputs, activations)


def _build_from_torch(
    config: TrainerConfig, module: torch.nn.Module, sample_inputs: list, activations: ActivationStatistics
) -> Built:
    desc, options = config.model_desc, config.options
    check_inputs(sample_inputs, desc.inputs)
    internal = options._internal_use
    with activations.marking():  # counts no debug step; marks subscribed activations
        exported = export_mod.export_model(
            module,
            config.loss_fn,
            desc,
            sample_inputs,
            opset_version=internal.onnx_opset_version,
            enable_contrib_ops=internal.enable_onnx_contrib_ops,
        )
    ort_only = ort_only_options(options) + (["orttrainer.debug statistics"] if activations.marked else [])
    choice = choose_builder(internal.gradient_builder, custom_functions=exported.custom_functions, ort_only=ort_only)
    record_export_types(desc, exported)
    info = TorchExportInfo(
        list(module.state_dict().keys()),
        exported.aliases,
        exported.unused_state,
        exported.sample_outputs,
        not exported.was_training,
    )
    source = TorchSource(
        module, config.loss_fn, [d.name for d in desc.inputs], internal.onnx_opset_version, exported.was_training
    )
    forward = activations.prepare(exported.model, config.loss_fn, desc, sample_inputs)
    forward = postprocess(config, forward)
    trainable, frozen = split_parameters(
        forward, list(options.utils.frozen_weights), exported.parameters, exported.buffers
    )
    parts = _Parts(forward, trainable, frozen, choice, info, source, sample_inputs, activations)
    return _open(config, parts)


def build_from_onnx(config: TrainerConfig, model: onnx.ModelProto) -> Built:
    """An ONNX model with a loss output: post-process, compile and open the session (at construction)."""
    choice = choose_builder(config.options._internal_use.gradient_builder, onnx_model=True)
    forward = postprocess(config, model)
    record_graph_types(config.model_desc, forward)
    trainable, frozen = split_parameters(forward, list(config.options.utils.frozen_weights), None, None)
    return _open(config, _Parts(forward, trainable, frozen, choice))


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


def _open(config: TrainerConfig, parts: _Parts) -> Built:
    losses = [o.name for o in config.model_desc.outputs if o.is_loss]
    require(len(losses) == 1, f"Only one loss output is supported ({len(losses)} were specified)")
    plan, owners = _data_parallel_plan(config, parts.forward, parts.trainable)
    compiled = compile_model(_compile_request(config, parts, losses[0], plan))
    _logger.info("gradient builder '%s' (%s)", compiled.builder.builder, compiled.builder.reason)
    describe_mixed_precision(config, compiled)
    streams = DropoutStreams()
    ort_private.set_seed(streams.base)  # random ops other than Dropout draw from ONNX Runtime's global generator
    session = _create_session(config, compiled, owners, streams)
    compiled.initial_state = {}  # the session holds the state now: one copy (README § Benchmarks, memory)
    built = Built(parts.forward, compiled, session, owners, parts.torch_export, streams)
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
    config: TrainerConfig, compiled: CompiledModel, owners: dict[str, int] | None, streams: DropoutStreams
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
        return TrainingSession(compiled.training, compiled.eval_model, state, session_config, streams, graph_for)
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
    )
