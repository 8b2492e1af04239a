"""The compile pipeline: forward ONNX model -> training graph, eval graph and initial state.

Order (DESIGN.md § Data flow): fix-ups the gradient builder needs -> gradient graph -> accumulation, clipping and
optimizer update. The debug option `graph_save_paths` writes the intermediate stages.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from .graph import fixups, mixed_precision
from .graph.editor import FLOAT_TYPES
from .graph.gradient import GradientBuildError, build_ort_gradient_graph, move_initializers_to_inputs
from .graph.gradient_options import GradientOptions
from .graph.recompute import RecomputePlan, apply_plan
from .graph.scatter_grad import gather_grad_to_scatter_add
from .graph.data_parallel import GradientStepGraph, build_gradient_step_graph, build_optimizer_graph
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
    dropout_off: bool  # the torch model was in eval mode: train without dropout
    graph_save_paths: dict[str, str]
    mixed_precision: bool = False
    cpu: bool = True  # CPU kernels need float32 fall-backs under mixed precision
    data_parallel: DataParallelPlan | None = None
    recompute: RecomputePlan = RecomputePlan()
    gradient_options: GradientOptions | None = None  # cast propagation, memory-efficient gradients


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


def compile_model(request: CompileRequest) -> CompiledModel:
    forward = fixups.name_optional_outputs(request.forward)
    # eval-mode model: no dropout; otherwise a Dropout without training_mode is the identity it computes
    forward = (fixups.dropout_to_identity if request.dropout_off else fixups.inference_dropout_to_identity)(forward)
    state = request.trainable + request.frozen
    loss, loss_scale = request.loss_name, None
    eval_forward = request.forward
    if request.mixed_precision:
        forward = mixed_precision.to_float16(move_initializers_to_inputs(forward, state),
                                             keep_float32=[*request.data_inputs, *state, request.loss_name])
        eval_forward = mixed_precision.to_float16(move_initializers_to_inputs(request.forward, state),
                                                  keep_float32=[*request.data_inputs, *state, request.loss_name])
        forward, loss, loss_scale = mixed_precision.append_loss_scale(forward, request.loss_name)
    _save(forward, request.graph_save_paths.get("model_after_graph_transforms_path"))
    gradient_model = _gradient_graph(forward, request, loss)
    if request.mixed_precision:
        gradient_model = _without_outputs(gradient_model, {loss})
        if request.cpu:
            gradient_model = mixed_precision.cast_fp32_only_kernels(gradient_model)
    gradient_model = gather_grad_to_scatter_add(gradient_model)
    if request.recompute:
        gradient_model, notes = apply_plan(gradient_model, request.outputs, request.recompute)
        for note in notes:
            warnings.warn(f"options {note}")
    _save(gradient_model, request.graph_save_paths.get("model_with_gradient_graph_path"))
    weights = initializer_values(request.forward, state)
    eval_model = build_eval_model(eval_forward, state, request.outputs)
    if request.data_parallel is not None:
        return _compile_data_parallel(request, gradient_model, loss_scale, weights, eval_model)
    training = build_training_graph(
        gradient_model, data_inputs=request.data_inputs, outputs=request.outputs, trainable=request.trainable,
        optimizer_name=request.optim_config.name, groups=param_groups(request.optim_config, request.trainable),
        accumulation_steps=request.accumulation_steps, clip_grad_norm=request.clip_grad_norm,
        loss_scale_input=loss_scale)
    _save(training.model, request.graph_save_paths.get("model_with_training_graph_path"))
    return CompiledModel(training, eval_model, {**weights, **zero_state(training.state_shapes)},
                         list(request.trainable), list(training.accumulation),
                         {p: tuple(weights[p].shape) for p in request.trainable})


def _compile_data_parallel(request: CompileRequest, gradient_model: onnx.ModelProto, loss_scale: str | None,
                           weights: dict[str, np.ndarray], eval_model: onnx.ModelProto) -> CompiledModel:
    plan, k = request.data_parallel, request.accumulation_steps
    step = build_gradient_step_graph(gradient_model, data_inputs=request.data_inputs, outputs=request.outputs,
                                     trainable=request.trainable, accumulate=k > 1 and plan.post_accumulation,
                                     loss_scale_input=loss_scale)
    shapes = {p: tuple(weights[p].shape) for p in request.trainable}
    optimizer, reduced = build_optimizer_graph(
        shapes, trainable=request.trainable, optimizer_name=request.optim_config.name,
        groups=param_groups(request.optim_config, request.trainable),
        gradient_divisor=k if plan.adasum else k * plan.world_size, clip_grad_norm=request.clip_grad_norm,
        loss_scale=loss_scale is not None, update_only=plan.owned)
    _save(optimizer.model, request.graph_save_paths.get("model_with_training_graph_path"))
    buffers = {accumulation_buffer_name(p): shapes[p] for p in request.trainable} if k > 1 else {}
    initial = {**weights, **zero_state(optimizer.state_shapes), **zero_state(buffers)}
    return CompiledModel(optimizer, eval_model, initial, list(request.trainable), list(buffers), shapes, step, reduced)


def _gradient_graph(forward: onnx.ModelProto, request: CompileRequest, loss: str) -> onnx.ModelProto:
    """The ORT gradient graph. Parameters without a differentiable path to the loss are frozen, with a warning —
    PyTorch leaves their `.grad` None and its optimizers skip them; the request's lists are updated to match."""
    while True:
        try:
            return build_ort_gradient_graph(forward, loss, request.trainable, request.trainable + request.frozen,
                                            request.gradient_options)
        except GradientBuildError as err:
            if not err.unreachable or not set(err.unreachable) <= set(request.trainable):
                raise
            warnings.warn(f"parameters {err.unreachable} do not influence the loss; they are not trained "
                          "(as PyTorch leaves their gradient None)")
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


def split_parameters(model: onnx.ModelProto, frozen_weights: list[str], torch_params: list[str] | None,
                     torch_state: list[str] | None) -> tuple[list[str], list[str]]:
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
