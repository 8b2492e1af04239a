"""graph/nchwc.py on hand-built graphs, and its use when a session is created (runtime/ort.create_session): a
convolution whose weight is a graph input runs in ONNX Runtime's blocked layout with the same values; what the rule
does not cover is left as it is."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import onnx_model, run_onnx, value_info
from onnx import TensorProto, helper

from orttrainer.trainer.graph.nchwc import NCHWC_DOMAIN, blocked_convolutions
from orttrainer.trainer.graph.passes import REWRITES_ENVIRONMENT_VARIABLE
from orttrainer.trainer.runtime.ort import Device, create_session, nchwc_block

BLOCK = nchwc_block()
needs_nchwc = pytest.mark.skipif(BLOCK is None, reason="ONNX Runtime has no NCHWc kernels on this CPU")


def _conv_model(
    channels=16, out_channels=32, kernel=(3, 3), bias=False, elem=TensorProto.FLOAT, op="Conv", **attributes
):
    """`y = op(x, w[, b])` with x [2, channels, 9, 9] (or rank 3 for a 1-D kernel) and w a graph input: a `Conv`
    (w [out_channels, channels, k...]) or a `ConvTranspose` (w [channels, out_channels, k...])."""
    spatial = [9] * len(kernel)
    weight = [out_channels, channels] if op == "Conv" else [channels, out_channels]
    inputs = [value_info("x", [2, channels, *spatial], elem), value_info("w", [*weight, *kernel], elem)]
    names = ["x", "w"]
    if bias:
        inputs.append(value_info("b", [out_channels], elem))
        names.append("b")
    node = helper.make_node(op, names, ["y"], **attributes)
    return onnx_model([node], inputs, [value_info("y", None, elem)], opset=17)


def _feeds(model):
    rng = np.random.default_rng(0)
    return {
        v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
        for v in model.graph.input
    }


@needs_nchwc
@pytest.mark.parametrize(
    "attributes",
    [
        {"pads": [1, 1, 1, 1]},
        {"pads": [1, 1, 1, 1], "strides": [2, 2]},
        {"pads": [2, 2, 2, 2], "dilations": [2, 2]},
        {"kernel_shape": [1, 1]},
        {"pads": [0, 1, 2, 1], "bias": True},
    ],
)
def test_a_convolution_runs_blocked_with_the_same_values(attributes):
    attributes = dict(attributes)
    bias = attributes.pop("bias", False)
    kernel = tuple(attributes.get("kernel_shape", (3, 3)))
    model = _conv_model(kernel=kernel, bias=bias, **attributes)
    blocked = blocked_convolutions(model, BLOCK)
    assert [(n.domain, n.op_type) for n in blocked.graph.node if n.domain] == [
        (NCHWC_DOMAIN, "ReorderInput"),
        (NCHWC_DOMAIN, "Conv"),
        (NCHWC_DOMAIN, "ReorderOutput"),
    ]
    feeds = _feeds(model)
    np.testing.assert_allclose(run_onnx(blocked, feeds)[0], run_onnx(model, feeds)[0], rtol=1e-5, atol=1e-5)


@needs_nchwc
@pytest.mark.parametrize(
    "attributes",
    [
        {"pads": [1, 1, 1, 1]},
        {},
        {"pads": [2, 2, 2, 2], "dilations": [2, 2]},
        {"pads": [0, 1, 2, 1], "bias": True},
        {"kernel_shape": [1, 1]},
    ],
)
def test_a_stride_one_transposed_convolution_runs_as_a_blocked_convolution(attributes):
    attributes = dict(attributes)
    bias = attributes.pop("bias", False)
    kernel = tuple(attributes.get("kernel_shape", (3, 3)))
    model = _conv_model(kernel=kernel, bias=bias, op="ConvTranspose", **attributes)
    blocked = blocked_convolutions(model, BLOCK)
    assert (NCHWC_DOMAIN, "Conv") in {(n.domain, n.op_type) for n in blocked.graph.node}
    assert "ConvTranspose" not in {n.op_type for n in blocked.graph.node}
    feeds = _feeds(model)
    np.testing.assert_allclose(run_onnx(blocked, feeds)[0], run_onnx(model, feeds)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "model",
    [
        _conv_model(op="ConvTranspose", strides=[2, 2]),
        _conv_model(op="ConvTranspose", pads=[1, 1, 1, 1], output_padding=[1, 1]),
        _conv_model(op="ConvTranspose", group=2),
        _conv_model(op="ConvTranspose", output_shape=[11, 11]),
        _conv_model(op="ConvTranspose", pads=[3, 3, 3, 3]),  # beyond the kernel's reach: a crop, not a convolution
        _conv_model(op="ConvTranspose", channels=3),
        _conv_model(group=2),
        _conv_model(channels=3),  # channels that are not whole blocks (an image's RGB)
        _conv_model(out_channels=12),
        _conv_model(kernel=(3,)),  # 1-D: the blocked kernels are 2-D
        _conv_model(elem=TensorProto.FLOAT16),
        _conv_model(auto_pad="SAME_UPPER"),
    ],
)
def test_other_convolutions_are_left_as_they_are(model):
    assert blocked_convolutions(model, 8) is model


def test_a_weight_of_unknown_shape_is_left_as_it_is():
    model = _conv_model()
    model.graph.input[1].type.tensor_type.ClearField("shape")
    assert blocked_convolutions(model, 8) is model


def _session_ops(tmp_path, monkeypatch, disabled="", level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    monkeypatch.setenv(REWRITES_ENVIRONMENT_VARIABLE, disabled)
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    path = os.path.join(tmp_path, f"optimized_{disabled or 'all'}_{int(level)}.onnx")
    model = _conv_model(pads=[1, 1, 1, 1])
    session = create_session(model, options, [("CPUExecutionProvider", {})], Device.parse("cpu"), path)
    feeds = _feeds(model)
    np.testing.assert_allclose(session.run(None, feeds)[0], run_onnx(model, feeds)[0], rtol=1e-5, atol=1e-5)
    return {(n.domain, n.op_type) for n in onnx.load(path).graph.node}


def test_sessions_run_convolutions_blocked_unless_switched_off(tmp_path, monkeypatch):
    blocked = (NCHWC_DOMAIN, "Conv")
    assert (blocked in _session_ops(tmp_path, monkeypatch)) == (BLOCK is not None)
    assert blocked not in _session_ops(tmp_path, monkeypatch, disabled="blocked_convolutions")
    # below ONNX Runtime's ALL level its own layout passes are off, and so is this one
    assert blocked not in _session_ops(tmp_path, monkeypatch, level=ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)


def test_the_block_is_onnx_runtime_s():
    assert BLOCK in (None, 8, 16)
