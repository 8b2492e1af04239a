"""The trainer's model, not yet built (`Unbuilt`) or built (`Built`), and the pipeline that builds it.

`build_model` reads top-down through the three stages (docs/architecture.md):
1. build/ — the model -> its post-processed forward ONNX model and state (`build.forward.Forward`);
2. compile/ — the forward model -> training and eval graphs and the initial state (`compile_model`, whose numbered
   stages are graph/pipeline.py's);
3. runtime/ — the ONNX Runtime session that holds the state and runs the graphs (runtime/session.py; with data
   parallelism runtime/data_parallel.py, whose ranks then start from rank 0's weights).
'auto' (README § Gradient builders) tries the TorchScript route first and falls back to the torch route when any
part of it fails: the export, ONNX Runtime's gradient build, the compile or the session (`build.forward.auto_fallback`);
when the torch route fails too, the error names both reasons. An ONNX model that 'auto' gave the 'ort' builder goes
to the torch builder when ONNX Runtime's gradient build fails on it (`build_onnx_model`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import onnx
import torch

from .._require import require
from ..amp import LossScaler
from ..schema.model_desc import OutputDescriptionTyped, _ORTTrainerModelDesc
from .activations import ActivationStatistics
from .build import cached as build_cache
from .build.export import TRACING, state_outside_graph
from .build.forward import (
    Forward,
    NoBuilderTrainsError,
    TorchExportInfo,
    auto_fallback,
    onnx_forward,
    prepare_cached,
    prepare_torch,
    torch_route_forward,
    torchscript_forward,
    warn_of_fixed_branches,
)
from .build.torch_route import module_values
from .compile.compiler import (
    CompiledModel,
    CompileRequest,
    DataParallelPlan,
    GraphCache,
    compile_model,
    output_elem_types,
    restore_compiled,
)
from .compile.contract import (
    TrainingGraph,
    accumulation_buffer_name,
    check_same_state_contract,
    read_contract,
    zero_state,
)
from .config import TrainerConfig, recompute_plan
from .gradient.choice import BuilderChoice
from .gradient.errors import GradientBuildError
from .gradient.ort_options import GradientOptions
from .inputs import check_inputs
from .runtime import ort_private
from .runtime.data_parallel import Communicator, DataParallelSession, partition_parameters, start_from_rank0
from .runtime.ort import providers_for, writable_debug_path
from .runtime.session import SessionBase, SessionConfig, TrainingSession
from .state import TrainerState

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unbuilt:
    """A model that is built with its first batch: a PyTorch module, or an ONNX model the torch gradient builder
    trains (`onnx`: prepared at construction, so that an op it cannot run is an error there)."""

    module: torch.nn.Module | None = None
    onnx: Forward | None = None


@dataclass(frozen=True)
class Built:
    """Everything building produced. `forward` is the post-processed forward model (the legacy `_onnx_model`):
    `save_as_onnx` writes it with the current weights; the torch route exports it when first asked
    (`build.torch_route.TorchEvalGraphs`). `session` owns the weights and optimizer state. `model_desc` is the
    model description with the dtypes building learned."""

    forward_source: onnx.ModelProto | Callable[[], onnx.ModelProto]
    compiled: CompiledModel
    session: SessionBase
    zero_owners: dict[str, int] | None  # ZeRO stage 1: which rank updates each trainable tensor
    torch_export: TorchExportInfo | None
    model_desc: _ORTTrainerModelDesc

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


def build_onnx_model(config: TrainerConfig, state: TrainerState, model: onnx.ModelProto) -> Built | Unbuilt:
    """An ONNX model, at construction: built now with the 'ort' builder; with the torch builder prepared now and
    built on the first step."""
    forward = onnx_forward(config, model)
    if forward.choice.builder == "torch":
        return Unbuilt(onnx=forward)
    _check_providers(config)
    try:
        return _compile_and_open(config, state, forward)
    except GradientBuildError as err:  # 'auto' falls back as for a PyTorch model (`build.forward.auto_fallback`)
        if config.options._internal_use.gradient_builder != "auto":
            raise
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        reason = f"auto: ONNX Runtime's gradient builder failed ({first_line})"
        _logger.info("%s; building with the torch gradient builder", reason)
        try:
            return Unbuilt(onnx=onnx_forward(config, model, BuilderChoice("torch", reason)))
        except Exception as torch_err:
            raise NoBuilderTrainsError(
                f"neither gradient builder can train the ONNX model: the 'ort' builder: {reason.removeprefix('auto: ')}"
                f"; the torch builder: {type(torch_err).__name__}: {torch_err}"
            ) from torch_err


def build_model(
    config: TrainerConfig, state: TrainerState, model: Unbuilt, sample_inputs: list, activations: ActivationStatistics
) -> Built:
    """Build `model` with its first batch, one thread at a time (`TRACING`)."""
    _check_providers(config)
    with TRACING:
        if model.onnx is not None:
            check_inputs(sample_inputs, config.model_desc.inputs)
            forward = Forward(**{**model.onnx.__dict__, "sample_inputs": sample_inputs})
            return _compile_and_open(config, state, forward)
        if model.module is None:
            raise RuntimeError("Model is uninitialized. Only ONNX and PyTorch models are supported")
        return _build_torch(config, state, model.module, sample_inputs, activations)


def _check_providers(config: TrainerConfig) -> None:
    """Raise before the export, the trace and the compile when no session could open: `device.id` asks for CUDA on
    a machine without it. A PyTorch model's construction does not check it: a trainer that only loads and saves
    checkpoints opens no session (the legacy default device is 'cuda')."""
    providers_for(
        config.device, config.options.device.mem_limit, dict(config.options._validated_opts["provider_options"])
    )


def _build_torch(
    config: TrainerConfig,
    state: TrainerState,
    module: torch.nn.Module,
    sample_inputs: list,
    activations: ActivationStatistics,
) -> Built:
    cached = build_cache.lookup(config, module, sample_inputs, activations)  # None: the cache is not used
    if cached is not None:
        built = _build_from_cache(config, state, module, sample_inputs, activations, cached)
        if built is not None:
            return built
    plan = prepare_torch(config, module, sample_inputs)
    if plan.choice.builder != "torch":
        try:
            forward = torchscript_forward(config, module, sample_inputs, activations, plan)
            built = _compile_and_open(config, state, forward, cached)
        except Exception as err:
            reason = auto_fallback(plan.choice, err)
            if reason is None:
                raise
            ort_failure = err
        else:
            warn_of_fixed_branches(type(module).__name__, forward.fixed_branches)  # outside: a warning is no failure
            return built
        # outside the handler: the torch builder's errors do not chain to the 'ort' builder's (an error naming the
        # model's line would find the TorchScript exporter's frames in that chain)
        _logger.info("%s; building with the torch gradient builder", reason)
        try:
            forward = torch_route_forward(
                config, module, sample_inputs, plan.falling_back(reason), activations, None, _eval_cache(cached)
            )
            return _compile_and_open(config, state, forward, cached)
        except Exception as torch_err:
            if type(torch_err) is type(ort_failure) and str(torch_err) == str(ort_failure):
                raise ort_failure from None  # not the builder's failure: the user's input or options, as either says
            raise NoBuilderTrainsError(
                f"neither gradient builder can train {type(module).__name__}: the 'ort' builder: "
                f"{reason.removeprefix('auto: ')}; the torch builder: {type(torch_err).__name__}: {torch_err}"
            ) from torch_err
    forward = torch_route_forward(config, module, sample_inputs, plan, activations, None, _eval_cache(cached))
    return _compile_and_open(config, state, forward, cached)


def _eval_cache(cached: build_cache.CachedBuild | None) -> GraphCache | None:
    return cached.eval_graphs() if cached is not None else None


def reexport_for_shapes(
    config: TrainerConfig, built: Built, module: torch.nn.Module, batch: list, activations: ActivationStatistics
) -> CompiledModel:
    """The TorchScript route's model exported again with `batch` and compiled for its shapes (stages 1 and 2), for
    a batch the first graph fails on: the TorchScript exporter turns a size read into a Python number while it
    traces (a causal mask made with `torch.ones(n, n)`, a view sized from `x.size(0)`) into a constant, so a graph
    exported with dynamic axes can still hold the first batch's sizes. RuntimeError when the new graph's state
    contract differs from the session's (the trainer then raises the original error)."""
    with TRACING:
        plan = prepare_torch(config, module, batch)
        forward = torchscript_forward(config, module, batch, activations, plan)
        losses = [o.name for o in forward.model_desc.outputs if o.is_loss]
        dp_plan, _ = _data_parallel_plan(config, forward.forward, forward.trainable)
        compiled, _ = compile_model(_compile_request(config, forward, losses[0], dp_plan))
    check_same_state_contract(built.compiled.step_graph, compiled.step_graph)
    return compiled


