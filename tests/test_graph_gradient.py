"""The `ort` gradient builder (gradient.py) on hand-built graphs, checked against torch autograd."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import needs_training_build, onnx_model, run_onnx_by_name, value_info, value_names
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.gradient.ort_builder import (
    GradientBuildError,
    _order_outputs,
    build_ort_gradient_graph,
    move_initializers_to_inputs,
)
from orttrainer.trainer.graph.fixups import name_optional_outputs

RNG = np.random.default_rng(0)
W0 = RNG.standard_normal((3, 2)).astype(np.float32)
B0 = RNG.standard_normal(2).astype(np.float32)
S0 = np.array(1.5, np.float32)
X = RNG.standard_normal((4, 3)).astype(np.float32)
LABEL = np.array([0, 1, 1, 0], np.int64)


def _classifier(reduction: str = "mean") -> onnx.ModelProto:
    """probs = Softmax(s·Gemm(x, W, B)); loss = SoftmaxCrossEntropyLoss(s·Gemm(x, W, B), label).

    W and B are trainable, s is frozen state, `half` is a plain constant of the graph.
    """
    nodes = [
        helper.make_node("Gemm", ["x", "W", "B"], ["z"], name="fc"),
        helper.make_node("Mul", ["z", "s"], ["zs"], name="scale"),
        helper.make_node("Mul", ["zs", "half"], ["logits"], name="halve"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=1),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss"], name="sce", reduction=reduction),
    ]
    inits = [
        numpy_helper.from_array(W0, "W"),
        numpy_helper.from_array(B0, "B"),
        numpy_helper.from_array(S0, "s"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    inputs = [value_info("x", [4, 3]), value_info("label", [4], TensorProto.INT64)]
    return onnx_model(nodes, inputs, [value_info("probs", [4, 2]), value_info("loss", [])], inits)


def _torch_reference(reduction: str = "mean") -> dict[str, np.ndarray]:
    w, b = torch.tensor(W0, requires_grad=True), torch.tensor(B0, requires_grad=True)
    logits = (torch.tensor(X) @ w + b) * float(S0) * 0.5
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(LABEL), reduction=reduction)
    loss.backward()
    return {
        "loss": loss.detach().numpy(),
        "probs": torch.softmax(logits, 1).detach().numpy(),
        "W_grad": w.grad.numpy(),
        "B_grad": b.grad.numpy(),
    }


# --------------------------------------------------------------------------------------- move_initializers_to_inputs
def test_move_initializers_to_inputs():
    model = _classifier()
    moved = move_initializers_to_inputs(model, ["s", "W", "B"])
    inputs = [
        (i.name, i.type.tensor_type.elem_type, [d.dim_value for d in i.type.tensor_type.shape.dim])
        for i in moved.graph.input
    ]
    # appended after the existing inputs, in initializer order (not in the order of `names`); 0-d stays 0-d
    assert inputs == [
        ("x", TensorProto.FLOAT, [4, 3]),
        ("label", TensorProto.INT64, [4]),
        ("W", TensorProto.FLOAT, [3, 2]),
        ("B", TensorProto.FLOAT, [2]),
        ("s", TensorProto.FLOAT, []),
    ]
    assert [i.name for i in moved.graph.initializer] == ["half"]
    assert len(model.graph.initializer) == 4 and len(model.graph.input) == 2  # the argument is untouched
    outputs = run_onnx_by_name(moved, {"x": X, "label": LABEL, "W": W0, "B": B0, "s": S0})
    np.testing.assert_allclose(outputs["loss"], _torch_reference()["loss"], rtol=1e-6)
    doubled = run_onnx_by_name(moved, {"x": X, "label": LABEL, "W": W0, "B": B0, "s": np.array(2 * S0)})
    assert not np.allclose(doubled["probs"], outputs["probs"])  # the moved state is really read from the input


def test_move_initializers_keeps_an_initializer_that_is_already_an_input():
    # Old-IR style: W is both an initializer and a graph input. Listing it twice is a duplicate definition.
    model = _classifier()
    model.graph.input.append(value_info("W", [3, 2]))
    moved = move_initializers_to_inputs(model, ["W", "B"])
    assert [i.name for i in moved.graph.input] == ["x", "label", "W", "B"]
    assert [i.name for i in moved.graph.initializer] == ["s", "half"]
    outputs = run_onnx_by_name(moved, {"x": X, "label": LABEL, "W": W0, "B": B0})
    np.testing.assert_allclose(outputs["loss"], _torch_reference()["loss"], rtol=1e-6)


def test_move_nothing_is_a_copy():
    model = _classifier()
    assert move_initializers_to_inputs(model, []) == model


# ----------------------------------------------------------------------------------------- build_ort_gradient_graph
@needs_training_build
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_match_torch_and_outputs_are_ordered(reduction):
    forward = name_optional_outputs(_classifier(reduction))
    graded = build_ort_gradient_graph(forward, "loss", ["B", "W"], ["W", "B", "s"])
    assert [o.name for o in graded.graph.output] == ["probs", "loss", "B_grad", "W_grad"]
    input_names = {i.name for i in graded.graph.input}
    assert {"x", "label", "W", "B", "s"} <= input_names and "half" not in input_names
    assert "s_grad" not in {o.name for o in graded.graph.output}  # frozen state gets no gradient
    got = run_onnx_by_name(graded, {"x": X, "label": LABEL, "W": W0, "B": B0, "s": S0})
    want = _torch_reference(reduction)
    for name in ("probs", "loss", "B_grad", "W_grad"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert forward.graph.initializer[0].name == "W" and len(forward.graph.input) == 2  # the argument is untouched


@needs_training_build
def test_state_is_fed_per_step():
    forward = name_optional_outputs(_classifier())
    graded = build_ort_gradient_graph(forward, "loss", ["W"], ["W", "B", "s"])
    assert [o.name for o in graded.graph.output] == ["probs", "loss", "W_grad"]
    session = ort.InferenceSession(graded.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": X, "label": LABEL, "W": W0, "B": B0, "s": S0}
    grad = session.run(["W_grad"], feeds)[0]
    grad_2s = session.run(["W_grad"], {**feeds, "s": np.array(2 * S0)})[0]
    w, s = torch.tensor(W0, requires_grad=True), 2 * float(S0)
    torch.nn.functional.cross_entropy(
        (torch.tensor(X) @ w + torch.tensor(B0)) * s * 0.5, torch.tensor(LABEL)
    ).backward()
    np.testing.assert_allclose(grad_2s, w.grad.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, _torch_reference()["W_grad"], rtol=1e-5, atol=1e-7)


@needs_training_build
def test_an_op_without_gradient_is_named_with_its_node():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
        helper.make_node("CumSum", ["h", "axis"], ["c"], name="running_total"),
        helper.make_node("ReduceSum", ["c"], ["loss"], name="total", keepdims=0),
    ]
    inits = [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(np.array(1, np.int64), "axis")]
    model = onnx_model(nodes, [value_info("x", [4, 3])], [value_info("loss", [])], inits)
    with pytest.raises(GradientBuildError, match=r"cannot differentiate op 'CumSum' \(node 'running_total'\)") as info:
        build_ort_gradient_graph(model, "loss", ["W"], ["W"])
    assert info.value.op_type == "CumSum"  # the trainer's 'auto' builder switches to the torch builder on this
    assert "'gradient_builder': 'torch'" in str(info.value)


@needs_training_build
def test_negative_log_likelihood_has_no_gradient():
    # Why postprocess fuses LogSoftmax + NegativeLogLikelihoodLoss into SoftmaxCrossEntropyLoss.
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
        helper.make_node("LogSoftmax", ["h"], ["log_prob"], name="log_softmax", axis=1),
        helper.make_node("NegativeLogLikelihoodLoss", ["log_prob", "label"], ["loss"], name="nll"),
    ]
    model = onnx_model(
        nodes,
        [value_info("x", [4, 3]), value_info("label", [4], TensorProto.INT64)],
        [value_info("loss", [])],
        [numpy_helper.from_array(W0, "W")],
    )
    with pytest.raises(GradientBuildError, match=r"op 'NegativeLogLikelihoodLoss' \(node 'nll'\)") as info:
        build_ort_gradient_graph(model, "loss", ["W"], ["W"])
    assert "frozen_weights" in str(info.value)


@needs_training_build
def test_a_parameter_that_does_not_reach_the_loss_is_reported():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
        helper.make_node("ReduceSum", ["h"], ["loss"], name="total", keepdims=0),
        helper.make_node("Add", ["x", "unused"], ["side"], name="side"),
    ]
    inits = [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(np.ones(3, np.float32), "unused")]
    model = onnx_model(nodes, [value_info("x", [4, 3])], [value_info("loss", []), value_info("side", [4, 3])], inits)
    with pytest.raises(GradientBuildError, match=r"parameters \['unused'\] have no differentiable path") as info:
        build_ort_gradient_graph(model, "loss", ["W", "unused"], ["W", "unused"])
    assert info.value.unreachable == ["unused"]  # the compiler freezes these and retries
    assert info.value.op_type is None


def test_other_builder_failures_keep_ort_message():
    model = name_optional_outputs(_classifier())
    with pytest.raises(GradientBuildError, match="could not build the gradient graph") as info:
        build_ort_gradient_graph(model, "not_a_tensor", ["W"], ["W"])
    assert isinstance(info.value.__cause__, Exception)


def test_output_order_and_missing_gradients():
    # The contract check behind build_ort_gradient_graph, on a hand-built "gradient model".
    nodes = [helper.make_node("Identity", ["x"], [name]) for name in ("B_grad", "loss", "W_grad", "probs", "extra")]
    model = onnx_model(
        nodes, [value_info("x", [2])], [value_info(n, [2]) for n in ("B_grad", "extra", "loss", "W_grad", "probs")]
    )
    ordered = _order_outputs(model, ["probs", "loss"], ["W", "B"])
    assert value_names(ordered.graph.output) == ["probs", "loss", "W_grad", "B_grad"]  # extra outputs are dropped
    with pytest.raises(GradientBuildError, match=r"produced no gradient for \['V_grad'\].*frozen_weights"):
        _order_outputs(model, ["loss"], ["W", "V"])
