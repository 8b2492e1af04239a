"""The `rename_state` pass (orttrainer/trainer/graph/state_names.py) on a hand-built gradient-model-like graph:
state inputs and `<name>_grad` outputs renamed, references followed, clashing intermediates moved aside."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from orttrainer.trainer.graph.passes import PassPreconditionError, run_passes
from orttrainer.trainer.graph.state_names import rename_state, rename_state_pass


def gradient_like_model() -> onnx.ModelProto:
    """x, fc1_weight, b -> loss = ReduceSum(x @ fc1_weight + b); outputs loss, fc1_weight_grad, b_grad. An
    intermediate is called 'fc1.weight' by coincidence (a traced graph's names are its own)."""
    nodes = [
        helper.make_node("MatMul", ["x", "fc1_weight"], ["fc1.weight"]),
        helper.make_node("Add", ["fc1.weight", "b"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        helper.make_node("Identity", ["fc1_weight"], ["fc1_weight_grad"]),  # stands in for a gradient
        helper.make_node("Identity", ["b"], ["b_grad"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", 1, [2, 3]),
            helper.make_tensor_value_info("fc1_weight", 1, [3, 4]),
            helper.make_tensor_value_info("b", 1, [4]),
        ],
        [
            helper.make_tensor_value_info("loss", 1, []),
            helper.make_tensor_value_info("fc1_weight_grad", 1, [3, 4]),
            helper.make_tensor_value_info("b_grad", 1, [4]),
        ],
        value_info=[helper.make_tensor_value_info("y", 1, [2, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


NAMES = {"fc1_weight": "fc1.weight", "b": "/layer/b:0"}


def test_state_inputs_and_gradients_take_the_trainer_names_and_intermediates_move_aside():
    model = gradient_like_model()
    renamed = run_passes(model, [rename_state_pass(NAMES)], verify=True)
    assert [i.name for i in renamed.graph.input] == ["x", "fc1.weight", "/layer/b:0"]
    assert [o.name for o in renamed.graph.output] == ["loss", "fc1.weight_grad", "/layer/b:0_grad"]
    matmul = renamed.graph.node[0]
    assert list(matmul.input) == ["x", "fc1.weight"] and matmul.output[0] == "fc1.weight_"
    assert list(renamed.graph.node[1].input) == ["fc1.weight_", "/layer/b:0"]
    assert [i.name for i in model.graph.input] == ["x", "fc1_weight", "b"]  # the argument is untouched
    feeds = {
        "x": np.ones((2, 3), np.float32),
        "w": np.full((3, 4), 0.5, np.float32),
        "b": np.arange(4, dtype=np.float32),
    }
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": feeds["x"], "fc1_weight": feeds["w"], "b": feeds["b"]}
    )
    after = ort.InferenceSession(renamed.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": feeds["x"], "fc1.weight": feeds["w"], "/layer/b:0": feeds["b"]}
    )
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_names_that_swap_are_renamed_at_once():
    renamed = rename_state(gradient_like_model(), {"fc1_weight": "b", "b": "fc1_weight"})
    assert [i.name for i in renamed.graph.input] == ["x", "b", "fc1_weight"]
    assert [o.name for o in renamed.graph.output] == ["loss", "b_grad", "fc1_weight_grad"]


@pytest.mark.parametrize(
    ("names", "problem"),
    [
        ({"w": "W"}, r"state tensors \['w'\] are not graph inputs"),
        ({"fc1_weight": "z", "b": "z"}, "are not distinct"),
        ({"b": "x"}, r"new names \['x'\] are graph inputs or outputs already"),
        ({"b": "loss"}, r"new names \['loss'\] are graph inputs or outputs already"),
    ],
)
def test_precondition_names_what_is_wrong(names, problem):
    with pytest.raises(PassPreconditionError, match=problem):
        rename_state_pass(names)(gradient_like_model())
