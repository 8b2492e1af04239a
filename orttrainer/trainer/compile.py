"""The compile pipeline: forward ONNX model -> training graph, eval graph and initial state.

The pipeline is three lists of passes (`forward_passes`, the gradient builder, `gradient_passes`) and the training
tail (accumulation, clipping and optimizer update; with data parallelism the gradient-step and optimizer graphs),
in the order of docs/design.md § Data flow. Everything after the gradient builder is the same for both builders
and, with the torch builder, for every input-shape signature (`TorchShapeGraphs`). The debug option
`graph_save_paths` names the stage after which a model is written (with the torch builder: the first signature's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import onnx
import torch

from ..optim.config import _OptimizerConfig
from .gradient.choice import BuilderChoice
from .gradient.differentiate import GradientRequest, differentiate
from .gradient.ort_options import GradientOptions
from .gradient.torch_graphs import TorchSource, torch_gradient_model
from .gradient.torch_graphs import loss_scale_names as loss_scale_names_torch
from .graph.data_parallel import GradientStepGraph, build_gradient_step_graph, build_optimizer_graph
from .graph.eval_model import eval_model_passes
from .graph.mixed_precision import loss_scale_names, to_float16_pass
from .graph.passes import FunctionPass, GraphPass, record_stage, run_passes
from .graph.pipeline import forward_passes, gradient_model_passes, mixed_precision_passes
from .graph.recompute import RecomputePlan, recompute_pass
from .graph.state_inputs import move_initializers_to_inputs_pass
from .graph.training import TrainingGraph, accumulation_buffer_name, build_training_graph, zero_state
from .locks import TRACING
from .ort_session import writable_debug_path
from .parameters import initializer_values, param_groups
from .shapes import shape_signature
from .update_path import choose_update_path

_logger = logging.getLogger(__name__)


class StatisticsInstrument(Protocol):
    """Appends activation-statistics outputs to a gradient model ('train') or an eval model ('eval')."""

    def instrument(self, model: onnx.ModelProto, kind: str) -> onnx.ModelProto: ...


@dataclass(frozen=True)
class DataParallelPlan:
    """How this rank's gradients are combined: `world_size` ranks, reduced after accumulation or per micro-step,
    summed or combined with Adasum, and (ZeRO stage 1) which tensors this rank updates."""

    world_size: int
    post_accumulation: bool
    adasum: bool
    owned: list[str] | None  # None: every rank updates every tensor


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
    recompute: RecomputePlan = RecomputePlan()  # the 'ort' builder only (gradient/choice.ort_only_options)
    gradient_options: GradientOptions | None = None  # cast propagation, memory-efficient gradients ('ort' only)
    statistics: StatisticsInstrument | None = None  # orttrainer.debug statistics ('ort' builder only)
    lazy_eval: bool = False  # the torch route: `forward` holds only the state, eval graphs come from torch_forward
    update: str = "auto"  # where the optimizer update runs (update_path.py); resolved by compile_model


ShapeGraph = TrainingGraph | GradientStepGraph


@dataclass
class CompiledModel:
    """`training` is the whole step in one process; with data parallelism it is the optimizer graph and `step` the
    gradient graph. `trainable` lists every trained tensor and `frozen` the state that is fed but not trained (the
    gradient builder may have frozen parameters that do not reach the loss); `accumulation_buffers` are the
    gradient sums kept as state."""

    training: TrainingGraph
    eval_model: onnx.ModelProto
    initial_state: dict[str, np.ndarray]
    trainable: list[str]
    frozen: list[str]
    accumulation_buffers: list[str]
    shapes: dict[str, tuple[int, ...]]  # of the trainable tensors
    builder: BuilderChoice
    step: GradientStepGraph | None = None
    reduced_inputs: dict[str, str] | None = None
    # torch builder: inputs -> the training graph (data parallel: the gradient-step graph) for their shapes
    graph_for: Callable[[Sequence[torch.Tensor]], ShapeGraph] | None = None


def compile_model(request: CompileRequest) -> CompiledModel:
    """Run the pipeline on `request` (which is not modified)."""
    if request.update == "auto":
        groups = param_groups(request.optim_config, request.trainable)
        request = replace(request, update=choose_update_path(request.optim_config.name, groups))
    state = request.trainable + request.frozen
    save = _debug_paths(request.graph_save_paths)
    if request.mixed_precision and request.torch_source is not None and request.builder.builder == "torch":
        request = replace(request, torch_source=replace(request.torch_source, mixed_precision=True))
    forward, loss, loss_scale = _forward_and_loss(request, state, save)
    gradient = differentiate(_gradient_request(request, forward, loss))
    request = replace(request, trainable=gradient.trainable, frozen=gradient.frozen, builder=gradient.builder)
    passes = gradient_passes(request, loss)
    gradient_model = run_passes(gradient.model, passes, save={passes[-1].name: save.get(_GRADIENT, "")})
    weights = initializer_values(request.forward, state)
    eval_model = onnx.ModelProto()  # the torch route builds its eval graphs itself, when first needed
    if not request.lazy_eval:
        eval_model = run_passes(_eval_forward(request, state), eval_passes(request, state))
    shapes = {p: tuple(weights[p].shape) for p in request.trainable}
    if request.data_parallel is not None:
        compiled = _compile_data_parallel(request, gradient_model, loss_scale, weights, eval_model, shapes, save)
    else:
        training = _training_graph(gradient_model, request, loss_scale)
        record_stage(_TRAINING, training.model, save=save)
        initial = {**weights, **zero_state(training.state_shapes)}
        accumulation = list(training.accumulation)
        compiled = CompiledModel(
            training, eval_model, initial, request.trainable, request.frozen, accumulation, shapes, request.builder
        )
    if gradient.builder.builder == "torch":
        compiled.graph_for = TorchShapeGraphs(request, compiled.step or compiled.training, gradient.accepts)
    return compiled


def _forward_and_loss(
    request: CompileRequest, state: list[str], save: dict[str, str]
) -> tuple[onnx.ModelProto, str, str | None]:
    """The forward model after `forward_passes`, the loss the gradient passes see and the loss-scale input (None
    without mixed precision). Mixed precision: the 'ort' builder differentiates the forward converted to float16
    with the scaled loss appended (`mixed_precision_passes`); the torch builder traces the module in float16 with
    the loss scale itself (`TorchSource.mixed_precision`, gradient/torch_graphs.py)."""
    passes = forward_passes(request.dropout_off)
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
    """A torch-built gradient model's loss for `gradient_passes` and its loss-scale input (mixed precision)."""
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
    return [*request.data_inputs, *state, request.loss_name]