def _compile_and_open(
    config: TrainerConfig, state: TrainerState, forward: Forward, cached: build_cache.CachedBuild | None = None
) -> Built:
    """Stages 2 and 3: compile `forward`, then open the session on the initial state; with `cached`, the compiled
    graphs are stored for the next process (build/cached.py)."""
    losses = [o.name for o in forward.model_desc.outputs if o.is_loss]
    require(len(losses) == 1, f"Only one loss output is supported ({len(losses)} were specified)")
    plan, owners = _data_parallel_plan(config, forward.forward, forward.trainable)
    compiled, initial = compile_model(_compile_request(config, forward, losses[0], plan, cached))
    built = _open(config, state, forward, compiled, initial, owners, cached)
    if cached is not None and compiled.branches_on_values:
        # the cache finds graphs by the first batch and its shapes, and such a graph serves only the values that
        # branch as the first batch's did (compile/compiler.TorchShapeGraphs)
        _logger.info("the compiled graphs are not stored in the compile cache: the forward branches on values")
    elif cached is not None:
        meta = {
            "route": "torch" if forward.source is not None else "torchscript",
            "builder": [compiled.builder.builder, compiled.builder.reason],
            "trainable": compiled.trainable,
            "frozen": compiled.frozen,
            "shapes": {name: list(shape) for name, shape in compiled.shapes.items()},
            "output_dtypes": [  # typed by the dry run (build/export.record_export_types)
                str(cast(OutputDescriptionTyped, d).dtype).removeprefix("torch.") for d in forward.model_desc.outputs
            ],
        }
        eval_model = compiled.eval_model if forward.eval_graphs is None else None
        cached.store_first(meta, compiled.training.model, eval_model)
    return built


