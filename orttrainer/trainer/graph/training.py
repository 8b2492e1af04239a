"""Assemble the training graph: gradient model + accumulation + clipping + optimizer update, in one ONNX model.

Input: the gradient model (forward outputs + `<p>_grad` for each trainable parameter, all state as graph inputs; and
`<b>__updated` for each buffer `b` the forward updates, compile/contract.buffer_update_name).
Output: a `TrainingGraph` whose model has, as graph inputs, the data, every state tensor, the learning rate and the
update number; and as graph outputs, the forward outputs, the accumulated gradients (micro-steps), the updated
weights and optimizer moments (optimizer steps), and the updated buffers (every step: `buffer_updates`). The session
fetches what the step needs and runs with `only_execute_path_to_fetches`, so an accumulation step never executes
optimizer nodes.

docs/design.md § Gradient semantics: with k accumulation steps the update uses the mean of the k micro-batch gradients.
The mean, the loss-scale unscaling and the clipping coefficient are one scalar `coef` per parameter group, folded
into the optimizer's moment updates, so no pass over the gradients materialises them.

Mixed precision: with a `loss_scale_input` the gradients are of the scaled loss; `coef` divides by the scale, and
the graph also outputs `all_gradients_finite` (bool [1]): false when the sum of squares of all gradients is inf or
NaN. The session then discards that step's updated state, so a skipped step leaves everything exactly unchanged.

Where the update runs (`update`, chosen by `update/path.py`): `"graph"` appends it as plain ONNX ops (every
runtime, every provider); `"fused"` writes each Adam group in weight-decay mode 0 as ONNX Runtime's fused
`AdamOptimizer` kernel, one node per tensor (the training build; update/in_graph.append_adam_fused); `"torch"` appends
no update at all: the graph is gradient-only (forward outputs and the gradient sums `G`, `gradients`), and the
session runs the same update in place on the state buffers with torch's fused/foreach kernels
(`update/torch_fused.py`, described by `outside_update`).

As a pass (`training_tail_pass`), the tail writes the result's contract (compile/contract.py) into the model's
metadata, so the compiler reads the contract from the model like any other pass's result.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import replace
from functools import partial
from typing import Any

import onnx
from onnx import TensorProto, helper

from ..compile.contract import (
    ALL_FINITE_OUTPUT,
    LEARNING_RATE_INPUT,
    UPDATE_COUNT_INPUT,
    UPDATE_PATHS,
    OutsideUpdate,
    ParamGroup,
    TrainingGraph,
    accumulation_buffer_name,
    buffer_updates_of,
    gradient_name,
    moment_names,
    write_contract,
)
from ..update.in_graph import CLIP_EPSILON, FUSED_OPTIMIZERS, OPTIMIZERS, OptimizerAppender, StepScalars, TensorUpdate
from .editor import GraphEditor, copy_model
from .passes import (
    FunctionPass,
    Problem,
    dynamic_shape,
    first_problem,
    graph_input_names,
    graph_output_names,
    not_among,
    require,
)

_RUNTIME_DOMAIN = "com.microsoft"


def build_training_graph(
    gradient_model: onnx.ModelProto,
    *,
    data_inputs: list[str],
    outputs: list[str],
    trainable: list[str],
    optimizer_name: str,
    groups: list[ParamGroup],
    accumulation_steps: int,
    clip_grad_norm: bool,
    loss_scale_input: str | None = None,
    gradient_divisor: int | None = None,
    update_only: list[str] | None = None,
    update: str = "graph",
) -> TrainingGraph:
    """Append accumulation, clipping and the optimizer update to `gradient_model` (which is not modified).

    `gradient_divisor` (default: `accumulation_steps`) is the number of micro-batch gradients summed into `G` — data
    parallelism sums over ranks too. `update_only` (ZeRO) restricts the update to those tensors; clipping still
    uses the norm over every trainable gradient. `update` says where the update runs (module docstring).

    Precondition (`PassPreconditionError`): the optimizer and the update path are known; each trainable tensor is a
    graph input with a static shape and its gradient `<p>_grad` a graph output; the loss-scale input, if any, is a
    graph input; the groups split the trainable tensors (each in exactly one group); `update_only` names trainable
    tensors; the accumulation steps and the divisor are positive.
    """
    require(
        "build_training_graph",
        optimizer_problem(optimizer_name),
        None if update in UPDATE_PATHS else f"unknown update path {update!r}; expected one of {list(UPDATE_PATHS)}",
        gradient_model_problem(gradient_model, trainable, loss_scale_input),
        groups_problem(trainable, groups, update_only),
        _counts_problem(accumulation_steps, gradient_divisor),
    )
    model = copy_model(gradient_model)
    shapes = _input_shapes(model, trainable)
    _drop_gradient_outputs(model, trainable)
    ed = GraphEditor(model.graph, "orttrainer/train")
    grads = {p: gradient_name(p) for p in trainable}
    accumulation: dict[str, str] = {}
    if accumulation_steps > 1:
        grads, accumulation = _append_accumulation(ed, grads, shapes)
    clip = clip_grad_norm and optimizer_name != "SGDOptimizer"
    updated = [p for p in trainable if update_only is None or p in update_only]
    plan = OutsideUpdate(
        optimizer_name, groups, gradient_divisor or accumulation_steps, clip, bool(loss_scale_input), updated
    )
    tail = _gradient_only_result if update == "torch" else partial(_graph_update_result, fused=update == "fused")
    graph = tail(ed, model, (data_inputs, outputs), grads, accumulation, shapes, plan, loss_scale_input)
    return replace(graph, buffer_updates=buffer_updates_of(gradient_model))


def training_tail_pass(**arguments: Any) -> FunctionPass:
    """The training tail as a pass: `build_training_graph(model, **arguments).model`, with its contract written into
    the model's metadata (`compile.contract.read_contract` reads it back)."""

    def rule(model: onnx.ModelProto) -> onnx.ModelProto:
        graph = build_training_graph(model, **arguments)
        write_contract(graph.model, graph)
        return graph.model

    functools.update_wrapper(rule, build_training_graph)
    return FunctionPass("build_training_graph", rule)


