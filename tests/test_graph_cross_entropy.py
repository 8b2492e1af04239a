"""cross_entropy_as_plain_ops on hand-built graphs: the loss and its gradient equal ONNX Runtime's fused kernels for
every reduction, with ignored labels and extra dimensions; cases outside the rule are left unchanged."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from helpers import needs_training_build, run_onnx
from onnx import TensorProto, helper

from orttrainer.trainer.graph.cross_entropy import CROSS_ENTROPY_AS_PLAIN_OPS, cross_entropy_as_plain_ops
from orttrainer.trainer.graph.passes import run_passes


def _model(scores_shape, reduction="mean", ignore_index=None, opset=14, loss_type=TensorProto.FLOAT, weights=False):
    labels_shape = [scores_shape[0], *scores_shape[2:]]
    attrs = {"reduction": reduction, **({"ignore_index": ignore_index} if ignore_index is not None else {})}
    extra = ["w"] if weights else []
    nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", ["x", "y", *extra], ["loss", "log_prob"], name="ce", **attrs),
        helper.make_node(
            "SoftmaxCrossEntropyLossGrad",
            ["dloss", "log_prob", "y", *extra],
            ["dx"],
            name="ce_grad",
            domain="com.microsoft",
            **attrs,
        ),
    ]
    loss_shape = labels_shape if reduction == "none" else []
    inputs = [
        helper.make_tensor_value_info("x", loss_type, scores_shape),
        helper.make_tensor_value_info("y", TensorProto.INT64, labels_shape),
        helper.make_tensor_value_info("dloss", loss_type, loss_shape),
    ]
    if weights:
        inputs.append(helper.make_tensor_value_info("w", loss_type, [scores_shape[1]]))
    outputs = [
        helper.make_tensor_value_info("loss", loss_type, loss_shape),
        helper.make_tensor_value_info("dx", loss_type, scores_shape),
    ]
    graph = helper.make_graph(nodes, "ce", inputs, outputs)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _run(model, scores_shape, reduction, ignore_index=None, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, scores_shape[1], [scores_shape[0], *scores_shape[2:]])
    if ignore_index is not None:
        labels.reshape(-1)[::3] = ignore_index  # a third of the labels are ignored
    loss_shape = labels.shape if reduction == "none" else ()
    feeds = {
        "x": rng.standard_normal(scores_shape).astype(np.float32) * 3,
        "y": labels.astype(np.int64),
        "dloss": np.asarray(rng.standard_normal(loss_shape) + 2, dtype=np.float32),
    }
    return run_onnx(model, feeds, ["loss", "dx"])


@needs_training_build
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, -100])
@pytest.mark.parametrize("shape", [[32, 10], [4, 7, 5]])
def test_plain_ops_equal_the_fused_kernels(reduction, ignore_index, shape):
    model = _model(shape, reduction, ignore_index)
    rewritten = run_passes(model, [CROSS_ENTROPY_AS_PLAIN_OPS], verify=True)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "SoftmaxCrossEntropyLoss" not in ops and "SoftmaxCrossEntropyLossGrad" not in ops
    assert {"LogSoftmax", "NegativeLogLikelihoodLoss", "ScatterElements"} <= set(ops)
    assert next(o.version for o in rewritten.opset_import if o.domain == "") == 16
    expected = _run(model, shape, reduction, ignore_index)
    actual = _run(rewritten, shape, reduction, ignore_index)
    for e, a in zip(expected, actual, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)


@needs_training_build
def test_all_labels_ignored_gives_the_kernels_values():
    shape = [6, 4]
    model = _model(shape, "sum", ignore_index=3)
    rewritten = cross_entropy_as_plain_ops(model)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    feeds = {"x": x, "y": np.full(6, 3, np.int64), "dloss": np.array(1, np.float32)}
    runs = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        for m in (model, rewritten)
    ]
    for e, a in zip(*runs, strict=True):
        np.testing.assert_allclose(a, e, atol=1e-7)


@pytest.mark.parametrize(
    "model",
    [
        _model([8, 5], weights=True),  # class weights: not rewritten
        _model([8, 5], opset=13),  # the opset cannot be raised to 16 safely
        _model([8, 5], loss_type=TensorProto.DOUBLE),  # not float32
    ],
)
def test_cases_outside_the_rule_are_left_unchanged(model):
    assert cross_entropy_as_plain_ops(model) is model


def test_log_probabilities_read_elsewhere_are_left_unchanged():
    model = _model([8, 5])
    model.graph.output.append(helper.make_tensor_value_info("log_prob", TensorProto.FLOAT, [8, 5]))
    assert cross_entropy_as_plain_ops(model) is model


def test_the_argument_is_not_modified():
    model = _model([8, 5])
    before = model.SerializeToString()
    cross_entropy_as_plain_ops(model)
    assert model.SerializeToString() == before
