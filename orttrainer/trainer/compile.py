"""The compile pipeline: forward ONNX model -> training graph, eval graph and initial state.

Order (DESIGN.md § Data flow): fix-ups the gradient builder needs -> gradient graph (the `ort` builder on the
forward model, or the `torch` builder on the PyTorch module, see `builders.py`) -> graph passes on the gradient model
-> accumulation, clipping and optimizer update (with data parallelism: the gradient-step and optimizer graphs).
Everything after the gradient graph is the same for both builders and, with the torch builder, for every input-shape
signature (`shape_dependent_graph`). The debug option `graph_save_paths` writes the intermediate stages (with the
torch builder: of the first signature's graphs).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from .builders import BuilderChoice, TorchGraphs, TorchSource, torch_gradient_model
from .graph import fixups, mixed_precision
from .graph.data_parallel import GradientStepGraph, build_gradient_step_graph, build_optimizer_graph
from .graph.editor import FLOAT_TYPES
from .graph.gradient import GradientBuildError, build_ort_gradient_graph, move_initializers_to_inputs
from .graph.gradient_options import GradientOptions
from .graph.recompute import RecomputePlan, apply_plan
from .graph.scatter_grad import gather_grad_to_scatter_add
from .graph.training import ParamGroup, TrainingGraph, accumulation_buffer_name, build_training_graph, zero_state


@dataclass
class CompileRequest:
    """What the trainer knows when it compiles: names from model_desc, the parameter split and the options."""

    forward: onnx.ModelProto  # after post-processing
    loss_name: str
    data_inputs: list[str]
    outputs: list[str]
    trainable: list[str]
    frozen: list[str]
    optim_config: object
    accumulation_steps: int
    clip_grad_norm: bool
    dropout_off: bool  # the torch model was in eval mode: train without dropout, BatchNorm on running statistics
    graph_save_paths: dict[str, str]
    mixed_precision: bool = False
    cpu: bool = True  # CPU kernels need float32 fall-backs under mixed precision
    data_parallel: DataParallelPlan | None = None
    builder: BuilderChoice = BuilderChoice("ort", "")  # see builders.choose_builder
    torch_source: TorchSource | None = None  # what the torch builder traces (None: an ONNX model)
    sample_inputs: list[torch.Tensor] | None = None  # the first batch: the torch builder's first signature
    recompute: RecomputePlan = RecomputePlan()  # the 'ort' builder only (builders.ort_only_options)
    gradient_options: GradientOptions | None = None  # cast propagation, memory-efficient gradients ('ort' only)


@dataclass(frozen=True)
class DataParallelPlan:
    """How this rank's gradients are combined: `world_size` ranks, reduced after accumulation or per micro-step,
    summed or combined with Adasum, and (ZeRO stage 1) which tensors this rank updates."""

    world_size: int
    post_accumulation: bool
    adasum: bool
    owned: list[str] | None  # None: every rank updates every tensor


@dataclass
class CompiledModel:
    """`training` is the whole step in one process; with data parallelism it is the optimizer graph and `step` the
    gradient graph. `trainable` lists every trained tensor, `accumulation_buffers` the gradient sums kept as state."""

    training: TrainingGraph
    eval_model: onnx.ModelProto
    initial_state: dict[str, np.ndarray]
    trainable: list[str]
    accumulation_buffers: list[str]
    shapes: dict[str, tuple[int, ...]]  # of the trainable tensors
    step: GradientStepGraph | None = None
    reduced_inputs: dict[str, str] | None = None
    builder: BuilderChoice = BuilderChoice("ort", "")  # the builder that made the gradient graph, and why
    # torch builder: inputs -> the training graph (data parallel: the gradient-step graph) for their shapes
    graph_for: Callable[[list[torch.Tensor]], TrainingGraph | GradientStepGraph] | None = None


def compile_model(request: CompileRequest) -> CompiledModel:
    forward = fixups.name_optional_outputs(request.forward)
    # eval-mode model: no dropout; otherwise a Dropout without training_mode is the identity it computes
    forward = (fixups.dropout_to_identity if request.dropout_off else fixups.inference_dropout_to_identity)(forward)
    if request.dropout_off:  # an eval-mode module: PyTorch trains its BatchNorm on the running statistics
        forward = fixups.batchnorm_to_inference(forward)
    forward = fixups.inference_batchnorm_to_affine(forward)  # ORT's gradient of inference BatchNorm is wrong
    state = request.trainable + request.frozen
    loss, loss_scale = request.loss_name, None
    eval_forward = request.forward
    if request.mixed_precision:  # the 'ort' builder only (builders.choose_builder)
        forward = mixed_precision.to_float16(
            move_initializers_to_inputs(forward, state), keep_float32=[*request.data_inputs, *state, request.loss_name]
        )
        eval_forward = mixed_precision.to_float16(
            move_initializers_to_inputs(request.forward, state),
            keep_float32=[*request.data_inputs, *state, request.loss_name],
        )
        forward, loss, loss_scale = mixed_precision.append_loss_scale(forward, request.loss_name)
    _save(forward, request.graph_save_paths.get("model_after_graph_transforms_path"))
    raw_gradient_model, builder = _gradient_graph(forward, request, loss)
    gradient_model = gradient_model_passes(raw_gradient_model, request, loss)
    if request.recompute:  # the 'ort' builder only: builders.ort_only_options keeps the torch builder away
        gradient_model, notes = apply_plan(gradient_model, request.outputs, request.recompute)
        for note in notes:
            warnings.warn(f"options {note}", stacklevel=2)
    _save(gradient_model, request.graph_save_paths.get("model_with_gradient_graph_path"))
    weights = initializer_values(request.forward, state)
    eval_model = build_eval_model(eval_forward, state, request.outputs)
    if request.data_parallel is not None:
        compiled = _compile_data_parallel(request, gradient_model, loss_scale, weights, eval_model)
    else:
        training = _training_graph(gradient_model, request, loss_scale)
        _save(training.model, request.graph_save_paths.get("model_with_training_graph_path"))
        compiled = CompiledModel(
            training,
            eval_model,
            {**weights, **zero_state(training.state_shapes)},
            list(request.trainable),
            list(training.accumulation),
            {p: tuple(weights[p].shape) for p in request.trainable},
        )
    compiled.builder = builder
    if builder.builder == "torch":
        tail = replace(request, forward=onnx.ModelProto(), sample_inputs=None)  # keeps no batch, no forward model
        compiled.graph_for = TorchGraphs(
            request.torch_source,
            compiled.step or compiled.training,
            request.sample_inputs,
            lambda model: shape_dependent_graph(model, tail),
            request.trainable,
            state,
        )
    return compiled


def gradient_model_passes(model: onnx.ModelProto, request: CompileRequest, scaled_loss: str) -> onnx.ModelProto:
    """Graph-level passes on the gradient model (forward outputs + `<p>_grad`), the same for both builders and every
    input-shape signature: under mixed precision the scaled loss stops being an output and (CPU) float32-only
    kernels get casts; embedding gradients become scatter-adds."""
    if request.mixed_precision:
        model = _without_outputs(model, {scaled_loss})
        if request.cpu:
            model = mixed_precision.cast_fp32_only_kernels(model)
    return gather_grad_to_scatter_add(model)


def shape_dependent_graph(
    raw_gradient_model: onnx.ModelProto, request: CompileRequest
) -> TrainingGraph | GradientStepGraph:
    """The torch builder's graph for one more input-shape signature, from its gradient model: the training graph,
    or with data parallelism the gradient-step graph (the optimizer graph does not depend on shapes)."""
    gradient_model = gradient_model_passes(raw_gradient_model, request, request.loss_name)
    if request.data_parallel is not None:
        return _gradient_step_graph(gradient_model, request, None)
    return _training_graph(gradient_model, request, None)


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
    gradient_model: onnx.ModelProto, request: CompileRequest, loss_scale: str | None
) -> GradientStepGraph:
    plan, k = request.data_parallel, request.accumulation_steps
    return build_gradient_step_graph(
        gradient_model,
        data_inputs=request.data_inputs,
        outputs=request.outputs,
        trainable=request.trainable,
        accumulate=k > 1 and plan.post_accumulation,
        loss_scale_input=loss_scale,
    )


def _compile_data_parallel(
    request: CompileRequest,
    gradient_model: onnx.ModelProto,
    loss_scale: str | None,
    weights: dict[str, np.ndarray],
    eval_model: onnx.ModelProto,
) -> CompiledModel:
    plan, k = request.data_parallel, request.accumulation_steps
    step = _gradient_step_graph(gradient_model, request, loss_scale)
    shapes = {p: tuple(weights[p].shape) for p in request.trainable}
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
    return CompiledModel(optimizer, eval_model, initial, list(request.trainable), list(buffers), shapes, step, reduced)


def _gradient_graph(
    forward: onnx.ModelProto, request: CompileRequest, loss: str
) -> tuple[onnx.ModelProto, BuilderChoice]:
    """The gradient model (of `loss`, for the 'ort' builder) from the requested builder. 'auto' tries 'ort' and, when
    ONNX Runtime has no gradient for an op, falls back to 'torch' (with the parameter lists as they were before the
    'ort' attempt)."""
    choice = request.builder
    if choice.builder == "torch":
        return _freezing_unreachable(request, lambda: _torch_gradient_graph(request)), choice
    before = (list(request.trainable), list(request.frozen))
    try:
        model = _freezing_unreachable(
            request,
            lambda: build_ort_gradient_graph(
                forward, loss, request.trainable, request.trainable + request.frozen, request.gradient_options
            ),
        )
    except GradientBuildError as err:
        if choice.builder != "auto" or err.op_type is None or request.torch_source is None:
            raise
        request.trainable, request.frozen = before
        logging.getLogger(__name__).info(
            "ONNX Runtime has no gradient for op '%s'; building the gradient graph with the torch builder", err.op_type
        )
        model = _freezing_unreachable(request, lambda: _torch_gradient_graph(request))
        return model, BuilderChoice(
            "torch", f"auto: ONNX Runtime's gradient builder cannot differentiate op '{err.op_type}'"
        )
    if choice.builder == "auto":
        choice = BuilderChoice(
            "ort", "auto: no custom torch.autograd.Function, and ONNX Runtime differentiates every op"
        )
    return model, choice


def _torch_gradient_graph(request: CompileRequest) -> onnx.ModelProto:
    return torch_gradient_model(
        request.torch_source,
        request.sample_inputs,
        request.outputs,
        request.trainable,
        request.trainable + request.frozen,
    )


def _freezing_unreachable(request: CompileRequest, build: Callable[[], onnx.ModelProto]) -> onnx.ModelProto:
    """`build()`; parameters without a differentiable path to the loss are frozen, with a warning, and `build()`
    retried — PyTorch leaves their `.grad` None and its optimizers skip them. The request's lists are updated."""
    while True:
        try:
            return build()
        except GradientBuildError as err:
            if not err.unreachable or not set(err.unreachable) <= set(request.trainable):
                raise
            warnings.warn(
                f"parameters {err.unreachable} do not influence the loss; they are not trained "
                "(as PyTorch leaves their gradient None)",
                stacklevel=2,
            )
            request.trainable = [p for p in request.trainable if p not in err.unreachable]
            request.frozen = request.frozen + err.unreachable


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
    kept = [o for o in model.graph.output if o.name in outputs]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    return model


