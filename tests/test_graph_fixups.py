"""Fix-up passes (fixups.py) on hand-built graphs: optional outputs, dropout off, BatchNorm to inference and to its
affine map."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import initializer, onnx_model, run_onnx, value_info
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.fixups import (
    batchnorm_to_inference,
    dropout_to_identity,
    inference_batchnorm_to_affine,
    inference_dropout_to_identity,
    name_optional_outputs,
    restore_dropout_training_mode,
)


# ------------------------------------------------------------------------------------------ name_optional_outputs
def _sce_model(outputs: list[str]) -> onnx.ModelProto:
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "y"], outputs, name="sce", reduction="sum")
    return onnx_model(
        [node], [value_info("x", [4, 3]), value_info("y", [4], TensorProto.INT64)], [value_info("loss", [])]
    )


def test_softmax_cross_entropy_gets_its_log_prob_output():
    model = _sce_model(["loss"])
    fixed = name_optional_outputs(model)
    assert list(fixed.graph.node[0].output) == ["loss", "loss__extra1"]
    assert list(model.graph.node[0].output) == ["loss"]  # the argument is untouched
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 3)).astype(np.float32), "y": np.array([0, 2, 1, 2], np.int64)}
    np.testing.assert_array_equal(run_onnx(fixed, feeds)[0], run_onnx(model, feeds)[0])


def test_empty_output_names_are_replaced_and_names_never_collide():
    # `loss__extra1` is already a graph tensor, so the fresh name takes a suffix.
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "y"], ["loss", ""], name="sce")
    taken = helper.make_node("Identity", ["x"], ["loss__extra1"], name="id")
    model = onnx_model(
        [taken, node],
        [value_info("x", [4, 3]), value_info("y", [4], TensorProto.INT64)],
        [value_info("loss", []), value_info("loss__extra1", [4, 3])],
    )
    fixed = name_optional_outputs(model)
    assert list(fixed.graph.node[1].output) == ["loss", "loss__extra1_1"]
    onnx.checker.check_model(fixed, full_check=True)


def test_layer_normalization_gets_mean_and_inv_std_dev_outputs():
    # LayerNormalization is a standard op from opset 17.
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y", "", ""], name="ln", axis=-1)
    model = onnx_model(
        [node],
        [value_info("x", [2, 3])],
        [value_info("y", [2, 3])],
        [initializer("scale", [1.0, 2.0, 3.0]), initializer("bias", [0.0, 0.5, -1.0])],
        opset=17,
    )
    fixed = name_optional_outputs(model)
    assert list(fixed.graph.node[0].output) == ["y", "y__extra1", "y__extra2"]
    x = np.array([[1.0, 2.0, 4.0], [-1.0, 0.0, 3.0]], np.float32)
    normalised = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(
        run_onnx(fixed, {"x": x})[0], normalised * [1.0, 2.0, 3.0] + [0.0, 0.5, -1.0], rtol=1e-5, atol=1e-6
    )


def test_layer_normalization_with_one_missing_output_keeps_the_named_one():
    node = helper.make_node("LayerNormalization", ["x", "scale"], ["y", "mean"], name="ln")
    model = onnx_model(
        [node], [value_info("x", [2, 3])], [value_info("y", [2, 3])], [initializer("scale", [1.0, 1.0, 1.0])], opset=17
    )
    assert list(name_optional_outputs(model).graph.node[0].output) == ["y", "mean", "y__extra2"]


def test_dropout_gets_its_mask_output_and_other_ops_are_untouched():
    nodes = [
        helper.make_node("Dropout", ["x"], ["d"], name="drop"),
        helper.make_node("Softmax", ["d"], ["y"], name="softmax"),
        helper.make_node("SoftmaxCrossEntropyLoss", ["x", "lbl"], ["custom"], domain="my.domain"),
    ]
    model = onnx_model(nodes, [value_info("x", [2, 3])], [value_info("y", [2, 3])])
    fixed = name_optional_outputs(model)
    assert [list(n.output) for n in fixed.graph.node] == [["d", "d__extra1"], ["y"], ["custom"]]


def test_complete_nodes_are_unchanged():
    model = _sce_model(["loss", "log_prob"])
    assert name_optional_outputs(model) == model


# -------------------------------------------------------------------------------------------- dropout_to_identity
def _dropout_model(outputs: list[str], extra_nodes=(), graph_outputs=("y",)) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Dropout", ["x", "ratio", "training"], outputs, name="drop", seed=3),
        helper.make_node("Mul", [outputs[0], "two"], ["y"], name="mul"),
        *extra_nodes,
    ]
    inits = [initializer("ratio", 0.5), initializer("training", True, dtype=np.bool_), initializer("two", 2.0)]
    return onnx_model(nodes, [value_info("x", [64])], [value_info(n, None) for n in graph_outputs], inits)


@pytest.mark.parametrize("outputs", [["d"], ["d", ""], ["d", "mask"]])
def test_dropout_becomes_identity(outputs):
    model = _dropout_model(outputs)
    fixed = dropout_to_identity(model)
    node = fixed.graph.node[0]
    assert (node.op_type, list(node.input), list(node.output), node.name) == ("Identity", ["x"], ["d"], "drop")
    assert not node.attribute
    assert model.graph.node[0].op_type == "Dropout"  # the argument is untouched
    x = np.linspace(1.0, 2.0, 64, dtype=np.float32)
    (y,) = run_onnx(fixed, {"x": x})
    np.testing.assert_array_equal(y, 2.0 * x)
    (train_y,) = run_onnx(model, {"x": x})  # the original really drops: half of the values are zero
    assert 0 < np.count_nonzero(train_y == 0) < 64


def test_dropout_whose_mask_is_consumed_is_rejected():
    mask_user = helper.make_node("Cast", ["mask"], ["mask_f"], name="use_mask", to=TensorProto.FLOAT)
    model = _dropout_model(["d", "mask"], [mask_user])
    with pytest.raises(ValueError, match="Dropout node 'drop': its mask output 'mask' is used"):
        dropout_to_identity(model)


def test_dropout_whose_mask_is_a_graph_output_is_rejected():
    model = _dropout_model(["d", "mask"], graph_outputs=("y", "mask"))
    with pytest.raises(ValueError, match="'mask' is used"):
        dropout_to_identity(model)


def _dropout_pair() -> onnx.ModelProto:
    """`a = Dropout(x, ratio)` (no training mode: the identity) and `b = Dropout(x, ratio, training)`."""
    nodes = [
        helper.make_node("Dropout", ["x", "ratio"], ["a", "a_mask"], name="inference"),
        helper.make_node("Dropout", ["x", "ratio", "training"], ["b", "b_mask"], name="training"),
    ]
    inits = [initializer("ratio", 0.5), initializer("training", True, dtype=np.bool_)]
    return onnx_model(nodes, [value_info("x", [64])], [value_info("a"), value_info("b")], inits)


def test_a_dropout_without_training_mode_gets_a_true_one_after_a_pytorch_training_export():
    model = _dropout_pair()
    fixed = restore_dropout_training_mode(model)
    flag = fixed.graph.node[0].input[2]
    assert numpy_helper.to_array(next(i for i in fixed.graph.initializer if i.name == flag)) == np.array(True)
    assert list(fixed.graph.node[1].input) == ["x", "ratio", "training"] and len(model.graph.node[0].input) == 2
    a, b = run_onnx(fixed, {"x": np.ones(64, np.float32)})
    assert 0 < np.count_nonzero(a == 0) < 64  # now really drops, as PyTorch does in training
    assert restore_dropout_training_mode(fixed) is fixed


def test_a_dropout_without_training_mode_becomes_the_identity_it_computes():
    fixed = inference_dropout_to_identity(_dropout_pair())
    assert [n.op_type for n in fixed.graph.node] == ["Identity", "Dropout"]
    fixed = inference_dropout_to_identity(fixed)
    assert [n.op_type for n in fixed.graph.node] == ["Identity", "Dropout"]


# ----------------------------------------------------------------------------------------- batchnorm_to_inference
def _batchnorm_model() -> onnx.ModelProto:
    node = helper.make_node(
        "BatchNormalization",
        ["x", "scale", "bias", "mean", "var"],
        ["y", "running_mean", "running_var"],
        name="bn",
        training_mode=1,
        epsilon=1e-3,
        momentum=0.8,
    )
    inits = [
        initializer("scale", [1.0, 2.0]),
        initializer("bias", [0.5, -0.5]),
        initializer("mean", [1.0, -1.0]),
        initializer("var", [4.0, 0.25]),
    ]
    return onnx_model([node], [value_info("x", [3, 2, 2])], [value_info("y", [3, 2, 2])], inits)


def test_batchnorm_uses_running_statistics():
    model = _batchnorm_model()
    fixed = batchnorm_to_inference(model)
    node = fixed.graph.node[0]
    assert list(node.output) == ["y"]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == {
        "epsilon": pytest.approx(1e-3),
        "momentum": pytest.approx(0.8),
    }
    assert len(model.graph.node[0].output) == 3  # the argument is untouched
    onnx.checker.check_model(fixed, full_check=True)
    x = np.arange(12, dtype=np.float32).reshape(3, 2, 2) / 4.0
    shape = (1, 2, 1)
    expected = (x - np.reshape([1.0, -1.0], shape)) / np.sqrt(np.reshape([4.0, 0.25], shape) + 1e-3) * np.reshape(
        [1.0, 2.0], shape
    ) + np.reshape([0.5, -0.5], shape)
    np.testing.assert_allclose(run_onnx(fixed, {"x": x})[0], expected, rtol=1e-6, atol=1e-6)
    batch_stats = run_onnx(model, {"x": x}, ["y"])[0]  # training mode normalises with the batch statistics instead
    assert np.abs(batch_stats - expected).max() > 0.1


def test_inference_batchnorm_is_unchanged():
    model = _batchnorm_model()
    node = model.graph.node[0]
    del node.output[1:]
    del node.attribute[:]
    assert batchnorm_to_inference(model) == model


# ---------------------------------------------------------------------------------- inference_batchnorm_to_affine
def _inference_batchnorm_model(shape: list) -> onnx.ModelProto:
    """x -> BatchNormalization (inference: no training_mode, one output) -> Relu, with a dynamic batch dim."""
    bn = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"], name="bn", epsilon=1e-3)
    relu = helper.make_node("Relu", ["y"], ["out"], name="relu")
    inits = [
        initializer("scale", [1.0, 2.0]),
        initializer("bias", [0.5, -0.5]),
        initializer("mean", [1.0, -1.0]),
        initializer("var", [4.0, 0.25]),
    ]
    return onnx_model([bn, relu], [value_info("x", ["N", *shape])], [value_info("out", ["N", *shape])], inits)


@pytest.mark.parametrize("shape", [[2], [2, 3], [2, 3, 2]], ids=["rank2", "rank3", "rank4"])
def test_inference_batchnorm_becomes_its_affine_map(shape):
    model = _inference_batchnorm_model(shape)
    fixed = inference_batchnorm_to_affine(model)
    onnx.checker.check_model(fixed, full_check=True)
    ops = [n.op_type for n in fixed.graph.node]
    assert "BatchNormalization" not in ops and ops[-1] == "Relu"  # still in topological order
    assert ops.count("Reshape") == 3 and "Sqrt" in ops and "Div" in ops
    assert [n.op_type for n in model.graph.node] == ["BatchNormalization", "Relu"]  # the argument is untouched
    x = np.random.default_rng(0).normal(size=(5, *shape)).astype(np.float32) * 3
    expected = run_onnx(model, {"x": x})[0]  # ONNX Runtime's own inference BatchNormalization
    np.testing.assert_allclose(run_onnx(fixed, {"x": x})[0], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(run_onnx(fixed, {"x": x[:2]})[0], expected[:2], rtol=1e-6, atol=1e-6)  # another batch


def test_training_batchnorm_is_not_made_affine():
    model = _batchnorm_model()
    assert inference_batchnorm_to_affine(model) == model
    explicit = _batchnorm_model()
    for attribute in explicit.graph.node[0].attribute:
        if attribute.name == "training_mode":
            attribute.i = 0
    del explicit.graph.node[0].output[1:]
    assert "BatchNormalization" not in [n.op_type for n in inference_batchnorm_to_affine(explicit).graph.node]
