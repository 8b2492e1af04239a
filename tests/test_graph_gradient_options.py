"""The configured `ort` gradient builder (gradient_options.py) on hand-built graphs: cast propagation strategies,
levels and allow lists, memory-efficient gradients, and the gradient contract."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import needs_training_build
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.gradient.ort_builder import build_ort_gradient_graph
from orttrainer.trainer.gradient.ort_options import GradientOptions, pre_gradient_model
from orttrainer.trainer.graph.state_inputs import move_initializers_to_inputs

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
WEIGHTS = ["W0", "W1", "b"]


def _amp_graph() -> onnx.ModelProto:
    """An AMP-style graph: one float16 island (`gemm1`) in float32 compute.

    x -> relu0 -> tanh0 -> gemm0(W0) -> relu1 -> [Cast16 -> gemm1(W1) -> Cast32] -> tanh1 -> sigmoid -> add(b) -> loss
    """
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32) * 0.3, w) for w in ("W0", "W1")]
    inits.append(numpy_helper.from_array(np.full(8, 0.1, np.float32), "b"))
    node = helper.make_node
    nodes = [
        node("Relu", ["x"], ["r0"], name="relu0"),
        node("Tanh", ["r0"], ["t0"], name="tanh0"),
        node("Gemm", ["t0", "W0"], ["g0"], name="gemm0"),
        node("Relu", ["g0"], ["r1"], name="relu1"),
        node("Cast", ["r1"], ["r1_16"], name="cast_in", to=HALF),
        node("Cast", ["W1"], ["w1_16"], name="cast_w", to=HALF),
        node("Gemm", ["r1_16", "w1_16"], ["g1_16"], name="gemm1"),
        node("Cast", ["g1_16"], ["g1"], name="cast_out", to=FLOAT),
        node("Tanh", ["g1"], ["t1"], name="tanh1"),
        node("Sigmoid", ["t1"], ["s1"], name="sigmoid"),
        node("Add", ["s1", "b"], ["logits"], name="add"),
        node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss", "log_prob"], name="loss"),
    ]
    graph = helper.make_graph(
        nodes,
        "amp",
        [helper.make_tensor_value_info("x", FLOAT, [4, 8]), helper.make_tensor_value_info("y", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("loss", FLOAT, [])],
        inits,
    )
    opsets = [helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _float16_ops(model: onnx.ModelProto) -> set[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(inferred.graph.value_info) + list(inferred.graph.input)}
    return {n.name for n in inferred.graph.node if n.op_type != "Cast" and types.get(n.output[0]) == HALF}


# (strategy, level, allow) -> (Cast nodes, ops computed in float16), measured on onnxruntime-training 1.19.2
CASES = [
    (("NONE", 1, ()), 3, {"gemm1"}),
    (("FLOOD_FILL", -1, ()), 3, {"gemm1"}),  # level -1: off
    (("FLOOD_FILL", 0, ()), 3, {"gemm1"}),  # level 0: only `allow`, empty here
    (("FLOOD_FILL", 1, ()), 3, {"relu1", "gemm1", "tanh1"}),  # the casts move across Relu/Tanh (level 1 ops)
    (("FLOOD_FILL", 1, ("Sigmoid",)), 3, {"relu1", "gemm1", "tanh1", "sigmoid"}),  # plus the allowed Sigmoid
    # Add is a level-2 op; its float32 bias gets a cast of its own
    (("FLOOD_FILL", 2, ("Sigmoid",)), 4, {"relu1", "gemm1", "tanh1", "sigmoid", "add"}),
    # INSERT_AND_REDUCE also wraps the Relu/Tanh pair far from the island in casts of its own
    (("INSERT_AND_REDUCE", 1, ()), 5, {"relu0", "tanh0", "relu1", "gemm1", "tanh1"}),
]


@needs_training_build
@pytest.mark.parametrize("options, casts, float16_ops", CASES, ids=[str(c[0]) for c in CASES])
def test_each_cast_propagation_setting_changes_the_graph_as_documented(options, casts, float16_ops):
    model = move_initializers_to_inputs(_amp_graph(), WEIGHTS)
    optimized = pre_gradient_model(model, "loss", WEIGHTS, WEIGHTS, GradientOptions(*options))
    assert sum(n.op_type == "Cast" for n in optimized.graph.node) == casts
    assert _float16_ops(optimized) == float16_ops


def test_the_builtin_default_is_what_the_plain_builder_does():
    assert GradientOptions().builtin and GradientOptions("FLOOD_FILL", 1, ()).builtin
    assert not GradientOptions("NONE").builtin and not GradientOptions(memory_efficient=True).builtin
    with pytest.raises(ValueError, match="unknown cast propagation strategy 'SOME'"):
        GradientOptions("SOME")


def _run(model, feeds):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return dict(
        zip(
            [o.name for o in session.get_outputs()],
            session.run(None, {k: v for k, v in feeds.items() if k in wanted}),
            strict=True,
        )
    )


def _feeds(model):
    rng = np.random.default_rng(1)
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": np.array([0, 3, 5, 7]), **weights}


@needs_training_build
def test_the_configured_builder_keeps_the_gradient_contract_and_the_gradients():
    model = _amp_graph()
    plain = build_ort_gradient_graph(model, "loss", WEIGHTS, WEIGHTS)
    configured = build_ort_gradient_graph(model, "loss", WEIGHTS, WEIGHTS, GradientOptions("NONE"))
    assert [o.name for o in configured.graph.output] == ["loss", "W0_grad", "W1_grad", "b_grad"]
    assert not any(n.op_type == "YieldOp" for n in configured.graph.node)
    seed = {i.name: numpy_helper.to_array(i) for i in configured.graph.initializer}["loss_grad"]
    assert seed == np.float32(1.0)
    expected, actual = _run(plain, _feeds(model)), _run(configured, _feeds(model))
    for name in expected:  # the plain builder propagates casts (FLOOD_FILL): float16 rounding differs a little
        np.testing.assert_allclose(actual[name], expected[name], rtol=2e-2, atol=2e-3)


def _layer_norm_graph(extra_output: bool = False) -> onnx.ModelProto:
    """loss = sum(LayerNorm(x + h) @ W0)^2 with h = x @ W1: the residual sum feeds only the layer norm."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32) * 0.3, w) for w in ("W0", "W1")]
    inits += [
        numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(8, np.float32), "b"),
    ]
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "W1"], ["h"]),
        node("Add", ["x", "h"], ["s"]),
        node("LayerNormalization", ["s", "gamma", "b"], ["n", "mean", "inv_std"], axis=-1),
        node("MatMul", ["n", "W0"], ["o"]),
        node("Mul", ["o", "o"], ["sq"]),
        node("ReduceSum", ["sq"], ["loss"], keepdims=0),
        node("Neg", ["x"], ["unrelated"]),
    ]
    outputs = [helper.make_tensor_value_info("loss", FLOAT, [])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info("unrelated", FLOAT, [4, 8]))
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", FLOAT, [4, 8])], outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


