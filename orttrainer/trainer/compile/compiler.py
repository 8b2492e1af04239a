"""`compile_model`: forward ONNX model -> training graph (data parallel: gradient-step and optimizer graphs), eval
graph and initial state, in the numbered stages of graph/pipeline.py.

Everything after the gradient builder is the same for both builders and, with the torch builder, for every
input-shape signature (`TorchShapeGraphs` runs stages 2-4 again for a batch the first graph does not serve). The
debug option `graph_save_paths` names the stage after which a model is written (with the torch builder: the first
signature's).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ...optim.config import _OptimizerConfig
from ..build.export import TRACING
from ..gradient.choice import BuilderChoice
from ..gradient.differentiate import GradientRequest, differentiate
from ..gradient.ort_options import GradientOptions
from ..gradient.torch_graphs import STATIC_SIGNATURES, Accepts, TorchSource, torch_gradient_model
from ..gradient.torch_graphs import loss_scale_names as loss_scale_names_torch
from ..graph.batch_norm_statistics import BatchNormStatistics
from ..graph.data_parallel import build_optimizer_graph
from ..graph.mixed_precision import loss_scale_names
from ..graph.passes import record_stage, rewrite_enabled, run_passes
from ..graph.pipeline import (
    StatisticsInstrument,
    eval_forward_passes,
    eval_passes,
    forward_passes,
    gradient_passes,
    mixed_precision_passes,
    training_tail,
)
from ..graph.recompute import RecomputePlan
from ..runtime.ort import writable_debug_path
from ..runtime.session import GraphKeys, shape_signature
from ..update.path import choose_update_path, param_groups
from .contract import (
    GradientStepGraph,
    StepGraph,
    TrainingGraph,
    accumulation_buffer_name,
    buffer_update_name,
    check_same_state_contract,
    read_contract,
    zero_state,
)

_logger = logging.getLogger(__name__)

InitialState = dict[str, np.ndarray]  # weights, frozen tensors, zeroed moments and buffers: what the session holds


@dataclass(frozen=True)
class DataParallelPlan:
    """How this rank's gradients are combined: `world_size` ranks, reduced after accumulation or per micro-step,
    summed or combined with Adasum, and (ZeRO stage 1) which tensors this rank updates."""

    world_size: int
    post_accumulation: bool
    adasum: bool
    owned: list[str] | None  # None: every rank updates every tensor


class GraphSlot(Protocol):
    """One batch's place in a `GraphCache`: `load` gives the graph stored for it or None; `store` keeps one."""

    def load(self) -> onnx.ModelProto | None: ...

    def store(self, model: onnx.ModelProto) -> None: ...


class GraphCache(Protocol):
    """Where compiled graphs for a batch's shapes are kept across processes (compile/cache.py): `slot(inputs)` is
    the place of the batch `inputs` (the data, model_desc order), whose key is computed once, when first used."""

    def slot(self, inputs: Sequence[torch.Tensor]) -> GraphSlot: ...


@dataclass(frozen=True)
class CompileRequest:
    """What the trainer knows when it compiles: names from model_desc, the parameter split and the options."""

    forward: onnx.ModelProto  # after post-processing
    loss_name: str
    data_inputs: list[str]
    outputs: list[str]
    trainable: list[str]
    frozen: list[str]
    optim_config: _OptimizerConfig
    accumulation_steps: int
    clip_grad_norm: bool
    dropout_off: bool  # the torch model was in eval mode: train without dropout, BatchNorm on running statistics
    graph_save_paths: dict[str, str]
    mixed_precision: bool = False
    cpu: bool = True  # CPU kernels need float32 fall-backs under mixed precision
    data_parallel: DataParallelPlan | None = None
    builder: BuilderChoice = BuilderChoice("ort", "")  # see gradient/choice.py
    torch_source: TorchSource | None = None  # what the torch builder traces (None: an ONNX model)
    sample_inputs: Sequence[torch.Tensor] | None = None  # the first batch: the torch builder's first signature
    recompute: RecomputePlan = RecomputePlan()  # the 'ort' builder's pass (the torch builder's: in its trace)
    gradient_options: GradientOptions | None = None  # cast propagation (both builders), memory-efficient gradients
    statistics: StatisticsInstrument | None = None  # orttrainer.debug statistics
    lazy_eval: bool = False  # the torch route: `forward` holds only the state, eval graphs come from torch_route
    batch_norms: Sequence[BatchNormStatistics] = ()  # running statistics the 'ort' builder's graph updates
    embedding_padding: Mapping[str, int] = field(default_factory=dict)  # 'ort' builder: graph/embedding_padding.py
    update: str = "auto"  # where the optimizer update runs (update/path.py); resolved by compile_model
    graph_cache: GraphCache | None = None  # torch builder: the graphs for other shapes, across processes