def _build_from_cache(
    config: TrainerConfig,
    state: TrainerState,
    module: torch.nn.Module,
    sample_inputs: list,
    activations: ActivationStatistics,
    cached: build_cache.CachedBuild,
) -> Built | None:
    """Stages 1 and 2 from the compile cache (None on a miss): the typed model_desc and the builder from the entry,
    the dry run deferred until its outputs are read, and the stored graphs; the initial state is the module's, as
    compilation would take it."""
    stored = cached.load_first()
    if stored is None:
        return None
    meta, training_model, eval_model = stored
    _logger.info("the compiled graphs come from the compile cache (%s)", cached.cache.path(cached.first_key))
    choice = BuilderChoice(*meta["builder"])
    output_dtypes = [getattr(torch, name) for name in meta["output_dtypes"]]
    plan = prepare_cached(config, module, sample_inputs, output_dtypes, choice)
    split = (list(meta["trainable"]), list(meta["frozen"]))
    source: onnx.ModelProto | Callable[[], onnx.ModelProto]
    if meta["route"] == "torch":
        forward = torch_route_forward(config, module, sample_inputs, plan, activations, split, cached.eval_graphs())
        assert forward.eval_graphs is not None  # the torch route exports its forward model when first asked
        source = forward.eval_graphs.forward_model
    else:
        aliases, unused = state_outside_graph(module, set(split[0] + split[1]))
        info = TorchExportInfo(
            list(module.state_dict()), aliases, unused, lambda: plan.dry.sample_outputs, not module.training
        )
        forward = Forward(plan.model_desc, onnx.ModelProto(), *split, choice, info, None, sample_inputs)
        source = _LazyExport(config, module, sample_inputs, activations, plan)
    losses = [o.name for o in forward.model_desc.outputs if o.is_loss]
    request = _compile_request(config, forward, losses[0], None, cached)
    shapes = {name: tuple(shape) for name, shape in meta["shapes"].items()}
    training = read_contract(training_model)
    assert isinstance(training, TrainingGraph)  # data parallelism is not cached
    compiled = restore_compiled(request, training, eval_model or onnx.ModelProto(), choice, shapes)
    weights = module_values(module, split[0] + split[1])
    initial = {**weights, **zero_state(training.state_shapes), **zero_state(_buffer_shapes(compiled))}
    return _open(config, state, forward, compiled, initial, None, cached, source)


class _LazyExport:
    """The TorchScript route's post-processed forward model, exported when first asked (a cached build did not
    export it; `save_as_onnx` fills in the session's weights by name)."""

    def __init__(self, config: TrainerConfig, module: torch.nn.Module, inputs: list, activations, plan) -> None:
        self._arguments = (config, module, inputs, activations, plan)
        self._model: onnx.ModelProto | None = None

    def __call__(self) -> onnx.ModelProto:
        if self._model is None:
            with TRACING:
                self._model = torchscript_forward(*self._arguments).forward
        return self._model


def _buffer_shapes(compiled: CompiledModel) -> dict[str, tuple[int, ...]]:
    suffix = len(accumulation_buffer_name(""))
    return {name: compiled.shapes[name[:-suffix]] for name in compiled.accumulation_buffers}


