"""The mixed-precision passes on hand-built graphs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from helpers import needs_training_build, onnx_model
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.mixed_precision import append_loss_scale, cast_fp32_only_kernels, to_float16

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16


def _mlp_loss():
    """logits = Relu(x @ W); loss = SoftmaxCrossEntropyLoss(logits, y); W is a graph input (a master weight)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss", "log_prob"]),
    ]
    return onnx_model(
        nodes,
        [
            helper.make_tensor_value_info("x", FLOAT, [4, 3]),
            helper.make_tensor_value_info("y", TensorProto.INT64, [4]),
            helper.make_tensor_value_info("W", FLOAT, [3, 5]),
        ],
        [helper.make_tensor_value_info("loss", FLOAT, []), helper.make_tensor_value_info("logits", FLOAT, [4, 5])],
        ms=True,
    )


def _types(model) -> dict[str, int]:
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    return {v.name: v.type.tensor_type.elem_type for v in values}


def _feeds():
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((4, 3)).astype(np.float32),
        "y": np.array([0, 1, 2, 3]),
        "W": rng.standard_normal((3, 5)).astype(np.float32),
    }


def test_to_float16_keeps_named_io_and_loss_ops_in_float32_and_computes_the_rest_in_float16():
    model = _mlp_loss()
    converted = to_float16(model, keep_float32=["x", "W", "loss"])
    types = _types(converted)
    assert (types["x"], types["W"], types["loss"], types["logits"]) == (FLOAT, FLOAT, FLOAT, HALF)
    matmul = next(n for n in converted.graph.node if n.op_type == "MatMul")
    sce = next(n for n in converted.graph.node if n.op_type == "SoftmaxCrossEntropyLoss")
    producers = {o: n for n in converted.graph.node for o in n.output}
    assert all(producers[i].op_type == "Cast" for i in matmul.input)  # fp32 inputs cast to fp16 for the MatMul
    assert producers[sce.input[0]].op_type == "Cast"  # and the loss op gets its logits back in fp32
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Relu", "SoftmaxCrossEntropyLoss"]  # untouched
    session = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    loss, logits = session.run(["loss", "logits"], _feeds())
    ref_loss, ref_logits = reference.run(["loss", "logits"], _feeds())
    assert logits.dtype == np.float16 and loss.dtype == np.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-3)
    np.testing.assert_allclose(logits, ref_logits, rtol=2e-3, atol=2e-3)


def test_append_loss_scale_multiplies_the_loss_by_a_new_float32_input():
    scaled_model, scaled, scale = append_loss_scale(_mlp_loss(), "loss")
    assert scale == "loss_scale" and scaled in [o.name for o in scaled_model.graph.output]
    session = ort.InferenceSession(scaled_model.SerializeToString(), providers=["CPUExecutionProvider"])
    loss, scaled_loss = session.run(["loss", scaled], {**_feeds(), "loss_scale": np.array(1024.0, np.float32)})
    np.testing.assert_allclose(scaled_loss, 1024.0 * loss, rtol=1e-6)


def test_append_loss_scale_picks_a_free_name():
    model = _mlp_loss()
    model.graph.input.append(helper.make_tensor_value_info("loss_scale", FLOAT, []))
    _, _, scale = append_loss_scale(model, "loss")
    assert scale != "loss_scale" and scale.startswith("loss_scale")


def _slice_grad_model(dtype: int):
    """A SliceGrad whose gradient input has `dtype`: the CPU kernel only implements float and double."""
    nodes = [
        helper.make_node("Cast", ["g32"], ["g"], to=dtype),
        helper.make_node(
            "SliceGrad", ["g", "shape", "starts", "ends", "axes"], ["dx"], domain="com.microsoft", name="slice_grad"
        ),
    ]
    inits = [
        numpy_helper.from_array(np.array([6], np.int64), "shape"),
        numpy_helper.from_array(np.array([1], np.int64), "starts"),
        numpy_helper.from_array(np.array([4], np.int64), "ends"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
    ]
    return onnx_model(
        nodes,
        [helper.make_tensor_value_info("g32", FLOAT, [3])],
        [helper.make_tensor_value_info("dx", dtype, [6])],
        inits,
        opset=15,
        ms=True,
    )


@needs_training_build
def test_cast_fp32_only_kernels_makes_a_float16_slice_grad_run_on_the_cpu():
    g = np.array([1.0, 2.0, 3.0], np.float32)
    broken = _slice_grad_model(HALF)
    try:
        ort.InferenceSession(broken.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"g32": g})
        raise AssertionError("expected ONNX Runtime's CPU SliceGrad to reject float16")
    except Exception as err:  # the failure this pass exists for
        assert "SliceGrad" in str(err)
    fixed = cast_fp32_only_kernels(broken)
    dx = ort.InferenceSession(fixed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"g32": g})[0]
    assert dx.dtype == np.float16
    np.testing.assert_array_equal(dx, np.array([0, 1, 2, 3, 0, 0], np.float16))


def test_cast_fp32_only_kernels_leaves_graphs_without_those_kernels_alone():
    model = _mlp_loss()
    assert cast_fp32_only_kernels(model) is model