@dataclass(frozen=True)
class CompiledModel:
    """`training` is the whole step in one process; with data parallelism it is the optimizer graph and `step` the
    gradient graph. `trainable` lists every trained tensor and `frozen` the state that is fed but not trained (the
    gradient builder may have frozen parameters that do not reach the loss); `accumulation_buffers` are the
    gradient sums kept as state. `graph_for` (torch builder): inputs -> the training graph (data parallel: the
    gradient-step graph) for their shapes; `graph_key` (torch builder): the key under which a graph `graph_for`
    gave may serve other inputs (`TorchShapeGraphs.keys`)."""

    training: TrainingGraph
    eval_model: onnx.ModelProto
    trainable: list[str]
    frozen: list[str]
    accumulation_buffers: list[str]
    shapes: dict[str, tuple[int, ...]]  # of the trainable tensors
    builder: BuilderChoice
    step: GradientStepGraph | None = None
    reduced_inputs: dict[str, str] | None = None
    graph_for: Callable[[Sequence[torch.Tensor]], StepGraph] | None = None
    graph_key: Callable[[Sequence[torch.Tensor]], Hashable] | None = None
    branches_on_values: bool = False  # the torch builder's first graph took branches on values (TorchShapeGraphs)

    @property
    def step_graph(self) -> StepGraph:
        """The graph that runs a batch: the training graph, or with data parallelism the gradient-step graph."""
        return self.step or self.training


def compile_model(request: CompileRequest) -> tuple[CompiledModel, InitialState]:
    """Run the pipeline on `request` (which is not modified); returns the compiled graphs and the state they start
    from, which the session takes over (so that one copy of the state exists)."""
    request = _resolved(request)
    state = request.trainable + request.frozen
    save = _debug_paths(request.graph_save_paths)
    # 1. the forward passes (and, for the 'ort' builder under mixed precision, float16 and the scaled loss)
    forward, loss, loss_scale = _forward_and_loss(request, state, save)
    # 2. the gradient builder; it may freeze parameters that do not reach the loss
    gradient = differentiate(_gradient_request(request, forward, loss))
    request = replace(request, trainable=gradient.trainable, frozen=gradient.frozen, builder=gradient.builder)
    # 3. the gradient passes
    passes = _gradient_passes(request, loss)
    gradient_model = run_passes(gradient.model, passes, save={passes[-1].name: save.get(_GRADIENT, "")})
    # 4. the training tail (data parallel: the gradient step, and the optimizer graph beside it)
    step_graph = _tail(request, gradient_model, loss_scale, save)
    weights = {**initializer_values(request.forward, state), **gradient.added_state}
    shapes = {p: tuple(weights[p].shape) for p in request.trainable}
    training, reduced = step_graph, None
    if request.data_parallel is not None:
        training, reduced = _optimizer_graph(request, shapes, loss_scale, save)
    # 5. the eval graph (the torch route exports its eval graphs itself, when first needed)
    eval_model = onnx.ModelProto()
    if not request.lazy_eval:
        eval_model = run_passes(_eval_forward(request, state), eval_passes(state, request.outputs, request.statistics))
    # 6. the initial state: the weights, and zeros for the moments and accumulation buffers
    buffers = _accumulation_buffers(request, shapes, step_graph)
    initial = {**weights, **zero_state(training.state_shapes), **zero_state(buffers)}
    graph_for = None
    if gradient.builder.builder == "torch":
        graph_for = TorchShapeGraphs(request, step_graph, gradient.accepts, gradient.branches_on_values)
    step = step_graph if isinstance(step_graph, GradientStepGraph) else None
    assert isinstance(training, TrainingGraph)
    compiled = CompiledModel(
        training,
        eval_model,
        request.trainable,
        request.frozen,
        accumulation_buffers=list(buffers),
        shapes=shapes,
        builder=request.builder,
        step=step,
        reduced_inputs=reduced,
        graph_for=graph_for,
        graph_key=graph_for.keys if graph_for is not None else None,
        branches_on_values=gradient.branches_on_values,
    )
    return compiled, initial


