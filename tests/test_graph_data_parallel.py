"""The data-parallel graphs (graph/data_parallel.py) on the hand-built gradient model of test_graph_optimizer.py
(`p_grad = x_p + p`): the gradient-step graph with and without accumulation, the optimizer graph against the float64
reference (divisor, clipping over all gradients, ZeRO's update_only), and both preconditions."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from test_graph_optimizer import Reference, adam_hyper, gradient_model, initial_params, sgd_hyper

from orttrainer.trainer.compile.contract import (
    LEARNING_RATE_INPUT,
    UPDATE_COUNT_INPUT,
    ParamGroup,
    moment_names,
    zero_state,
)
from orttrainer.trainer.graph.data_parallel import build_gradient_step_graph, build_optimizer_graph
from orttrainer.trainer.graph.passes import PassPreconditionError, verify_model

SHAPES = {"w": (3, 2), "b": (2,)}


def _session(model) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _step(model, accumulate: bool, **overrides):
    arguments = {"data_inputs": ["x_w", "x_b"], "outputs": ["loss"], "trainable": ["w", "b"], "accumulate": accumulate}
    return build_gradient_step_graph(model, **{**arguments, **overrides})


# ----------------------------------------------------------------------------------------------- gradient step graph
def test_gradient_step_graph_without_accumulation_outputs_the_micro_batch_gradients():
    source = gradient_model(SHAPES)
    before = source.SerializeToString()
    step = _step(source, accumulate=False, loss_scale_input=None)
    assert source.SerializeToString() == before
    assert step.gradients == {"w": "w_grad", "b": "b_grad"} and step.accumulation == {} and step.state_shapes == {}
    assert step.model == source  # nothing to add: the gradient model is the step
    assert (step.data_inputs, step.outputs) == (["x_w", "x_b"], ["loss"])


def test_gradient_step_graph_with_accumulation_adds_the_running_sum():
    step = _step(gradient_model(SHAPES), accumulate=True)
    verify_model(step.model, "build_gradient_step_graph")
    buffers = {p: f"{p}_grad_accumulation_buffer" for p in SHAPES}
    assert step.accumulation == {buffers[p]: step.gradients[p] for p in SHAPES}
    assert step.state_shapes == {buffers["w"]: (3, 2), buffers["b"]: (2,)}
    assert [o.name for o in step.model.graph.output] == ["loss", step.gradients["w"], step.gradients["b"]]
    params = initial_params(w=(3, 2), b=(2,))
    rng = np.random.default_rng(2)
    data = {f"x_{p}": rng.standard_normal(s).astype(np.float32) for p, s in SHAPES.items()}
    sums = {buffers[p]: rng.standard_normal(s).astype(np.float32) for p, s in SHAPES.items()}
    fetched = _session(step.model).run([step.gradients["w"], step.gradients["b"]], {**params, **data, **sums})
    for p, value in zip(["w", "b"], fetched, strict=True):
        np.testing.assert_allclose(value, sums[buffers[p]] + data[f"x_{p}"] + params[p], rtol=1e-6)


@pytest.mark.parametrize(
    ("edit", "overrides", "message"),
    [
        (lambda m: m.graph.output.pop(), {}, r"gradients \['b_grad'\] are missing from the graph outputs"),
        (lambda m: None, {"trainable": ["w", "v"]}, r"trainable tensors \['v'\] are missing from the graph inputs"),
        (
            lambda m: m.graph.input[1].type.tensor_type.shape.dim[0].ClearField("dim_value"),
            {},
            "trainable tensor 'w' has a dynamic shape",
        ),
        (lambda m: None, {"loss_scale_input": "loss_scale"}, r"loss-scale inputs \['loss_scale'\] are missing"),
    ],
    ids=["gradient_output", "trainable_input", "dynamic_shape", "loss_scale"],
)
def test_gradient_step_graph_precondition(edit, overrides, message):
    model = gradient_model(SHAPES)
    edit(model)
    with pytest.raises(PassPreconditionError, match=f"graph pass 'build_gradient_step_graph': {message}"):
        _step(model, accumulate=True, **overrides)


# --------------------------------------------------------------------------------------------------- optimizer graph
def _optimizer(optimizer: str, hyper: dict, **overrides):
    arguments = {
        "trainable": ["w", "b"],
        "optimizer_name": optimizer,
        "groups": [ParamGroup(hyper, ["w", "b"])],
        "gradient_divisor": 4,
        "clip_grad_norm": False,
        "loss_scale": False,
        "update_only": None,
    }
    return build_optimizer_graph(SHAPES, **{**arguments, **overrides})


def _update(graph, params: dict, reduced: dict, lr: float) -> dict:
    feeds = {
        **params,
        **reduced,
        **zero_state(graph.state_shapes),
        LEARNING_RATE_INPUT: np.array(lr, np.float32),
        UPDATE_COUNT_INPUT: np.array(1, np.int64),
    }
    outputs = {**graph.weight_updates, **graph.optimizer_state}
    return dict(zip(outputs, _session(graph.model).run(list(outputs.values()), feeds), strict=True))


def test_optimizer_graph_divides_the_combined_gradients_and_updates_every_tensor():
    optimizer, reduced = _optimizer("SGDOptimizer", sgd_hyper())
    verify_model(optimizer.model, "build_optimizer_graph")
    assert reduced == {"w": "w_grad__reduced", "b": "b_grad__reduced"}
    assert [i.name for i in optimizer.model.graph.input][:4] == ["w", "b", "w_grad__reduced", "b_grad__reduced"]
    assert (optimizer.data_inputs, optimizer.outputs, optimizer.accumulation) == ([], [], {})
    params = initial_params(w=(3, 2), b=(2,))
    sums = {reduced[p]: np.full(s, 8.0, np.float32) for p, s in SHAPES.items()}
    new = _update(optimizer, params, sums, lr=0.5)
    for p in SHAPES:
        np.testing.assert_allclose(new[p], params[p] - 0.5 * 8.0 / 4, rtol=1e-6)


def test_optimizer_graph_clips_with_the_norm_over_all_gradients_and_updates_only_its_share():
    hyper = adam_hyper(max_norm_clip=0.5)
    optimizer, reduced = _optimizer("AdamOptimizer", hyper, clip_grad_norm=True, update_only=["w"])
    assert set(optimizer.weight_updates) == {"w"} and set(optimizer.optimizer_state) == set(moment_names("w"))
    params = initial_params(w=(3, 2), b=(2,))
    rng = np.random.default_rng(3)
    sums = {p: rng.standard_normal(s).astype(np.float32) * 4 for p, s in SHAPES.items()}
    new = _update(optimizer, params, {reduced[p]: g for p, g in sums.items()}, lr=0.1)
    reference = Reference("AdamOptimizer", [ParamGroup(hyper, ["w", "b"])], params)
    reference.update({p: g.astype(np.float64) for p, g in sums.items()}, 4, 0.1, clip=True)
    assert reference.clip_factors[0] < 1.0  # the norm over w and b together clips
    np.testing.assert_allclose(new["w"], reference.w["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new[moment_names("w")[0]], reference.m["w"], rtol=1e-5, atol=1e-6)


def test_optimizer_graph_with_loss_scale_has_the_finite_check():
    optimizer, _ = _optimizer("SGDOptimizer", sgd_hyper(), loss_scale=True)
    assert optimizer.loss_scale_input == "loss_scale" and optimizer.all_finite_output == "all_gradients_finite"
    inputs = {i.name: i for i in optimizer.model.graph.input}
    assert inputs["loss_scale"].type.tensor_type.elem_type == TensorProto.FLOAT


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"optimizer_name": "AdagradOptimizer"}, "unknown optimizer 'AdagradOptimizer'"),
        ({"trainable": ["w", "b", "c"]}, r"trainable tensors \['c'\] are missing from the shapes"),
        ({"groups": [ParamGroup({}, ["w"]), ParamGroup({}, ["w", "b"])]}, r"tensors \['w'\] are in more than one"),
        ({"groups": [ParamGroup({}, ["w"])]}, r"trainable tensors \['b'\] are missing from the parameter groups"),
        ({"update_only": ["w", "z"]}, r"update_only tensors \['z'\] are missing from the trainable tensors"),
        ({"gradient_divisor": 0}, r"gradient_divisor \(0\) must be positive"),
    ],
    ids=["optimizer", "shapes", "two_groups", "no_group", "update_only", "divisor"],
)
def test_optimizer_graph_precondition(overrides, message):
    with pytest.raises(PassPreconditionError, match=f"graph pass 'build_optimizer_graph': {message}"):
        _optimizer("SGDOptimizer", sgd_hyper(), **overrides)


def test_build_training_graph_precondition_names_the_groups_and_counts():
    from orttrainer.trainer.graph.training import build_training_graph

    arguments = {
        "data_inputs": ["x_w", "x_b"],
        "outputs": ["loss"],
        "trainable": ["w", "b"],
        "optimizer_name": "SGDOptimizer",
        "groups": [ParamGroup(sgd_hyper(), ["w", "b", "extra"])],
        "accumulation_steps": 1,
        "clip_grad_norm": False,
    }
    with pytest.raises(PassPreconditionError, match=r"parameter-group members \['extra'\] are missing from the"):
        build_training_graph(gradient_model(SHAPES), **arguments)
    arguments["groups"] = [ParamGroup(sgd_hyper(), ["w", "b"])]
    with pytest.raises(PassPreconditionError, match=r"accumulation_steps \(0\) and gradient_divisor"):
        build_training_graph(gradient_model(SHAPES), **{**arguments, "accumulation_steps": 0})
    extra_input = gradient_model(SHAPES)
    extra_input.graph.input.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, []))
    with pytest.raises(PassPreconditionError, match=r"loss-scale inputs \['lscale'\] are missing"):
        build_training_graph(extra_input, **arguments, loss_scale_input="lscale")