@needs_training_build
def test_memory_efficient_gradient_computes_the_layer_norm_gradient_from_its_output():
    model, weights = _layer_norm_graph(), ["W0", "W1", "gamma", "b"]
    plain = build_ort_gradient_graph(model, "loss", weights, weights)
    efficient = build_ort_gradient_graph(model, "loss", weights, weights, GradientOptions(memory_efficient=True))
    kinds = [n.op_type for n in efficient.graph.node if "LayerNormalization" in n.op_type]
    assert kinds == ["LayerNormalization", "InvertibleLayerNormalizationGrad"]
    grad = next(n for n in efficient.graph.node if n.op_type == "InvertibleLayerNormalizationGrad")
    assert "s" not in grad.input and "n" in grad.input  # reads the output Y, not the input X
    assert "LayerNormalizationGrad" in [n.op_type for n in plain.graph.node]
    expected, actual = _run(plain, _feeds(model)), _run(efficient, _feeds(model))
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6)


@needs_training_build
def test_an_output_the_loss_does_not_depend_on_stays_an_output():
    model = _layer_norm_graph(extra_output=True)
    graded = build_ort_gradient_graph(
        model, "loss", ["W0"], ["W0", "W1", "gamma", "b"], GradientOptions(memory_efficient=True)
    )
    assert [o.name for o in graded.graph.output] == ["loss", "unrelated", "W0_grad"]
    feeds = _feeds(model)
    np.testing.assert_array_equal(_run(graded, feeds)["unrelated"], -feeds["x"])
