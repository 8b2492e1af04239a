"""Legacy post-processing passes (postprocess.py) on hand-built graphs: node naming and LogSoftmax+NLL fusion."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import onnx_model, run_onnx, value_info
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.postprocess import fuse_log_softmax_nll, name_nodes, run_postprocess


def _op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# ------------------------------------------------------------------------------------------------------ name_nodes
def test_name_nodes_keeps_names_and_names_unnamed_nodes_uniquely():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),  # Relu_0 and Relu_0_1 are taken: Relu_0_2
        helper.make_node("Relu", ["a"], ["b"], name="Relu_0"),
        helper.make_node("Relu", ["b"], ["c"]),  # Relu_2
        helper.make_node("Neg", ["c"], ["d"], name="/encoder/neg"),  # exporter scope names are kept
        helper.make_node("Relu", ["d"], ["e"], name="Relu_4"),
        helper.make_node("Relu", ["e"], ["f"]),  # Relu_5
        helper.make_node("Relu", ["f"], ["g"]),  # Relu_6
        helper.make_node("Relu", ["g"], ["y"], name="Relu_0_1"),
    ]
    model = onnx_model(nodes, [value_info("x", [2])], [value_info("y", [2])])
    named = name_nodes(model)
    assert [n.name for n in named.graph.node] == [
        "Relu_0_2",
        "Relu_0",
        "Relu_2",
        "/encoder/neg",
        "Relu_4",
        "Relu_5",
        "Relu_6",
        "Relu_0_1",
    ]
    assert model.graph.node[0].name == ""  # the argument is untouched
    assert name_nodes(named) == named


# ---------------------------------------------------------------------------------------------- fuse_log_softmax_nll
def _nll_model(
    shape: tuple[int, ...],
    axis: int | None = 1,
    *,
    reduction: str | None = None,
    ignore_index: int | None = None,
    weight: bool = False,
    extra_consumer: bool = False,
    log_prob_output: bool = False,
    opset: int = 14,
) -> onnx.ModelProto:
    """loss = NLL(LogSoftmax(x @ 1 + 0), label): the logits come from a node so the fused op's input is produced."""
    n, c, *rest = shape
    axis_attr = {} if axis is None else {"axis": axis}
    nll_attrs = {k: v for k, v in (("reduction", reduction), ("ignore_index", ignore_index)) if v is not None}
    nodes = [
        helper.make_node("Mul", ["x", "one"], ["logits"], name="scale"),
        helper.make_node("LogSoftmax", ["logits"], ["log_prob"], name="log_softmax", **axis_attr),
        helper.make_node(
            "NegativeLogLikelihoodLoss",
            ["log_prob", "label"] + (["w"] if weight else []),
            ["loss"],
            name="nll",
            **nll_attrs,
        ),
    ]
    outputs = [value_info("loss", [n, *rest] if reduction == "none" else [])]
    if extra_consumer:
        nodes.append(helper.make_node("Exp", ["log_prob"], ["prob"], name="exp"))
        outputs.append(value_info("prob", None))
    if log_prob_output:
        outputs.append(value_info("log_prob", list(shape)))
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    if weight:
        inits.append(numpy_helper.from_array(np.linspace(0.5, 2.0, c, dtype=np.float32), "w"))
    inputs = [value_info("x", list(shape)), value_info("label", [n, *rest], TensorProto.INT64)]
    return onnx_model(nodes, inputs, outputs, inits, opset)