def restore_compiled(
    request: CompileRequest,
    training: TrainingGraph,
    eval_model: onnx.ModelProto,
    builder: BuilderChoice,
    shapes: dict[str, tuple[int, ...]],
) -> CompiledModel:
    """The `CompiledModel` `compile_model(request)` made before, from its stored graphs (compile/cache.py):
    `request` has the trainable and frozen lists that compilation ended with; stages 1-5 do not run again."""
    request = replace(_resolved(request), builder=builder)
    buffers = _accumulation_buffers(request, shapes, training)
    graph_for = TorchShapeGraphs(request, training, None) if builder.builder == "torch" else None
    return CompiledModel(
        training,
        eval_model,
        request.trainable,
        request.frozen,
        accumulation_buffers=list(buffers),
        shapes=shapes,
        builder=builder,
        graph_for=graph_for,
    )


def _resolved(request: CompileRequest) -> CompileRequest:
    """The update path chosen (update/path.py); under mixed precision the torch builder traces in float16."""
    if request.update == "auto":
        groups = param_groups(request.optim_config, request.trainable)
        request = replace(request, update=choose_update_path(request.optim_config.name, groups))
    if request.mixed_precision and request.torch_source is not None and request.builder.builder == "torch":
        request = replace(request, torch_source=replace(request.torch_source, mixed_precision=True))
    return request


def _forward_and_loss(
    request: CompileRequest, state: list[str], save: dict[str, str]
) -> tuple[onnx.ModelProto, str, str | None]:
    """The forward model after the forward passes, the loss the gradient passes see and the loss-scale input (None
    without mixed precision). Mixed precision: the 'ort' builder differentiates the forward converted to float16
    with the scaled loss appended (`mixed_precision_passes`); the torch builder traces the module in float16 with
    the loss scale itself (`TorchSource.mixed_precision`, gradient/torch_graphs.py)."""
    passes = forward_passes(request.dropout_off, list(request.batch_norms))
    torch_traced = request.torch_source is not None and request.torch_source.mixed_precision
    if request.mixed_precision and not torch_traced:
        passes += mixed_precision_passes(state, _keep_float32(request, state), request.loss_name)
    forward = run_passes(request.forward, passes, save={passes[-1].name: save.get(_AFTER_TRANSFORMS, "")})
    if not request.mixed_precision:
        return forward, request.loss_name, None
    if torch_traced:
        return forward, *loss_scale_names_torch(request.data_inputs, request.outputs, state)
    return forward, *loss_scale_names(forward)


def _torch_loss_names(request: CompileRequest) -> tuple[str, str | None]:
    """A torch-built gradient model's loss for the gradient passes and its loss-scale input (mixed precision)."""
    if not request.mixed_precision:
        return request.loss_name, None
    return loss_scale_names_torch(request.data_inputs, request.outputs, request.trainable + request.frozen)


_AFTER_TRANSFORMS = "model_after_graph_transforms_path"
_GRADIENT = "model_with_gradient_graph_path"
_TRAINING = "model_with_training_graph_path"


def _debug_paths(graph_save_paths: dict[str, str]) -> dict[str, str]:
    """The `debug.graph_save_paths` stages that can be written; one that cannot warns (the original ignored failed
    debug saves) and training goes on."""
    return {
        key: path
        for key, given in graph_save_paths.items()
        if key != "model_with_training_graph_after_optimization_path"
        for path in [writable_debug_path(given, f"debug.graph_save_paths.{key}")]
        if path
    }


def _keep_float32(request: CompileRequest, state: list[str]) -> list[str]:
    """What mixed precision leaves float32: the data, the state, the loss and the state's new values."""
    updated = [buffer_update_name(n) for s in request.batch_norms for n in (s.mean, s.var)]
    return [*request.data_inputs, *state, request.loss_name, *updated]


def _eval_forward(request: CompileRequest, state: list[str]) -> onnx.ModelProto:
    """The forward model the eval graph starts from: under mixed precision, converted to float16 like training's."""
    if not request.mixed_precision:
        return request.forward
    return run_passes(request.forward, eval_forward_passes(state, _keep_float32(request, state)))


def _gradient_passes(request: CompileRequest, scaled_loss: str) -> list:
    """Stage 3's passes; the torch builder recomputes in its trace (gradient/torch_recompute.py), so its gradient
    model gets no recompute pass, and orttrainer's cast propagation (ONNX Runtime's builder propagates casts
    itself, gradient/ort_options.py)."""
    options = request.gradient_options
    torch_built = request.builder.builder == "torch"
    return gradient_passes(
        mixed_precision=request.mixed_precision,
        cpu=request.cpu,
        scaled_loss=scaled_loss,
        outputs=request.outputs,
        recompute=RecomputePlan() if torch_built else request.recompute,
        statistics=request.statistics,
        cast_propagation=options.cast_propagation if options is not None and torch_built else None,
        embedding_padding=None if torch_built else request.embedding_padding,
    )


