"""Output selection (graph/outputs.py), the eval graph and the compile pipeline's pass lists
(graph/pipeline.py) on hand-built graphs, run in ONNX Runtime against numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import needs_training_build, onnx_model, run_onnx, value_info, value_names
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.outputs import keep_outputs, keep_outputs_pass, without_outputs, without_outputs_pass
from orttrainer.trainer.graph.passes import PassPreconditionError, run_passes
from orttrainer.trainer.graph.pipeline import (
    build_eval_model,
    forward_passes,
    gradient_model_passes,
    mixed_precision_passes,
)

FLOAT, HALF, INT64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64


# ---------------------------------------------------------------------------------------------------------- outputs
def _three_outputs() -> onnx.ModelProto:
    nodes = [helper.make_node(op, ["x"], [out]) for op, out in (("Neg", "a"), ("Relu", "b"), ("Abs", "c"))]
    return onnx_model(nodes, [value_info("x", [2])], [value_info(n, [2]) for n in ("a", "b", "c")])


def test_without_and_keep_outputs_select_graph_outputs_in_graph_order():
    model = _three_outputs()
    assert value_names(run_passes(model, [without_outputs_pass(["b"])], verify=True).graph.output) == ["a", "c"]
    assert value_names(run_passes(model, [keep_outputs_pass(["c", "a"])], verify=True).graph.output) == ["a", "c"]
    assert value_names(model.graph.output) == ["a", "b", "c"]  # the argument is untouched
    (c,) = run_onnx(keep_outputs(model, ["c"]), {"x": np.array([-1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(c, [1.0, 2.0])


def test_output_selection_precondition():
    with pytest.raises(PassPreconditionError, match=r"'without_outputs': outputs \['z'\] are missing from the graph"):
        without_outputs(_three_outputs(), ["a", "z"])
    with pytest.raises(PassPreconditionError, match=r"'keep_outputs': outputs \['h'\] are missing"):
        keep_outputs(_three_outputs(), ["h"])


# ------------------------------------------------------------------------------------------------------- eval graph
def _training_forward() -> onnx.ModelProto:
    """h = x @ W; d = Dropout(h, 0.5, training=True); y = BatchNorm(d) in training mode; outputs y and h."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Dropout", ["h", "ratio", "training"], ["d", "mask"], name="drop"),
        helper.make_node(
            "BatchNormalization", ["d", "s", "b", "m", "v"], ["y", "rm", "rv"], name="bn", training_mode=1
        ),
    ]
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "W"),
        numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
        numpy_helper.from_array(np.array(True), "training"),
        *(
            numpy_helper.from_array(np.array(v, np.float32), n)
            for n, v in (("s", [1.0, 2.0]), ("b", [0.5, -0.5]), ("m", [0.1, -0.2]), ("v", [4.0, 0.25]))
        ),
    ]
    return onnx_model(nodes, [value_info("x", [4, 3])], [value_info("y", [4, 2]), value_info("h", [4, 2])], inits)


def test_build_eval_model_feeds_state_disables_dropout_and_uses_running_statistics():
    forward = _training_forward()
    before = forward.SerializeToString()
    evaluation = build_eval_model(forward, ["W", "s", "b"], ["y"])
    assert forward.SerializeToString() == before
    assert value_names(evaluation.graph.input) == ["x", "W", "s", "b"] and value_names(evaluation.graph.output) == ["y"]
    assert [n.op_type for n in evaluation.graph.node] == ["MatMul", "Identity", "BatchNormalization"]
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((3, 2)).astype(np.float32)
    scale, bias = np.array([1.0, 2.0], np.float32), np.array([0.5, -0.5], np.float32)
    (y,) = run_onnx(evaluation, {"x": x, "W": w, "s": scale, "b": bias})
    expected = (x @ w - [0.1, -0.2]) / np.sqrt(np.array([4.0, 0.25]) + 1e-5) * scale + bias
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_build_eval_model_precondition():
    with pytest.raises(PassPreconditionError, match=r"'keep_outputs': outputs \['logits'\] are missing"):
        build_eval_model(_training_forward(), ["W"], ["y", "logits"])
    read_mask = _training_forward()
    read_mask.graph.output.append(value_info("mask", [4, 2], TensorProto.BOOL))
    with pytest.raises(PassPreconditionError, match="'dropout_to_identity': Dropout node 'drop': its mask output"):
        build_eval_model(read_mask, ["W"], ["y"])


# ------------------------------------------------------------------------------------------------ compile pass lists
def test_forward_and_mixed_precision_passes_prepare_the_gradient_builder_s_input():
    forward = _training_forward()
    loss = helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)
    forward.graph.node.append(loss)
    forward.graph.output.insert(0, value_info("loss", []))
    passes = [*forward_passes(dropout_off=True), *mixed_precision_passes(["W"], ["x", "W", "loss"], "loss")]
    assert [p.name for p in passes] == [
        "name_optional_outputs",
        "dropout_to_identity",
        "batchnorm_to_inference",
        "inference_batchnorm_to_affine",
        "move_initializers_to_inputs",
        "to_float16",
        "append_loss_scale",
    ]
    result = run_passes(forward, passes, verify=True)
    assert "BatchNormalization" not in {n.op_type for n in result.graph.node}  # affine, in float16
    assert value_names(result.graph.input) == ["x", "W", "loss_scale"]
    assert [o.type.tensor_type.elem_type for o in result.graph.output] == [FLOAT, HALF, HALF, FLOAT]
    assert [p.name for p in forward_passes(dropout_off=False)] == [
        "name_optional_outputs",
        "inference_dropout_to_identity",
        "inference_batchnorm_to_affine",
    ]


