"""The state passes (graph/state_inputs.py) on hand-built graphs: strip_prefix, set_initializers,
move_initializers_to_inputs, bind_foreign_state and order_inputs — their rules, run in ONNX Runtime against numpy,
and their preconditions."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from helpers import onnx_model, run_onnx, value_info
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.passes import PassPreconditionError, run_passes
from orttrainer.trainer.graph.state_inputs import (
    bind_foreign_state,
    bind_foreign_state_pass,
    move_initializers_to_inputs,
    move_initializers_to_inputs_pass,
    order_inputs,
    order_inputs_pass,
    set_initializers,
    set_initializers_pass,
    strip_prefix,
    strip_prefix_pass,
)

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
W = np.array([[1.0, -2.0], [0.5, 3.0], [2.0, 0.0]], np.float32)
B = np.array([0.25, -1.0], np.float32)
X = np.array([[1.0, 2.0, 3.0]], np.float32)


def _linear(w: str = "w", b: str = "b", inputs=None, initializers=None) -> onnx.ModelProto:
    """y = x @ w + b, with w and b initializers unless `initializers` says otherwise."""
    nodes = [helper.make_node("MatMul", ["x", w], ["h"]), helper.make_node("Add", ["h", b], ["y"])]
    inits = initializers if initializers is not None else [numpy_helper.from_array(W, w), numpy_helper.from_array(B, b)]
    return onnx_model(nodes, inputs or [value_info("x", [1, 3])], [value_info("y", [1, 2])], inits)


# ---------------------------------------------------------------------------------------------------- strip_prefix
def test_strip_prefix_renames_initializers_and_their_uses():
    model = _linear("model.w", "model.b")
    model.graph.value_info.append(value_info("model.w", [3, 2]))
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "other.c"))
    result = run_passes(model, [strip_prefix_pass("model.")], verify=True)
    assert [i.name for i in result.graph.initializer] == ["w", "b", "other.c"]
    assert [list(n.input) for n in result.graph.node] == [["x", "w"], ["h", "b"]]
    assert result.graph.value_info[0].name == "w"
    assert model.graph.initializer[0].name == "model.w"  # the argument is untouched
    np.testing.assert_allclose(run_onnx(result, {"x": X}, ["y"])[0], X @ W + B, rtol=1e-6)


def test_strip_prefix_precondition():
    with pytest.raises(PassPreconditionError, match="'strip_prefix': the prefix is empty"):
        strip_prefix(_linear(), "")
    clash = _linear("model.w", "model.b")
    clash.graph.node[0].output[0] = "w"  # a tensor already has a stripped name
    clash.graph.node[1].input[0] = "w"
    with pytest.raises(PassPreconditionError, match=r"'strip_prefix': the stripped names \['w'\] are already used"):
        strip_prefix(clash, "model.")


# ------------------------------------------------------------------------------------------------ set_initializers
def test_set_initializers_replaces_values_in_place_from_torch_or_numpy():
    model = _linear()
    new_w, new_b = torch.full((3, 2), 2.0), np.array([1.0, 1.0], np.float32)
    result = set_initializers(model, {"w": new_w, "b": new_b, "not_in_graph": torch.zeros(1)})
    assert result is model  # declared as mutating: the freshly exported model is not copied
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), new_w.numpy())
    np.testing.assert_allclose(run_onnx(model, {"x": X}, ["y"])[0], X @ new_w.numpy() + new_b, rtol=1e-6)


def test_set_initializers_pass_leaves_the_callers_model_alone():
    model = _linear()
    graph_pass = set_initializers_pass({"b": torch.zeros(2)})
    assert graph_pass.mutates_input
    result = run_passes(model, [graph_pass], verify=True)
    np.testing.assert_array_equal(numpy_helper.to_array(result.graph.initializer[1]), np.zeros(2, np.float32))
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[1]), B)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.zeros(3), r"has shape \[3\], the initializer \[2\]"),
        (torch.zeros(2, dtype=torch.int64), "is int64, the initializer FLOAT"),
    ],
    ids=["shape", "dtype"],
)
def test_set_initializers_precondition(value, message):
    model = _linear()
    with pytest.raises(PassPreconditionError, match=f"'set_initializers': the value for 'b' {message}"):
        set_initializers(model, {"b": value})
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[1]), B)


# ------------------------------------------------------------------------------------- move_initializers_to_inputs
def test_move_initializers_to_inputs_appends_state_inputs_in_initializer_order():
    model = _linear()
    model.graph.input.append(value_info("b", [2]))  # already an input (keep_initializers_as_inputs): listed once
    result = run_passes(model, [move_initializers_to_inputs_pass(["b", "w", "absent"])], verify=True)
    assert [i.name for i in result.graph.input] == ["x", "b", "w"]
    assert [i.name for i in result.graph.initializer] == []
    w_input = result.graph.input[2].type.tensor_type
    assert (w_input.elem_type, [d.dim_value for d in w_input.shape.dim]) == (FLOAT, [3, 2])
    new_w = np.ones((3, 2), np.float32)
    np.testing.assert_allclose(run_onnx(result, {"x": X, "w": new_w, "b": B}, ["y"])[0], X @ new_w + B, rtol=1e-6)
    assert len(model.graph.initializer) == 2  # the argument is untouched
    only_w = move_initializers_to_inputs(_linear(), ["w"])
    assert [i.name for i in only_w.graph.initializer] == ["b"]  # other initializers stay constants


def test_move_initializers_to_inputs_precondition():
    twice = _linear()
    twice.graph.initializer.append(numpy_helper.from_array(B, "b"))
    with pytest.raises(PassPreconditionError, match="'move_initializers_to_inputs': initializer 'b' is listed twice"):
        move_initializers_to_inputs(twice, ["w"])
    sparse = _linear(initializers=[numpy_helper.from_array(B, "b")])
    values = numpy_helper.from_array(np.array([1.0], np.float32), "w")
    indices = numpy_helper.from_array(np.array([0], np.int64), "w_indices")
    sparse.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [3, 2]))
    with pytest.raises(PassPreconditionError, match=r"state tensors \['w'\] are sparse initializers"):
        move_initializers_to_inputs(sparse, ["w", "b"])


# ---------------------------------------------------------------------------------------------- bind_foreign_state
def _torch_builder_graph() -> onnx.ModelProto:
    """The torch builder's contract: data, then every module tensor as a graph input ('count' is read, 'unused'
    is not)."""
    inputs = [
        value_info("x", [1, 3]),
        value_info("w", [3, 2]),
        value_info("b", [2]),
        value_info("count", [], INT64),
        value_info("unused", [2]),
    ]
    model = _linear(inputs=inputs, initializers=[])
    model.graph.node.append(helper.make_node("Identity", ["count"], ["count_out"]))
    model.graph.output.append(value_info("count_out", [], INT64))
    return model


def test_bind_foreign_state_makes_read_foreign_inputs_initializers_and_drops_the_rest():
    model = _torch_builder_graph()
    values = {"b": torch.tensor(B), "count": torch.tensor(7), "unused": torch.zeros(2)}
    result = run_passes(model, [bind_foreign_state_pass(1, ["w"], values)], verify=True)
    assert [i.name for i in result.graph.input] == ["x", "w"]
    assert {i.name: numpy_helper.to_array(i).tolist() for i in result.graph.initializer} == {
        "b": B.tolist(),
        "count": 7,
    }
    np.testing.assert_allclose(run_onnx(result, {"x": X, "w": W}, ["y"])[0], X @ W + B, rtol=1e-6)
    assert len(model.graph.input) == 5  # the argument is untouched


def test_bind_foreign_state_precondition():
    model = _torch_builder_graph()
    with pytest.raises(PassPreconditionError, match=r"graph inputs \['count'\] are neither trainer state nor module"):
        bind_foreign_state(model, 1, ["w"], {"b": torch.tensor(B)})
    with pytest.raises(PassPreconditionError, match="data_count 6 is not between 0 and the 5 graph inputs"):
        bind_foreign_state(model, 6, ["w"], {})


# ---------------------------------------------------------------------------------------------------- order_inputs
def test_order_inputs_puts_data_then_state_and_restores_dropped_state():
    inputs = [value_info("b", [2]), value_info("w", [3, 2]), value_info("x", [1, 3]), value_info("stale", [4])]
    model = _linear(inputs=inputs, initializers=[])
    state = {"w": torch.tensor(W), "b": torch.tensor(B), "steps": torch.zeros(5, dtype=torch.int64)}
    result = run_passes(model, [order_inputs_pass(["x"], state)], verify=True)
    assert [i.name for i in result.graph.input] == ["x", "w", "b", "steps"]  # 'stale' (read by no node) is dropped
    steps = result.graph.input[3].type.tensor_type
    assert (steps.elem_type, [d.dim_value for d in steps.shape.dim]) == (INT64, [5])
    np.testing.assert_allclose(
        run_onnx(result, {"x": X, "w": W, "b": B, "steps": np.zeros(5, np.int64)}, ["y"])[0], X @ W + B
    )
    assert [i.name for i in model.graph.input] == ["b", "w", "x", "stale"]  # the argument is untouched


@pytest.mark.parametrize(
    ("data", "state", "message"),
    [
        (["x"], {"w": torch.tensor(W)}, r"graph inputs \['b'\] are read by nodes but are neither data nor state"),
        (["x", "w"], {"w": torch.tensor(W), "b": torch.tensor(B)}, r"names \['w'\] are both data and state"),
        (["x", "y2"], {"w": torch.tensor(W), "b": torch.tensor(B)}, r"data inputs \['y2'\] are not graph inputs"),
    ],
    ids=["unlisted", "both", "absent_data"],
)
def test_order_inputs_precondition(data, state, message):
    model = _linear(inputs=[value_info("x", [1, 3]), value_info("w", [3, 2]), value_info("b", [2])], initializers=[])
    with pytest.raises(PassPreconditionError, match=f"'order_inputs': {message}"):
        order_inputs(model, data, state)
