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

from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from .conditions import not_among, require
from .editor import GraphEditor, copy_model
from .training import (
    ParamGroup,
    TrainingGraph,
    _input_shapes,
    accumulation_buffer_name,
    build_training_graph,
    gradient_model_problem,
    groups_problem,
    optimizer_problem,
)


@dataclass
class GradientStepGraph:
    """The forward and backward pass of one rank; `gradients` maps each trainable tensor to its output."""

    model: onnx.ModelProto
    data_inputs: list[str]
    outputs: list[str]
    gradients: dict[str, str]
    accumulation: dict[str, str] = field(default_factory=dict)  # buffer input -> running-sum output
    state_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    loss_scale_input: str | None = None


@dataclass
class DataParallelGraphs:
    step: GradientStepGraph
    optimizer: TrainingGraph
    reduced_inputs: dict[str, str]  # trainable tensor -> optimizer graph input for its combined gradient


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
    gradients = {p: f"{p}_grad" for p in trainable}
    result = GradientStepGraph(model, list(data_inputs), list(outputs), gradients, loss_scale_input=loss_scale_input)
    if not accumulate:
        return result
    shapes = _input_shapes(model, trainable)
    ed = GraphEditor(model.graph, "orttrainer/step")
    kept = [o for o in model.graph.output if o.name not in set(gradients.values())]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    for p, grad in list(gradients.items()):
        buffer = ed.add_input(accumulation_buffer_name(p), TensorProto.FLOAT, list(shapes[p]))
        gradients[p] = ed.op("Add", [buffer, grad], f"{buffer}.new")
        ed.add_output(gradients[p], TensorProto.FLOAT, list(shapes[p]))
        result.accumulation[buffer] = gradients[p]
        result.state_shapes[buffer] = shapes[p]
    return result


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
    reduced = {p: f"{p}_grad__reduced" for p in trainable}
    inputs = [helper.make_tensor_value_info(p, TensorProto.FLOAT, list(shapes[p])) for p in trainable]
    inputs += [helper.make_tensor_value_info(reduced[p], TensorProto.FLOAT, list(shapes[p])) for p in trainable]
    nodes = [helper.make_node("Identity", [reduced[p]], [f"{p}_grad"], name=f"{p}_grad_in") for p in trainable]
    loss_scale_input = "loss_scale" if loss_scale else None
    inputs += [helper.make_tensor_value_info("loss_scale", TensorProto.FLOAT, [])] if loss_scale else []
    outputs = [helper.make_tensor_value_info(f"{p}_grad", TensorProto.FLOAT, list(shapes[p])) for p in trainable]
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