def _feeds(shape: tuple[int, ...], ignore_index: int | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    n, c, *rest = shape
    label = rng.integers(0, c, (n, *rest))
    if ignore_index is not None:
        label.flat[::3] = ignore_index
    return {"x": (3 * rng.standard_normal(shape)).astype(np.float32), "label": label.astype(np.int64)}


def _assert_same_outputs(model: onnx.ModelProto, fused: onnx.ModelProto, feeds: dict) -> None:
    names = [o.name for o in model.graph.output]
    assert [o.name for o in fused.graph.output] == names
    for want, got in zip(run_onnx(model, feeds, names), run_onnx(fused, feeds, names), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("shape", "axis", "reduction", "ignore_index", "weight"),
    [
        ((5, 4), 1, None, None, False),  # default reduction: mean
        ((5, 4), -1, "sum", None, False),  # -1 is the class axis of 2-D logits
        ((5, 4), 1, "none", 2, True),
        ((5, 4), None, "mean", 1, True),  # opset 13+ default axis is -1
        ((3, 4, 6), 1, "mean", 3, True),  # N, C, d1: the class axis is still 1
        ((3, 4, 2, 2), 1, "none", None, False),
    ],
)
def test_log_softmax_nll_becomes_softmax_cross_entropy(shape, axis, reduction, ignore_index, weight):
    model = _nll_model(shape, axis, reduction=reduction, ignore_index=ignore_index, weight=weight)
    fused = fuse_log_softmax_nll(model)
    assert _op_types(fused) == ["Mul", "SoftmaxCrossEntropyLoss"]
    node = fused.graph.node[1]
    assert list(node.input) == ["logits", "label"] + (["w"] if weight else [])
    assert list(node.output) == ["loss", "log_prob"]
    assert node.name == "nll_fused_softmax_cross_entropy"
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    expected = {}
    if reduction is not None:
        expected["reduction"] = reduction.encode()
    if ignore_index is not None:
        expected["ignore_index"] = ignore_index
    assert attrs == expected
    assert _op_types(model) == ["Mul", "LogSoftmax", "NegativeLogLikelihoodLoss"]  # the argument is untouched
    onnx.checker.check_model(fused, full_check=True)
    _assert_same_outputs(model, fused, _feeds(shape, ignore_index))


def test_log_prob_graph_output_keeps_its_name_and_value():
    model = _nll_model((5, 4), 1, reduction="sum", log_prob_output=True)
    fused = fuse_log_softmax_nll(model)
    assert _op_types(fused) == ["Mul", "SoftmaxCrossEntropyLoss"]
    _assert_same_outputs(model, fused, _feeds((5, 4)))


@pytest.mark.parametrize(
    ("shape", "axis", "opset"),
    [
        ((3, 4, 6), -1, 14),  # the last axis of 3-D logits is not the class axis
        ((3, 4, 6), 2, 14),
        ((5, 4), 0, 14),
        ((3, 4, 6), 1, 12),  # LogSoftmax-11 flattens from axis 1 on: a softmax over C*d1 values, not over C
        ((3, 4, 6), None, 12),  # default axis 1, same
    ],
)
def test_no_fusion_when_the_softmax_axis_is_not_the_class_axis(shape, axis, opset):
    model = _nll_model(shape, axis, opset=opset)
    fused = fuse_log_softmax_nll(model)
    assert fused == model
    if axis != 0:  # NLL rejects the other layouts at run time anyway
        run_onnx(fused, _feeds(shape))


@pytest.mark.parametrize("axis", [1, -1, None])
def test_opset_12_fuses_2d_logits(axis):
    model = _nll_model((5, 4), axis, reduction="sum", opset=12)
    fused = fuse_log_softmax_nll(model)
    assert _op_types(fused) == ["Mul", "SoftmaxCrossEntropyLoss"]
    _assert_same_outputs(model, fused, _feeds((5, 4)))


def test_no_fusion_when_log_probs_have_another_consumer():
    model = _nll_model((5, 4), 1, extra_consumer=True)
    assert fuse_log_softmax_nll(model) == model


def test_no_fusion_without_log_softmax_producer():
    nodes = [
        helper.make_node("Identity", ["x"], ["log_prob"], name="id"),
        helper.make_node("NegativeLogLikelihoodLoss", ["log_prob", "label"], ["loss"], name="nll"),
    ]
    model = onnx_model(
        nodes, [value_info("x", [5, 4]), value_info("label", [5], TensorProto.INT64)], [value_info("loss", None)]
    )
    assert fuse_log_softmax_nll(model) == model


def test_two_losses_are_both_fused_and_stay_in_topological_order():
    nodes = [
        helper.make_node("LogSoftmax", ["x"], ["lp_a"], axis=1, name="ls_a"),
        helper.make_node("LogSoftmax", ["x"], ["lp_b"], axis=-1, name="ls_b"),
        helper.make_node("NegativeLogLikelihoodLoss", ["lp_a", "label"], ["loss_a"], name="nll_a"),
        helper.make_node("NegativeLogLikelihoodLoss", ["lp_b", "label"], ["loss_b"], name="nll_b", reduction="sum"),
        helper.make_node("Add", ["loss_a", "loss_b"], ["loss"], name="add"),
    ]
    model = onnx_model(
        nodes, [value_info("x", [5, 4]), value_info("label", [5], TensorProto.INT64)], [value_info("loss", [])]
    )
    fused = fuse_log_softmax_nll(model)
    assert [n.name for n in fused.graph.node] == [
        "nll_a_fused_softmax_cross_entropy",
        "nll_b_fused_softmax_cross_entropy",
        "add",
    ]
    onnx.checker.check_model(fused, full_check=True)
    _assert_same_outputs(model, fused, _feeds((5, 4)))


def test_run_postprocess_names_nodes_then_fuses():
    model = _nll_model((5, 4), 1, reduction="mean")
    for node in model.graph.node:
        node.name = ""
    processed = run_postprocess(model)
    assert [(n.op_type, n.name) for n in processed.graph.node] == [
        ("Mul", "Mul_0"),
        ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss_2_fused_softmax_cross_entropy"),
    ]
    _assert_same_outputs(model, processed, _feeds((5, 4)))
