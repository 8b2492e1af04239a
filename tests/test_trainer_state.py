"""The trainer's state (trainer/state.py) and the graphs' state contract (trainer/compile/contract.py): the
accumulation window's rule, and a contract read back from the model the training tail wrote it into."""

from __future__ import annotations

from dataclasses import replace

import onnx
import pytest
from onnx import TensorProto, helper

from orttrainer.trainer.compile.contract import (
    GradientStepGraph,
    OutsideUpdate,
    ParamGroup,
    TrainingGraph,
    read_contract,
    write_contract,
)
from orttrainer.trainer.graph.data_parallel import build_gradient_step_graph, gradient_step_pass
from orttrainer.trainer.graph.passes import run_passes
from orttrainer.trainer.graph.training import build_training_graph, training_tail_pass
from orttrainer.trainer.state import AccumulationWindow


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_the_window_ends_every_k_micro_steps_and_is_open_in_between(steps):
    window = AccumulationWindow(steps)
    ends = [n for n in range(1, 10) if window.ends_at(n)]
    assert ends == [n for n in range(1, 10) if n % steps == 0]
    assert [window.zeroes_after(n) for n in range(1, 10)] == [window.ends_at(n) for n in range(1, 10)]
    # after n micro-steps the buffers hold a partial sum exactly when the n-th step did not end a window
    assert [window.mid_window(n) for n in range(0, 10)] == [n % steps != 0 for n in range(0, 10)]
    assert window.accumulates == (steps > 1)


def _gradient_model() -> onnx.ModelProto:
    """y = x·W, loss = sum(y); outputs the loss and W's gradient (as a gradient builder would)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        helper.make_node("Identity", ["x"], ["W_grad_raw"]),
        helper.make_node("ReduceSum", ["W_grad_raw", "axes0"], ["W_grad_row"], keepdims=1),
        helper.make_node("Transpose", ["W_grad_row"], ["W_grad"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("W", TensorProto.FLOAT, [3, 1]),
        ],
        [
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("W_grad", TensorProto.FLOAT, [3, 1]),
        ],
        [helper.make_tensor("axes0", TensorProto.INT64, [1], [0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("update", ["graph", "torch"])
@pytest.mark.parametrize("accumulation_steps", [1, 3])
def test_the_training_tail_carries_its_contract_in_the_model(update, accumulation_steps):
    adam = {
        "alpha": 0.9,
        "beta": 0.999,
        "lambda": 0.0,
        "epsilon": 1e-8,
        "do_bias_correction": True,
        "weight_decay_mode": 0,
        "max_norm_clip": 1.0,
    }
    arguments = dict(
        data_inputs=["x"],
        outputs=["loss"],
        trainable=["W"],
        optimizer_name="AdamOptimizer",
        groups=[ParamGroup(adam, ["W"])],
        accumulation_steps=accumulation_steps,
        clip_grad_norm=True,
        update=update,
    )
    graph = build_training_graph(_gradient_model(), **arguments)
    model = run_passes(_gradient_model(), [training_tail_pass(**arguments)], verify=True)
    read = read_contract(model)
    assert isinstance(read, TrainingGraph) and read == replace(graph, model=model)
    assert [i.name for i in model.graph.input] == [i.name for i in graph.model.graph.input]
    if update == "torch":
        expected = OutsideUpdate("AdamOptimizer", [ParamGroup(adam, ["W"])], accumulation_steps, True, False, ["W"])
        assert read.outside_update == expected
    assert read.state_shapes["Moment_1_W"] == (3, 1)


def test_a_gradient_step_contract_round_trips_and_a_new_one_replaces_the_old():
    arguments = dict(data_inputs=["x"], outputs=["loss"], trainable=["W"], accumulate=True, loss_scale_input=None)
    step = build_gradient_step_graph(_gradient_model(), **arguments)
    model = run_passes(_gradient_model(), [gradient_step_pass(**arguments)], verify=True)
    assert isinstance(read_contract(model), GradientStepGraph) and read_contract(model) == replace(step, model=model)
    step = replace(step, model=model)
    other = GradientStepGraph(step.model, ["x"], ["loss"], {"W": "W_grad"})
    write_contract(step.model, other)
    assert read_contract(step.model) == other
    assert [p.key for p in step.model.metadata_props].count("orttrainer.contract") == 1


def test_a_model_without_a_contract_says_so():
    with pytest.raises(ValueError, match="carries no orttrainer training contract"):
        read_contract(_gradient_model())