def _gradient_model() -> onnx.ModelProto:
    """What the gradient builder returns under mixed precision, reduced to the ops the passes touch: the loss, the
    scaled loss (an output only to seed the gradients), an embedding gradient and a float16 SliceGrad."""
    nodes = [
        helper.make_node("ReduceSum", ["dy"], ["loss"], keepdims=0),
        helper.make_node("Mul", ["loss", "loss_scale"], ["loss_scaled"]),
        helper.make_node("GatherGrad", ["table_shape", "ids", "dy"], ["E_grad"], domain="com.microsoft", name="gg"),
        helper.make_node("Cast", ["g32"], ["g"], to=HALF),
        helper.make_node("SliceGrad", ["g", "x_shape", "starts", "ends", "axes"], ["x_grad"], domain="com.microsoft"),
    ]
    inits = [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("table_shape", [5, 3]), ("x_shape", [6]), ("starts", [1]), ("ends", [4]), ("axes", [0]))
    ]
    inputs = [
        value_info("ids", [4], INT64),
        value_info("dy", [4, 3]),
        value_info("g32", [3]),
        value_info("loss_scale", []),
    ]
    outputs = [
        value_info("loss", []),
        value_info("loss_scaled", []),
        value_info("E_grad", [5, 3]),
        value_info("x_grad", [6], HALF),
    ]
    return onnx_model(nodes, inputs, outputs, inits, ms=True)


@needs_training_build
def test_gradient_model_passes_drop_the_scaled_loss_cast_cpu_kernels_and_scatter_embedding_gradients():
    model = _gradient_model()
    before = model.SerializeToString()
    passes = gradient_model_passes(mixed_precision=True, cpu=True, scaled_loss="loss_scaled")
    assert [p.name for p in passes] == [
        "without_outputs",
        "cast_fp32_only_kernels",
        "conv_grad_in_safe_form",
        "gather_grad_to_scatter_add",
        "where_sum_to_concat",
        "summed_uses_to_one",
        "drop_noop_reductions",
        "guard_class_labels",
    ]
    result = run_passes(model, passes, verify=True)
    assert model.SerializeToString() == before
    assert value_names(result.graph.output) == ["loss", "E_grad", "x_grad"]
    ops = [n.op_type for n in result.graph.node]
    assert "GatherGrad" not in ops and "ScatterND" in ops and ops.count("CastLike") == 2
    assert next(o.version for o in result.opset_import if o.domain == "") == 16
    rng = np.random.default_rng(0)
    feeds = {
        "ids": np.array([1, 4, 1, 0], np.int64),
        "dy": rng.standard_normal((4, 3)).astype(np.float32),
        "g32": np.array([1.0, 2.0, 3.0], np.float32),
        "loss_scale": np.array(8.0, np.float32),
    }
    loss, e_grad, x_grad = run_onnx(result, feeds)
    expected = np.zeros((5, 3), np.float32)
    np.add.at(expected, feeds["ids"], feeds["dy"])
    np.testing.assert_allclose(loss, feeds["dy"].sum(), rtol=1e-6)
    np.testing.assert_allclose(e_grad, expected, rtol=1e-6, atol=1e-6)
    assert x_grad.dtype == np.float16
    np.testing.assert_array_equal(x_grad, np.array([0, 1, 2, 3, 0, 0], np.float16))


def test_gradient_model_passes_without_mixed_precision_only_scatter():
    passes = gradient_model_passes(mixed_precision=False, cpu=True, scaled_loss="loss_scaled")
    assert [p.name for p in passes] == [  # CPU, float32
        "conv_grad_in_safe_form",
        "gather_grad_to_scatter_add",
        "where_sum_to_concat",
        "summed_uses_to_one",
        "drop_noop_reductions",
        "cross_entropy_as_plain_ops",
        "guard_class_labels",
    ]
    assert [p.name for p in gradient_model_passes(mixed_precision=True, cpu=False, scaled_loss="s")] == [
        "without_outputs",
        "gather_grad_to_scatter_add",
        "where_sum_to_concat",
        "summed_uses_to_one",
        "drop_noop_reductions",
        "guard_class_labels",
    ]
    result = run_passes(_gradient_model(), passes, verify=True)
    assert "loss_scaled" in value_names(result.graph.output) and "SliceGrad" in {n.op_type for n in result.graph.node}


def test_gradient_model_passes_precondition():
    passes = gradient_model_passes(mixed_precision=True, cpu=True, scaled_loss="not_an_output")
    with pytest.raises(PassPreconditionError, match=r"'without_outputs': outputs \['not_an_output'\] are missing"):
        run_passes(_gradient_model(), passes)