def param_groups(optim_config, trainable: list[str]) -> list[ParamGroup]:
    """Group trainable tensors by their resolved hyper-parameters (legacy per-weight attribute rules)."""
    groups: dict[tuple, ParamGroup] = {}
    for name in trainable:
        floats, ints = optim_config.hyper_parameters(name)
        hyper = {**floats, **ints}
        key = tuple(sorted(hyper.items()))
        groups.setdefault(key, ParamGroup(hyper, []))
        groups[key].params.append(name)
    return list(groups.values())


def split_parameters(
    model: onnx.ModelProto, frozen_weights: list[str], torch_params: list[str] | None, torch_state: list[str] | None
) -> tuple[list[str], list[str]]:
    """(trainable, frozen) initializer names.

    PyTorch model: its `requires_grad` parameters minus `utils.frozen_weights` are trained; buffers, other
    parameters and the listed frozen weights are frozen state. ONNX model: every floating-point initializer not in
    `frozen_weights` is trained; other initializers stay constants of the graph.
    """
    initializers = {i.name: i for i in model.graph.initializer}
    unknown = [name for name in frozen_weights if name not in initializers]
    if unknown:
        raise RuntimeError(f"{unknown} params from 'frozen_weights' not found in the ONNX model.")
    frozen_set = set(frozen_weights)
    if torch_params is not None:
        trainable = [n for n in torch_params if n not in frozen_set]
        frozen = [n for n in (torch_state or []) if n in initializers] + [n for n in torch_params if n in frozen_set]
        return trainable, frozen
    trainable = [n for n, i in initializers.items() if n not in frozen_set and i.data_type in FLOAT_TYPES]
    return trainable, [n for n in frozen_weights]


def initializer_values(model: onnx.ModelProto, names: list[str]) -> dict[str, np.ndarray]:
    wanted = set(names)
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in wanted}


def _save(model: onnx.ModelProto, path: str | None) -> None:
    if path:
        onnx.save(model, path)