def _eval_forward(request: CompileRequest, state: list[str]) -> onnx.ModelProto:
    """The forward model the eval graph starts from: under mixed precision, converted to float16 like training's."""
    if not request.mixed_precision:
        return request.forward
    passes = [move_initializers_to_inputs_pass(state), to_float16_pass(_keep_float32(request, state))]
    return run_passes(request.forward, passes)


def eval_passes(request: CompileRequest, state: list[str]) -> list[GraphPass]:
    """The eval graph (graph/eval_model.py), then its statistics."""
    passes = eval_model_passes(state, request.outputs)
    if request.statistics is not None:
        statistics = request.statistics
        passes.append(FunctionPass("statistics_eval", lambda model: statistics.instrument(model, "eval")))
    return passes


def gradient_passes(request: CompileRequest, scaled_loss: str) -> list[GraphPass]:
    """Passes on the gradient model (graph/pipeline.gradient_model_passes), then recompute and statistics (the
    'ort' builder only)."""
    passes = gradient_model_passes(mixed_precision=request.mixed_precision, cpu=request.cpu, scaled_loss=scaled_loss)
    if request.recompute:
        passes.append(recompute_pass(request.outputs, request.recompute))
    if request.statistics is not None:
        statistics = request.statistics
        passes.append(FunctionPass("statistics", lambda model: statistics.instrument(model, "train")))
    return passes


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


