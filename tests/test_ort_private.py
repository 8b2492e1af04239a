"""Pins the behaviour of every wrapper in orttrainer/trainer/runtime/ort_private.py, the one module that uses ONNX
Runtime's private API: an ONNX Runtime upgrade that changes one of them fails here first."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from helpers import needs_training_build, onnx_model
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.runtime import ort_private
from orttrainer.trainer.runtime.session import to_torch_view


def _add_one():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    one = numpy_helper.from_array(np.ones(3, np.float32), "one")
    return onnx_model([helper.make_node("Add", ["x", "one"], ["y"])], [x], [y], [one], opset=17)


def test_owned_ortvalue_copies_the_array():
    array = np.arange(3, dtype=np.float32)
    value = ort_private.owned_ortvalue(array, "cpu", 0)
    array[:] = 7
    np.testing.assert_array_equal(value.numpy(), [0, 1, 2])


def test_ortvalue_from_torch_shares_the_tensor_memory_and_reads_bool():
    tensor = torch.arange(3, dtype=torch.float32)
    value = ort_private.ortvalue_from_torch(tensor)
    tensor.add_(10)
    np.testing.assert_array_equal(value.numpy(), [10, 11, 12])
    as_bool = ort_private.ortvalue_from_torch(torch.tensor([True, False, True]))
    assert as_bool.data_type() == "tensor(bool)" and as_bool.numpy().tolist() == [True, False, True]
    assert to_torch_view(as_bool).tolist() == [True, False, True]


def test_run_with_ort_values_returns_new_owned_values():
    session = ort.InferenceSession(_add_one().SerializeToString(), providers=["CPUExecutionProvider"])
    feed = ort_private.owned_ortvalue(np.zeros(3, np.float32), "cpu", 0)
    (result,) = ort_private.run_with_ort_values(session, {"x": feed}, ["y"], ort.RunOptions())
    np.testing.assert_array_equal(result.numpy(), [1, 1, 1])
    to_torch_view(result).add_(1)  # writing the result leaves the feed alone: no aliasing
    np.testing.assert_array_equal(feed.numpy(), [0, 0, 0])


def _dropout_model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1000])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1000])
    ratio = numpy_helper.from_array(np.array(0.5, np.float32), "ratio")
    mode = numpy_helper.from_array(np.array(True), "mode")
    return onnx_model([helper.make_node("Dropout", ["x", "ratio", "mode"], ["y"])], [x], [y], [ratio, mode], opset=17)


def test_set_seed_makes_dropout_masks_repeat():
    session = ort.InferenceSession(_dropout_model().SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.ones(1000, np.float32)
    ort_private.set_seed(5)
    first = session.run(None, {"x": x})[0]
    ort_private.set_seed(5)
    again = session.run(None, {"x": x})[0]
    third = session.run(None, {"x": x})[0]
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(again, third)


def _weighted_sum():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    w = numpy_helper.from_array(np.array([2.0, 3.0], np.float32), "w")
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("ReduceSum", ["xw"], ["loss"], keepdims=0)]
    return onnx_model(nodes, [x], [loss], [w], opset=17)


def _with_state_inputs(model):
    result = onnx.ModelProto()
    result.CopyFrom(model)
    result.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [2]))
    del result.graph.initializer[:]
    return result


def test_has_training_build_matches_the_installed_runtime():
    from onnxruntime.capi import _pybind_state

    assert ort_private.has_training_build() == hasattr(_pybind_state, "GradientGraphBuilder")


@needs_training_build
def test_gradient_graph_adds_the_parameter_gradient():
    model = _with_state_inputs(_weighted_sum())
    options = ort.SessionOptions()
    optimized = ort_private.pre_training_optimized_model(model.SerializeToString(), {"w"}, options)
    graded = onnx.load_from_string(ort_private.gradient_graph(optimized, "loss", {"w"}, options))
    assert "w_grad" in [o.name for o in graded.graph.output]
    session = ort.InferenceSession(graded.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([5.0, 7.0], np.float32)
    w_grad = session.run(["w_grad"], {"x": x, "w": np.array([2.0, 3.0], np.float32)})[0]
    np.testing.assert_allclose(w_grad, x)  # d(sum(x*w))/dw = x


@needs_training_build
def test_module_graph_builder_yields_the_loss_gradient():
    model = _with_state_inputs(_weighted_sum())
    builder = ort_private.module_graph_builder(model.SerializeToString(), ["w"], ["w"], memory_efficient=False)
    builder.build(ort_private.transformer_configuration("FLOOD_FILL", 1, []))
    graded = onnx.load_from_string(builder.get_gradient_model())
    assert [n.op_type for n in graded.graph.node].count("YieldOp") == 1
    assert "w_grad" in [o.name for o in graded.graph.output]