def _open(
    config: TrainerConfig,
    state: TrainerState,
    forward: Forward,
    compiled: CompiledModel,
    initial: dict,
    owners: dict[str, int] | None,
    cached: build_cache.CachedBuild | None = None,
    source: onnx.ModelProto | Callable[[], onnx.ModelProto] | None = None,
) -> Built:
    """Stage 3: the session on the initial state, and the built model."""
    _logger.info("gradient builder '%s' (%s)", compiled.builder.builder, compiled.builder.reason)
    _describe_mixed_precision(config, forward.model_desc, compiled, state.loss_scaler)
    ort_private.set_seed(state.streams.base)  # random ops other than Dropout draw from ONNX Runtime's global generator
    session = _open_session(config, state, compiled, initial, owners, forward, cached)
    del initial  # the session holds the state now: one copy (README § Benchmarks, memory)
    if source is None:
        source = forward.eval_graphs.forward_model if forward.eval_graphs is not None else forward.forward
    built = Built(source, compiled, session, owners, forward.torch_export, forward.model_desc)
    if config.distributed is not None:
        start_from_rank0(session, built.state_names, config.rank, config.world_size)
    return built


def _compile_request(
    config: TrainerConfig,
    forward: Forward,
    loss: str,
    plan: DataParallelPlan | None,
    cached: build_cache.CachedBuild | None = None,
) -> CompileRequest:
    opts, desc = config.options, forward.model_desc
    return CompileRequest(
        forward=forward.forward,
        loss_name=loss,
        data_inputs=[d.name for d in desc.inputs],
        outputs=[d.name for d in desc.outputs],
        trainable=forward.trainable,
        frozen=forward.frozen,
        optim_config=config.optim_config,
        accumulation_steps=config.accumulation_steps,
        clip_grad_norm=opts.utils.grad_norm_clip,
        dropout_off=bool(forward.torch_export and forward.torch_export.dropout_off),
        lazy_eval=forward.eval_graphs is not None,
        graph_save_paths=dict(opts.debug.graph_save_paths._validated_opts),
        mixed_precision=opts.mixed_precision.enabled,
        cpu=config.device.type == "cpu",
        data_parallel=plan,
        builder=forward.choice,
        torch_source=forward.source,
        sample_inputs=forward.sample_inputs,
        recompute=recompute_plan(opts),
        gradient_options=GradientOptions.from_options(opts),
        statistics=forward.activations,
        batch_norms=forward.batch_norms,
        embedding_padding=forward.embedding_padding,
        graph_cache=cached.graphs() if cached is not None else None,
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


def _open_session(
    config: TrainerConfig,
    state: TrainerState,
    compiled: CompiledModel,
    initial: dict,
    owners: dict[str, int] | None,
    forward: Forward,
    cached: build_cache.CachedBuild | None = None,
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
        # the memory options free buffers when their tensors die (README § Memory; docs/engine.md §16)
        memory_reuse=not (recompute_plan(opts) or opts.utils.memory_efficient_gradient),
    )
    eval_for = forward.eval_graphs
    if compiled.step is None:
        cache = cached.specialisations() if cached is not None else None
        return TrainingSession(compiled, initial, session_config, state.streams, eval_for, cache)
    return DataParallelSession(
        compiled,
        initial,
        session_config,
        Communicator(config.world_size),
        window=state.window,
        adasum=opts.distributed.enable_adasum,
        owners=owners,
        rank=config.rank,
        streams=state.streams,
        eval_for=eval_for,
    )


def _describe_mixed_precision(
    config: TrainerConfig, desc: _ORTTrainerModelDesc, compiled: CompiledModel, scaler: LossScaler | None
) -> None:
    """Record the loss-scale input, the all-finite output and the float16 outputs in model_desc. A loss scaler
    without mixed precision is the legacy error, raised where the original raised it: at session creation
    (docs/legacy_api.md §3.4)."""
    if not config.options.mixed_precision.enabled:
        if config.options.mixed_precision.loss_scaler is not None:
            raise ValueError("Loss Scaler cannot be specified when Mixed Precision is not enabled")
        return
    graph = compiled.training
    if graph.loss_scale_input is None or graph.all_finite_output is None:  # compile adds both under mixed precision
        raise RuntimeError("the mixed-precision training graph has no loss-scale input or all-finite output")
    desc.loss_scale_input = graph.loss_scale_input
    desc.all_finite = graph.all_finite_output
    assert scaler is not None  # make_config gives mixed precision a DynamicLossScaler when the options name none
    scaler.input_name = graph.loss_scale_input
    types = {**output_elem_types(compiled.step_graph.model), **output_elem_types(compiled.eval_model)}
    for i, output in enumerate(desc.outputs):
        dtype = getattr(output, "dtype", None)  # set only once the type is known
        if dtype == torch.float32 and types.get(output.name) == onnx.TensorProto.FLOAT16:
            desc.add_type_to_output_description(i, dtype, torch.float16)
