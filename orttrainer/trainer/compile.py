"""The compile pipeline: forward ONNX model -> training graph, eval graph and initial state.

The pipeline is three lists of passes (`forward_passes`, the gradient builder, `gradient_passes`) and the training
tail (accumulation, clipping and optimizer update; with data parallelism the gradient-step and optimizer graphs),
in the order of docs/design.md § Data flow. Everything after the gradient builder is the same for both builders
and, with the torch builder, for every input-shape signature (`TorchShapeGraphs`). The debug option
`graph_save_paths` names the stage after which a model is written (with the torch builder: the first signature's).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import onnx
import torch

from ..optim.config import _OptimizerConfig
from .gradient.choice import BuilderChoice
from .gradient.differentiate import GradientRequest, differentiate
from .gradient.ort_builder import move_initializers_to_inputs
from .gradient.ort_options import GradientOptions
from .gradient.torch_graphs import TorchSource, torch_gradient_model
from .graph import fixups, mixed_precision
from .graph.data_parallel import GradientStepGraph, build_gradient_step_graph, build_optimizer_graph
from .graph.recompute import RecomputePlan, apply_plan
from .graph.scatter_grad import gather_grad_to_scatter_add
from .graph.training import TrainingGraph, accumulation_buffer_name, build_training_graph, zero_state
from .parameters import initializer_values, param_groups
from .shapes import shape_signature

_logger = logging.getLogger(__name__)

Pass = Callable[[onnx.ModelProto], onnx.ModelProto]
Stage = tuple[str, Pass]  # (name, pass); `graph_save_paths` keys name the stages after which a model is saved


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
    state = request.trainable + request.frozen
    save = request.graph_save_paths
    forward = run_stages(request.forward, forward_passes(request, state))
    loss, loss_scale = request.loss_name, None
    if request.mixed_precision:  # the 'ort' builder only (gradient/choice.choose_builder)
        forward, loss, loss_scale = mixed_precision.append_loss_scale(forward, request.loss_name)
    _save(forward, save.get("model_after_graph_transforms_path"))
    gradient = differentiate(_gradient_request(request, forward, loss))
    request = replace(request, trainable=gradient.trainable, frozen=gradient.frozen, builder=gradient.builder)
    gradient_model = run_stages(gradient.model, gradient_passes(request, loss))
    _save(gradient_model, save.get("model_with_gradient_graph_path"))
    weights = initializer_values(request.forward, state)
    eval_model = onnx.ModelProto()  # the torch route builds its eval graphs itself, when first needed
    if not request.lazy_eval:
        eval_model = build_eval_model(_eval_forward(request, state), state, request.outputs)
    if request.statistics is not None:
        eval_model = request.statistics.instrument(eval_model, "eval")
    shapes = {p: tuple(weights[p].shape) for p in request.trainable}
    if request.data_parallel is not None:
        compiled = _compile_data_parallel(request, gradient_model, loss_scale, weights, eval_model, shapes)
    else:
        training = _training_graph(gradient_model, request, loss_scale)
        _save(training.model, save.get("model_with_training_graph_path"))
        initial = {**weights, **zero_state(training.state_shapes)}
        accumulation = list(training.accumulation)
        compiled = CompiledModel(
            training, eval_model, initial, request.trainable, request.frozen, accumulation, shapes, request.builder
        )
    if gradient.builder.builder == "torch":
        compiled.graph_for = TorchShapeGraphs(request, compiled.step or compiled.training, gradient.accepts)
    return compiled


def run_stages(model: onnx.ModelProto, stages: list[Stage]) -> onnx.ModelProto:
    """Apply each pass in order."""
    for _name, apply in stages:
        model = apply(model)
    return model


def forward_passes(request: CompileRequest, state: list[str]) -> list[Stage]:
    """Fix-ups the gradient builder needs, then (mixed precision) the float16 conversion."""
    stages: list[Stage] = [("name_optional_outputs", fixups.name_optional_outputs)]
    if request.dropout_off:  # an eval-mode module: no dropout, and BatchNorm trains on the running statistics
        stages += [("dropout_to_identity", fixups.dropout_to_identity)]
        stages += [("batchnorm_to_inference", fixups.batchnorm_to_inference)]
    else:  # a Dropout without training_mode is the identity it computes
        stages += [("inference_dropout_to_identity", fixups.inference_dropout_to_identity)]
    stages += [("inference_batchnorm_to_affine", fixups.inference_batchnorm_to_affine)]  # ORT's gradient is wrong
    if request.mixed_precision:
        stages += [("to_float16", _float16(request, state))]
    return stages


def _float16(request: CompileRequest, state: list[str]) -> Pass:
    keep = [*request.data_inputs, *state, request.loss_name]
    return lambda model: mixed_precision.to_float16(move_initializers_to_inputs(model, state), keep_float32=keep)


def _eval_forward(request: CompileRequest, state: list[str]) -> onnx.ModelProto:
    return _float16(request, state)(request.forward) if request.mixed_precision else request.forward


def gradient_passes(request: CompileRequest, scaled_loss: str) -> list[Stage]:
    """Passes on the gradient model (forward outputs + `<p>_grad`), the same for both builders and every input-shape
    signature: under mixed precision the scaled loss stops being an output and (CPU) float32-only kernels get
    casts; embedding gradients become scatter-adds; recompute and statistics (the 'ort' builder only)."""
    stages: list[Stage] = []
    if request.mixed_precision:
        stages += [("drop_scaled_loss_output", lambda model: _without_outputs(model, {scaled_loss}))]
        if request.cpu:
            stages += [("cast_fp32_only_kernels", mixed_precision.cast_fp32_only_kernels)]
    stages += [("gather_grad_to_scatter_add", gather_grad_to_scatter_add)]
    if request.recompute:
        stages += [("recompute", lambda model: _recompute(model, request))]
    if request.statistics is not None:
        statistics = request.statistics
        stages += [("statistics", lambda model: statistics.instrument(model, "train"))]
    return stages


def _recompute(model: onnx.ModelProto, request: CompileRequest) -> onnx.ModelProto:
    model, notes = apply_plan(model, request.outputs, request.recompute)
    for note in notes:
        warnings.warn(f"options {note}", stacklevel=2)
    return model


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
    )
    _save(optimizer.model, request.graph_save_paths.get("model_with_training_graph_path"))
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
        model, _ = torch_gradient_model(
            self._source, inputs, request.outputs, request.trainable, request.trainable + request.frozen
        )
        model = run_stages(model, gradient_passes(request, request.loss_name))
        plan = request.data_parallel
        graph = (
            _training_graph(model, request, None) if plan is None else _gradient_step_graph(model, request, plan, None)
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


def _without_outputs(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    kept = [o for o in model.graph.output if o.name not in names]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    return model


def output_elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """ONNX element type of each graph output (mixed precision: which outputs are float16)."""
    return {o.name: o.type.tensor_type.elem_type for o in model.graph.output}


def build_eval_model(forward: onnx.ModelProto, state: list[str], outputs: list[str]) -> onnx.ModelProto:
    """The forward graph for `eval_step`: state as inputs, dropout off, BatchNorm on running statistics, only the
    model_desc outputs."""
    model = move_initializers_to_inputs(forward, state)
    model = fixups.batchnorm_to_inference(fixups.dropout_to_identity(model))
    return _without_outputs(model, {o.name for o in model.graph.output if o.name not in outputs})


def _save(model: onnx.ModelProto, path: str | None) -> None:
    if path:
        onnx.save(model, path)