def _graph_update_result(
    ed: GraphEditor,
    model: onnx.ModelProto,
    io: tuple[list[str], list[str]],
    grads: dict[str, str],
    accumulation: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    plan: OutsideUpdate,
    loss_scale_input: str | None,
    fused: bool = False,
) -> TrainingGraph:
    """`update="graph"` or `"fused"`: the update `plan` describes, appended to the graph; `state_shapes` lists the
    accumulation buffers, then the moments."""
    coef = _gradient_coefficient(ed, plan.gradient_divisor, loss_scale_input)
    append = (FUSED_OPTIMIZERS if fused else OPTIMIZERS)[plan.optimizer_name]
    updates, total = _append_update(
        ed, append, plan.groups, grads, coef, plan.clip, plan.check_finite, set(plan.updated)
    )
    if any(n.domain == _RUNTIME_DOMAIN for n in model.graph.node) and not _imports(model, _RUNTIME_DOMAIN):
        model.opset_import.append(helper.make_opsetid(_RUNTIME_DOMAIN, 1))  # update="fused" on a torch-built graph
    buffers = {accumulation_buffer_name(p): shapes[p] for p in shapes} if accumulation else {}
    moments = {m_in: shapes[u.weight] for u in updates for m_in, _ in u.moments}
    weight_updates = {u.weight: u.new_weight for u in updates}
    optimizer_state = {m_in: m_out for u in updates for m_in, m_out in u.moments}
    for m_in in optimizer_state:
        ed.add_input(m_in, TensorProto.FLOAT, list(moments[m_in]))
    new_values = {**accumulation, **weight_updates, **optimizer_state}  # state input -> output, in a stable order
    for state, out in new_values.items():
        ed.add_output(out, TensorProto.FLOAT, list({**shapes, **buffers, **moments}[state]))
    finite = _append_all_finite(ed, total) if loss_scale_input and total else None
    return TrainingGraph(
        model,
        list(io[0]),
        list(io[1]),
        weight_updates,
        optimizer_state,
        accumulation,
        state_shapes={**buffers, **moments},
        loss_scale_input=loss_scale_input if finite else None,
        all_finite_output=finite,
    )