def _training_graph(gradient_model: onnx.ModelProto, request: CompileRequest, loss_scale: str | None) -> TrainingGraph:
    return build_training_graph(
        gradient_model,
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


def _gradient_step_graph(
    gradient_model: onnx.ModelProto, request: CompileRequest, plan: DataParallelPlan, loss_scale: str | None
) -> GradientStepGraph:
    accumulate = request.accumulation_steps > 1 and plan.post_accumulation
    return build_gradient_step_graph(
        gradient_model,
        data_inputs=request.data_inputs,
        outputs=request.outputs,
        trainable=request.trainable,
        accumulate=accumulate,
        loss_scale_input=loss_scale,
    )


def _compile_data_parallel(
    request: CompileRequest,
    gradient_model: onnx.ModelProto,
    loss_scale: str | None,
    weights: dict[str, np.ndarray],
    eval_model: onnx.ModelProto,
    shapes: dict[str, tuple[int, ...]],
    save: dict[str, str],
) -> CompiledModel:
    plan, k = request.data_parallel, request.accumulation_steps
    assert plan is not None  # the caller checked
    step = _gradient_step_graph(gradient_model, request, plan, loss_scale)
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
    buffers = {accumulation_buffer_name(p): shapes[p] for p in request.trainable} if k > 1 else {}
    initial = {**weights, **zero_state(optimizer.state_shapes), **zero_state(buffers)}
    return CompiledModel(
        optimizer,
        eval_model,
        initial,
        request.trainable,
        request.frozen,
        list(buffers),
        shapes,
        request.builder,
        step,
        reduced,
    )


class TorchShapeGraphs:
    """The torch builder's graph for a batch's input-shape signature: `self(inputs)` is the training graph (data
    parallel: the gradient-step graph) for `inputs` (the data, in model_desc order).

    Why: a traced graph is valid only for the inputs it accepts (gradient/torch_builder.py): with model_desc's
    string dims traced dynamic, every size the trace's guards allow; else its own shapes. `first` was compiled
    for the first batch and is returned for every input `accepts` takes (logged once per signature); other
    inputs get a graph traced for their shapes and run through `gradient_passes` and the training tail, which
    must have `first`'s state contract (checked). The session caches the results per signature."""

    def __init__(
        self, request: CompileRequest, first: ShapeGraph, accepts: Callable[[Sequence[torch.Tensor]], bool] | None
    ) -> None:
        if request.torch_source is None or request.sample_inputs is None:
            raise ValueError("per-shape graphs need the torch builder's module and first batch")
        self.first = first
        self._signature = shape_signature(request.sample_inputs)
        self._accepts = accepts
        self._source = request.torch_source
        # keeps no batch and no forward model alive
        self._request = replace(request, forward=onnx.ModelProto(), sample_inputs=None)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> ShapeGraph:
        shapes = [list(t.shape) for t in inputs]
        if shape_signature(inputs) == self._signature:
            return self.first
        if self._accepts is not None and self._accepts(inputs):
            _logger.info("input shapes %s: the first training graph serves them (dynamic dims)", shapes)
            return self.first
        request = self._request
        _logger.info(
            "tracing and compiling a training graph for the new input shapes %s (torch gradient builder: the "
            "first graph is not valid for them; one graph per such input-shape signature)",
            shapes,
        )
        with TRACING:
            model, _ = torch_gradient_model(
                self._source, inputs, request.outputs, request.trainable, request.trainable + request.frozen
            )
        loss, scale = _torch_loss_names(request)
        model = run_passes(model, gradient_passes(request, loss))
        plan = request.data_parallel
        graph = (
            _training_graph(model, request, scale)
            if plan is None
            else _gradient_step_graph(model, request, plan, scale)
        )
        check_same_state_contract(self.first, graph)
        return graph


_CONTRACT = (
    "data_inputs",
    "outputs",
    "lr_input",
    "update_count_input",
    "loss_scale_input",
    "all_finite_output",
    "state_shapes",
    "weight_updates",
    "optimizer_state",
    "accumulation",
    "gradients",
)


def check_same_state_contract(first: ShapeGraph, other: ShapeGraph) -> None:
    """Rule: graphs sharing one state (TrainingGraphs, or GradientStepGraphs) must name the same data inputs,
    outputs, step inputs, weights, optimizer moments, accumulation buffers and gradients, with the same shapes;
    raise RuntimeError naming the first difference."""
    for field in _CONTRACT:
        mine, theirs = getattr(first, field, None), getattr(other, field, None)
        if isinstance(mine, dict) and isinstance(theirs, dict) and field != "state_shapes":
            mine, theirs = list(mine.items()), list(theirs.items())
        if mine != theirs:
            raise RuntimeError(
                f"the training graph for new input shapes differs from the first one in {field}: {theirs} != {mine}"
            )


def output_elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """ONNX element type of each graph output (mixed precision: which outputs are float16)."""
    return {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