def _gradient_request(request: CompileRequest, forward: onnx.ModelProto, loss: str) -> GradientRequest:
    return GradientRequest(
        forward,
        loss,
        request.outputs,
        request.trainable,
        request.frozen,
        request.builder,
        request.gradient_options,
        request.torch_source,
        request.sample_inputs,
    )


def _tail(
    request: CompileRequest, gradient_model: onnx.ModelProto, loss_scale: str | None, save: dict[str, str]
) -> StepGraph:
    """Stage 4 on a gradient model: the training graph, or (data parallel) the gradient-step graph."""
    plan = request.data_parallel
    tail = training_tail(
        data_parallel=plan is not None,
        accumulate=request.accumulation_steps > 1 and plan is not None and plan.post_accumulation,
        data_inputs=request.data_inputs,
        outputs=request.outputs,
        trainable=request.trainable,
        optimizer_name=request.optim_config.name,
        groups=param_groups(request.optim_config, request.trainable),
        accumulation_steps=request.accumulation_steps,
        clip_grad_norm=request.clip_grad_norm,
        loss_scale_input=loss_scale,
        update=request.update,
    )
    model = run_passes(gradient_model, [tail], save={tail.name: save.get(_TRAINING, "")} if plan is None else None)
    return read_contract(model)


def _optimizer_graph(
    request: CompileRequest, shapes: dict[str, tuple[int, ...]], loss_scale: str | None, save: dict[str, str]
) -> tuple[TrainingGraph, dict[str, str]]:
    """Data parallel: the optimizer graph the combined gradients feed."""
    plan, k = request.data_parallel, request.accumulation_steps
    assert plan is not None  # the caller checked
    optimizer, reduced = build_optimizer_graph(
        shapes,
        trainable=request.trainable,
        optimizer_name=request.optim_config.name,
        groups=param_groups(request.optim_config, request.trainable),
        gradient_divisor=k if plan.adasum else k * plan.world_size,
        clip_grad_norm=request.clip_grad_norm,
        loss_scale=loss_scale is not None,
        update_only=plan.owned,
        update=request.update,
    )
    record_stage(_TRAINING, optimizer.model, save=save)
    return optimizer, reduced


def _accumulation_buffers(
    request: CompileRequest, shapes: dict[str, tuple[int, ...]], step_graph: StepGraph
) -> dict[str, tuple[int, ...]]:
    """The accumulation buffers the session holds: the graph's, or with data parallelism and gradients reduced
    every micro-step, the buffers the session accumulates the reduced gradients in (runtime/data_parallel.py)."""
    if request.data_parallel is None or request.accumulation_steps == 1:
        return {name: shapes[name.removesuffix(accumulation_buffer_name(""))] for name in step_graph.accumulation}
    return {accumulation_buffer_name(p): shapes[p] for p in request.trainable}