def _gradient_only_result(
    ed: GraphEditor,
    model: onnx.ModelProto,
    io: tuple[list[str], list[str]],
    grads: dict[str, str],
    accumulation: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    outside: OutsideUpdate,
    loss_scale_input: str | None,
) -> TrainingGraph:
    """`update="torch"`: the graph outputs the forward outputs and each gradient sum `G` (with accumulation, the
    running sum is also the buffer's new value); the moments are state the graph never reads."""
    for p, g in grads.items():
        ed.add_output(g, TensorProto.FLOAT, list(shapes[p]))
    buffers = {accumulation_buffer_name(p): shapes[p] for p in shapes} if accumulation else {}
    has_moments = outside.optimizer_name != "SGDOptimizer"
    moments = {m: shapes[p] for p in outside.updated for m in moment_names(p)} if has_moments else {}
    return TrainingGraph(
        model,
        list(io[0]),
        list(io[1]),
        {p: p for p in outside.updated},  # updated in place: the state name is its own "output"
        {m: m for m in moments},
        accumulation,
        state_shapes={**buffers, **moments},
        loss_scale_input=loss_scale_input,
        # the legacy model_desc names the flag; TorchOptimizer.step returns its value
        all_finite_output=ALL_FINITE_OUTPUT if loss_scale_input else None,
        gradients=dict(grads),
        outside_update=outside,
    )


def _gradient_coefficient(ed: GraphEditor, divisor: int, loss_scale_input: str | None) -> str | float:
    """`1 / divisor`, divided by the loss scale under mixed precision: what turns the summed gradients into the
    mean gradient of the unscaled loss."""
    coef: str | float = 1.0 / divisor
    if loss_scale_input:
        coef = ed.scalar_product([coef, ed.op("Reciprocal", [loss_scale_input], "inv_loss_scale")], "grad_coef")
    return coef


def _append_update(
    ed: GraphEditor,
    append: OptimizerAppender,
    groups: list[ParamGroup],
    grads: dict[str, str],
    coef: str | float,
    clip: bool,
    check_finite: bool,
    updated: set[str],
) -> tuple[list[TensorUpdate], str | None]:
    """The step inputs, the sum of squared gradients (for clipping and the finite check), and each group's update
    of its tensors in `updated`; returns the updates and the sum of squares (None when nothing needs it)."""
    step = _append_step_inputs(ed)
    total = _total_square(ed, grads) if clip or check_finite else None
    group_coefs = _clip_coefficients(ed, total, groups, coef) if clip and total else [coef for _ in groups]
    updates: list[TensorUpdate] = []
    for group, group_coef in zip(groups, group_coefs, strict=True):
        params = [p for p in group.params if p in updated]
        if params:
            updates += append(ed, params, [grads[p] for p in params], group_coef, step, group.hyper)
    return updates, total


def _counts_problem(accumulation_steps: int, gradient_divisor: int | None) -> Problem:
    if accumulation_steps >= 1 and (gradient_divisor is None or gradient_divisor >= 1):
        return None
    return f"accumulation_steps ({accumulation_steps}) and gradient_divisor ({gradient_divisor}) must be positive"


def optimizer_problem(optimizer_name: str) -> Problem:
    if optimizer_name in OPTIMIZERS:
        return None
    return f"unknown optimizer {optimizer_name!r}; expected one of {sorted(OPTIMIZERS)}"


def gradient_model_problem(model: onnx.ModelProto, trainable: list[str], loss_scale_input: str | None) -> Problem:
    """The gradient-model contract: trainable tensors are graph inputs with static shapes, `<p>_grad` outputs."""
    inputs = graph_input_names(model)
    return first_problem(
        not_among(trainable, inputs, "trainable tensors", "the graph inputs"),
        dynamic_shape(model, trainable),
        not_among([gradient_name(p) for p in trainable], graph_output_names(model), "gradients", "the graph outputs"),
        not_among([loss_scale_input] if loss_scale_input else [], inputs, "loss-scale inputs", "the graph inputs"),
    )


def groups_problem(trainable: list[str], groups: list[ParamGroup], update_only: list[str] | None) -> Problem:
    """Every trainable tensor is in exactly one group, groups hold only trainable tensors, `update_only` too."""
    counts = Counter(p for g in groups for p in g.params)
    twice = sorted(p for p, n in counts.items() if n > 1)
    return first_problem(
        f"tensors {twice} are in more than one parameter group" if twice else None,
        not_among(trainable, set(counts), "trainable tensors", "the parameter groups"),
        not_among(counts, set(trainable), "parameter-group members", "the trainable tensors"),
        not_among(update_only or [], set(trainable), "update_only tensors", "the trainable tensors"),
    )


