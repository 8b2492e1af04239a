"""Data parallelism splits the training graph in two: gradients are combined across ranks between them.

* The gradient-step graph: the gradient model with, when gradients are reduced once per optimizer step
  (`allreduce_post_accumulation=True`), the running accumulation sum `G = buffer + g` in the graph. Its outputs are
  the forward outputs and one gradient per trainable tensor: `G` (accumulating) or the micro-batch gradient `g`.
* The optimizer graph: the same accumulation-free update the single-process training graph appends, built by
  `training.build_training_graph` on a graph whose gradients are inputs (`<p>_grad__reduced`). It divides by the
  number of micro-batch gradients summed (k per rank times the ranks), clips with the norm over all gradients,
  and — under ZeRO stage 1 — updates only this rank's parameters.

Both check their precondition first (`PassPreconditionError`) and leave their arguments untouched.
"""

from __future__ import annotations

import functools

import onnx
from onnx import TensorProto, helper

from ..compile.contract import (
    LOSS_SCALE_INPUT,
    GradientStepGraph,
    ParamGroup,
    TrainingGraph,
    accumulation_buffer_name,
    buffer_updates_of,
    gradient_name,
    reduced_gradient_name,
    write_contract,
)
from .editor import GraphEditor, copy_model
from .passes import FunctionPass, not_among, require
from .training import (
    _input_shapes,
    build_training_graph,
    gradient_model_problem,
    groups_problem,
    optimizer_problem,
)


def build_gradient_step_graph(
    gradient_model: onnx.ModelProto,
    *,
    data_inputs: list[str],
    outputs: list[str],
    trainable: list[str],
    accumulate: bool,
    loss_scale_input: str | None = None,
) -> GradientStepGraph:
    """Rule: the gradient model's `<p>_grad` outputs become the step's gradient outputs; with `accumulate`, each is
    replaced by `Add(<p>_grad_accumulation_buffer, <p>_grad)` and the buffer becomes a graph input.

    Precondition: each trainable tensor is a graph input with a static shape and `<p>_grad` a graph output; the
    loss-scale input, if any, is a graph input."""
    require("build_gradient_step_graph", gradient_model_problem(gradient_model, trainable, loss_scale_input))
    model = copy_model(gradient_model)
    gradients = {p: gradient_name(p) for p in trainable}
    accumulation: dict[str, str] = {}
    state_shapes: dict[str, tuple[int, ...]] = {}
    if accumulate:
        shapes = _input_shapes(model, trainable)
        ed = GraphEditor(model.graph, "orttrainer/step")
        kept = [o for o in model.graph.output if o.name not in set(gradients.values())]
        del model.graph.output[:]
        model.graph.output.extend(kept)
        for p, grad in list(gradients.items()):
            buffer = ed.add_input(accumulation_buffer_name(p), TensorProto.FLOAT, list(shapes[p]))
            gradients[p] = ed.op("Add", [buffer, grad], f"{buffer}.new")
            ed.add_output(gradients[p], TensorProto.FLOAT, list(shapes[p]))
            accumulation[buffer] = gradients[p]
            state_shapes[buffer] = shapes[p]
    return GradientStepGraph(
        model,
        list(data_inputs),
        list(outputs),
        gradients,
        accumulation,
        state_shapes,
        loss_scale_input,
        buffer_updates_of(gradient_model),
    )


def gradient_step_pass(
    *, data_inputs: list[str], outputs: list[str], trainable: list[str], accumulate: bool, loss_scale_input: str | None
) -> FunctionPass:
    """`build_gradient_step_graph` as a pass, with its contract written into the model's metadata
    (compile.contract.read_contract reads it back)."""

    def rule(model: onnx.ModelProto) -> onnx.ModelProto:
        step = build_gradient_step_graph(
            model,
            data_inputs=data_inputs,
            outputs=outputs,
            trainable=trainable,
            accumulate=accumulate,
            loss_scale_input=loss_scale_input,
        )
        write_contract(step.model, step)
        return step.model

    functools.update_wrapper(rule, build_gradient_step_graph)
    return FunctionPass("build_gradient_step_graph", rule)


def build_optimizer_graph(
    shapes: dict[str, tuple[int, ...]],
    *,
    trainable: list[str],
    optimizer_name: str,
    groups: list[ParamGroup],
    gradient_divisor: int,
    clip_grad_norm: bool,
    loss_scale: bool,
    update_only: list[str] | None,
    update: str = "graph",
) -> tuple[TrainingGraph, dict[str, str]]:
    """The optimizer update alone: inputs are the weights, the combined gradients `<p>_grad__reduced`, the optimizer
    state, the learning rate, the update number and (mixed precision) the loss scale (`update`: as
    `build_training_graph`'s; with "torch" the graph holds no update, its `outside_update` says what to apply).

    Precondition: the optimizer is known, `shapes` has every trainable tensor, the groups split the trainable
    tensors, `update_only` names trainable tensors and the divisor is positive."""
    require(
        "build_optimizer_graph",
        optimizer_problem(optimizer_name),
        not_among(trainable, set(shapes), "trainable tensors", "the shapes"),
        groups_problem(trainable, groups, update_only),
        None if gradient_divisor >= 1 else f"gradient_divisor ({gradient_divisor}) must be positive",
    )
    reduced = {p: reduced_gradient_name(p) for p in trainable}
    inputs = [helper.make_tensor_value_info(p, TensorProto.FLOAT, list(shapes[p])) for p in trainable]
    inputs += [helper.make_tensor_value_info(reduced[p], TensorProto.FLOAT, list(shapes[p])) for p in trainable]
    nodes = [helper.make_node("Identity", [reduced[p]], [gradient_name(p)], name=f"{p}_grad_in") for p in trainable]
    loss_scale_input = LOSS_SCALE_INPUT if loss_scale else None
    inputs += [helper.make_tensor_value_info(LOSS_SCALE_INPUT, TensorProto.FLOAT, [])] if loss_scale else []
    outputs = [helper.make_tensor_value_info(gradient_name(p), TensorProto.FLOAT, list(shapes[p])) for p in trainable]
    graph = helper.make_graph(nodes, "optimizer", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    optimizer = build_training_graph(
        model,
        data_inputs=[],
        outputs=[],
        trainable=trainable,
        optimizer_name=optimizer_name,
        groups=groups,
        accumulation_steps=1,
        clip_grad_norm=clip_grad_norm,
        loss_scale_input=loss_scale_input,
        gradient_divisor=gradient_divisor,
        update_only=update_only,
        update=update,
    )
    return optimizer, reduced