class TorchShapeGraphs:
    """The torch builder's graph for a batch's input-shape signature: `self(inputs)` is the training graph (data
    parallel: the gradient-step graph) for `inputs` (the data, in model_desc order).

    Why: a traced graph is valid only for the inputs it accepts (gradient/torch_builder.py): with model_desc's
    string dims traced dynamic, every size the trace's guards allow; else its own shapes. `first` was compiled
    for the first batch and is returned for every input `accepts` takes (logged once per signature). Other
    inputs, with the rewrite `static_shapes` on (graph/passes.py; the first graph is then traced for the first
    batch's shapes too, gradient/differentiate.py): the signatures up to the `STATIC_SIGNATURES`th
    (gradient/torch_graphs.py, which says why) get a graph traced for their shapes; the first batch of a later
    signature whose dynamic dims are all >= 2 (the sizes PyTorch's tracer does not specialise) gets the graph
    traced with model_desc's string dims dynamic, which then serves every later batch its guards accept. With it
    off, that dynamic graph comes at the first new signature. Any other batch gets a graph traced for its shapes.
    Each runs through stages 2-4 (graph/pipeline.py) and must have `first`'s state contract (checked). The
    session caches the results per `keys` (runtime/session.GraphKeys): the signature, and for a model whose forward
    branches on tensor values
    (gradient/torch_trace.py), which of the graphs traced for such branches accept the batch. Those graphs are
    traced for the values of a batch, and one of them serves a later batch of their shapes only when its values
    branch the same way; a batch no graph accepts gets one traced for it.

    `branches_on_values`: the first graph's forward branched on values (`accepts` checks them)."""

    def __init__(
        self, request: CompileRequest, first: StepGraph, accepts: Accepts | None, branches_on_values: bool = False
    ) -> None:
        if request.torch_source is None or request.sample_inputs is None:
            raise ValueError("per-shape graphs need the torch builder's module and first batch")
        self.first = first
        self._signature = shape_signature(request.sample_inputs)
        self._accepts = accepts
        self._source = request.torch_source
        self._dynamic: tuple[StepGraph, Accepts] | None = None  # the dynamic-dims graph, once traced
        self._dynamic_tried = not any(self._source.dynamic_dims)  # nothing to trace dynamic
        self._static_signatures = 1  # traced for their shapes: the first (`static_shapes`), then those below
        self._cache = request.graph_cache
        self._loaded: dict[str, StepGraph] = {}  # graphs loaded from the cache, by content: one session each
        # the graphs traced for branches on values, each with the rule saying which inputs it serves
        self._on_values: list[tuple[StepGraph, Accepts]] = [(first, accepts)] if branches_on_values and accepts else []
        self.keys = GraphKeys()
        self.keys.on_values.extend(accepts for _, accepts in self._on_values)
        # keeps no batch and no forward model alive
        self._request = replace(request, forward=onnx.ModelProto(), sample_inputs=None)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> StepGraph:
        shapes = [list(t.shape) for t in inputs]
        if shape_signature(inputs) == self._signature and not self._on_values:
            return self.first
        for graph, serves in self._on_values:
            if serves(inputs):
                return graph
        slot = self._cache.slot(inputs) if self._cache is not None and not self._on_values else None
        for graph, accepts in [(self.first, self._accepts), *([self._dynamic] if self._dynamic else [])]:
            if accepts is not None and accepts(inputs):
                _logger.info("input shapes %s: an earlier training graph serves them (dynamic dims)", shapes)
                if slot is not None:
                    slot.store(graph.model)
                return graph
        stored = slot.load() if slot is not None else None
        if stored is not None:
            _logger.info("input shapes %s: the training graph comes from the compile cache", shapes)
            self._static_signatures += 1  # served for its own signature only (build/cached.py)
            return self._from_cache(stored)
        static_first = rewrite_enabled("static_shapes") and self._static_signatures < STATIC_SIGNATURES
        dynamic = (
            not static_first
            and not self._dynamic_tried
            and all(t.shape[d] >= 2 for t, dims in zip(inputs, self._source.dynamic_dims, strict=False) for d in dims)
        )
        request = self._request
        new = "a batch whose values branch another way, of shapes" if self._on_values else "the new input shapes"
        _logger.info(
            "tracing and compiling a training graph for %s %s (torch gradient builder%s)",
            new,
            shapes,
            ": with model_desc's string dims dynamic, for the shapes to come" if dynamic else "",
        )
        with TRACING:
            traced = torch_gradient_model(
                self._source,
                inputs,
                request.outputs,
                request.trainable,
                request.trainable + request.frozen,
                dynamic=dynamic,
            )
        if traced.added_state:  # the first graph made every buffer the forward updates state
            raise RuntimeError(f"the graph for new input shapes updates buffers {sorted(traced.added_state)} too")
        model, accepts = traced.model, traced.accepts
        loss, scale = _torch_loss_names(request)
        graph = _tail(request, run_passes(model, _gradient_passes(request, loss)), scale, {})
        check_same_state_contract(self.first, graph)
        if traced.branches_on_values:
            self._on_values.append((graph, accepts))
            self.keys.on_values.append(accepts)
            slot = None  # kept in this process only: the compile cache keys graphs by shapes
        if dynamic:
            self._dynamic_tried = True
            self._dynamic = (graph, accepts)
        else:
            self._static_signatures += 1
        if slot is not None:
            slot.store(graph.model)
        return graph

    def _from_cache(self, model: onnx.ModelProto) -> StepGraph:
        """A cached graph, the same object for the same content (several signatures served by one dynamic-dims
        graph share its session); it must have `first`'s state contract (checked)."""
        content = hashlib.sha256(model.SerializeToString()).hexdigest()
        if not self._loaded:
            self._loaded[hashlib.sha256(self.first.model.SerializeToString()).hexdigest()] = self.first
        if content not in self._loaded:
            graph = read_contract(model)
            check_same_state_contract(self.first, graph)
            self._loaded[content] = graph
        return self._loaded[content]


def initializer_values(model: onnx.ModelProto, names: list[str]) -> dict[str, np.ndarray]:
    """The values of the initializers named in `names` (others are ignored)."""
    wanted = set(names)
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in wanted}


def output_elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """ONNX element type of each graph output (mixed precision: which outputs are float16)."""
    return {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