def _append_accumulation(ed: GraphEditor, grads: dict[str, str], shapes: dict[str, tuple[int, ...]]):
    """`G = buffer + g`: the running sum of micro-batch gradients (the buffer is zero after each update)."""
    summed, accumulation = {}, {}
    for p, g in grads.items():
        buffer = ed.add_input(accumulation_buffer_name(p), TensorProto.FLOAT, list(shapes[p]))
        summed[p] = ed.op("Add", [buffer, g], f"{buffer}.new")
        accumulation[buffer] = summed[p]
    return summed, accumulation


def _append_step_inputs(ed: GraphEditor) -> StepScalars:
    lr = ed.add_input(LEARNING_RATE_INPUT, TensorProto.FLOAT, [])
    count = ed.add_input(UPDATE_COUNT_INPUT, TensorProto.INT64, [])
    return StepScalars(lr, ed.op("Cast", [count], "update_count_d", to=TensorProto.DOUBLE), count)


def _total_square(ed: GraphEditor, grads: dict[str, str]) -> str:
    """Sum of squares of every gradient (one scalar), shared by clipping and the finite check; 0 for a model with
    no trainable tensor (ONNX's Sum needs at least one input)."""
    squares = [ed.op("ReduceSumSquare", [g], "grad_sq", keepdims=0) for g in grads.values()]
    if not squares:
        return ed.constant(0.0, hint="total_grad_sq_empty")
    return squares[0] if len(squares) == 1 else ed.op("Sum", squares, "total_grad_sq")


def _clip_coefficients(ed: GraphEditor, total: str, groups: list[ParamGroup], coef: str | float) -> list[str | float]:
    """Per group: `coef · min(1, max_norm_clip / (‖coef·G‖ + 1e-6))`, the norm taken over all trainable gradients
    (torch.nn.utils.clip_grad_norm_ semantics)."""
    norm = ed.scalar_product([ed.op("Sqrt", [total], "clip/raw_norm"), coef], "clip/norm")
    shifted = ed.op("Add", [ed.as_tensor(norm), ed.constant(CLIP_EPSILON, hint="clip/eps")], "clip/norm_eps")
    one = ed.constant(1.0, hint="clip/one")
    coefs: list[str | float] = []
    for group in groups:
        ratio = ed.op(
            "Div", [ed.constant(float(group.hyper["max_norm_clip"]), hint="clip/max_norm"), shifted], "clip/ratio"
        )
        coefs.append(ed.scalar_product([ed.op("Min", [ratio, one], "clip/factor"), coef], "clip/coef"))
    return coefs


def _append_all_finite(ed: GraphEditor, total: str) -> str:
    """`all_gradients_finite = not (isinf(total) or isnan(total))`, shaped [1] like the legacy output."""
    bad = ed.op("Or", [ed.op("IsInf", [total], "amp/is_inf"), ed.op("IsNaN", [total], "amp/is_nan")], "amp/bad")
    finite = ed.op("Not", [bad], "amp/finite")
    name = ed.unused(ALL_FINITE_OUTPUT)
    ed.op("Reshape", [finite, ed.constant([1], dtype="int64", hint="amp/shape1")], "amp/finite_1", outputs=[name])
    ed.add_output(name, TensorProto.BOOL, [1])
    return name


def _input_shapes(model: onnx.ModelProto, names: list[str]) -> dict[str, tuple[int, ...]]:
    by_name = {i.name: i for i in model.graph.input}
    shapes = {}
    for n in names:
        dims = by_name[n].type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") for d in dims):
            raise ValueError(f"trainable tensor {n!r} has a dynamic shape; parameters must have static shapes")
        shapes[n] = tuple(int(d.dim_value) for d in dims)
    return shapes


def _drop_gradient_outputs(model: onnx.ModelProto, trainable: list[str]) -> None:
    grad_names = {gradient_name(p) for p in trainable}
    kept = [o for o in model.graph.output if o.name not in grad_names]
    del model.graph.output[:]
    model.graph.output.extend(kept)


def _imports(model: onnx.ModelProto, domain: str) -> bool:
    return any(o.domain == domain for o in model.opset_import)
