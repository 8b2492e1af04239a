"""The recompute pass on hand-built graphs (gradients from ONNX Runtime's gradient builder)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from helpers import needs_training_build, onnx_model, value_info
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.gradient.ort_builder import build_ort_gradient_graph
from orttrainer.trainer.graph.recompute import (
    GATE_PREFIX,
    RecomputePlan,
    apply_plan,
    attention_dropout_nodes,
    count_recompute_nodes,
    forward_nodes,
    gelu_nodes,
    recompute,
    transformer_layers,
)

FLOAT = TensorProto.FLOAT


def _weights(*shapes):
    rng = np.random.default_rng(0)
    return [
        numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3, f"W{i + 1}")
        for i, s in enumerate(shapes)
    ]


def _sum_of_squares(y: str):
    return [
        helper.make_node("Mul", [y, y], ["squares"], name="square"),
        helper.make_node("ReduceSum", ["squares"], ["loss"], name="loss", keepdims=0),
    ]


def _gelu_mlp():
    """loss = sum((Gelu(x @ W1) @ W2)^2): the backward pass reads the GELU output (for W2's gradient)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Gelu", ["h"], ["g"], name="gelu", domain="com.microsoft"),
        helper.make_node("MatMul", ["g", "W2"], ["y"], name="fc2"),
        *_sum_of_squares("y"),
    ]
    forward = onnx_model(nodes, [value_info("x", [4, 8])], [value_info("loss")], _weights((8, 16), (16, 3)), ms=True)
    return build_ort_gradient_graph(forward, "loss", ["W1", "W2"], ["W1", "W2"])


def _attention(mode_input: str | None):
    """loss = sum((Dropout(Softmax(x @ W1)) @ W2)^2), with the dropout's training mode from `mode_input`: None (no
    input: inference dropout), 'const' (a constant true) or 'input' (a graph input: known only at run time)."""
    inits = _weights((8, 8), (8, 3)) + [numpy_helper.from_array(np.array(0.25, np.float32), "ratio")]
    inputs = [helper.make_tensor_value_info("x", FLOAT, [4, 8])]
    dropout_inputs = ["p", "ratio"]
    if mode_input == "const":
        inits.append(numpy_helper.from_array(np.array(True), "mode"))
        dropout_inputs.append("mode")
    elif mode_input == "input":
        inputs.append(helper.make_tensor_value_info("mode", TensorProto.BOOL, []))
        dropout_inputs.append("mode")
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["s"], name="scores"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        helper.make_node("Dropout", dropout_inputs, ["pd", "mask"], name="attn_dropout"),
        helper.make_node("MatMul", ["pd", "W2"], ["y"], name="context"),
        *_sum_of_squares("y"),
    ]
    forward = onnx_model(nodes, inputs, [value_info("loss")], inits, ms=True)
    return build_ort_gradient_graph(forward, "loss", ["W1", "W2"], ["W1", "W2"])


def _run(model, feeds):
    weights = {i.name: numpy_helper.to_array(i) for i in _weights((8, 16), (16, 3))}
    weights = {
        n: (
            weights[n]
            if n in weights and weights[n].shape == _input_shape(model, n)
            else np.random.default_rng(len(n)).standard_normal(_input_shape(model, n)).astype(np.float32) * 0.3
        )
        for n in (i.name for i in model.graph.input)
        if n.startswith("W")
    }
    feeds = {**feeds, **weights}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))


def _input_shape(model, name):
    value = next(i for i in model.graph.input if i.name == name)
    return tuple(d.dim_value for d in value.type.tensor_type.shape.dim)


def _x():
    return np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)


def _by_name(model):
    return {n.name: n for n in model.graph.node}


@needs_training_build
def test_a_gelu_is_copied_behind_a_gate_right_before_its_backward_reader_and_gradients_are_unchanged():
    model = _gelu_mlp()
    forward = forward_nodes(model.graph, ["loss"])
    result = recompute(model, ["loss"], gelu_nodes(model.graph, forward))
    assert count_recompute_nodes(result) == {"Gelu": 1}
    nodes = list(result.graph.node)
    names = [n.name for n in nodes]
    copy = nodes[names.index("gelu_recompute")]
    gate, reader = nodes[names.index("gelu_recompute") - 1], nodes[names.index("gelu_recompute") + 1]
    assert gate.op_type == "PassThrough" and gate.name.startswith(GATE_PREFIX)
    assert list(copy.input) == [gate.output[1]] and gate.input[1] == "h"  # reads h through the gate
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    assert producer[gate.input[0]] not in forward_nodes(result.graph, ["loss"])  # waits for a backward tensor
    assert "g_recompute" in reader.input and "g" not in reader.input  # the first backward reader of g
    readers_of_g = [n.name for n in nodes if "g" in n.input]
    assert readers_of_g == ["fc2"] or all(_by_name(result)[r].op_type == "Shape" for r in readers_of_g[1:])
    assert "gelu_recompute" not in _by_name(model)  # the argument is untouched
    expected, actual = _run(model, {"x": _x()}), _run(result, {"x": _x()})
    for name in ("loss", "W1_grad", "W2_grad"):
        np.testing.assert_array_equal(actual[name], expected[name])


@needs_training_build
def test_attention_dropout_is_recomputed_from_its_mask_with_dropout_grad():
    model = _attention("const")
    forward = forward_nodes(model.graph, ["loss"])
    selected = attention_dropout_nodes(model.graph, forward)
    assert [model.graph.node[i].name for i in selected] == ["attn_dropout"]
    result = recompute(model, ["loss"], selected)
    assert count_recompute_nodes(result) == {"DropoutGrad": 1}
    copy = _by_name(result)["attn_dropout_recompute"]
    gate = next(n for n in result.graph.node if n.op_type == "PassThrough")
    through = dict(zip(gate.output, gate.input, strict=True))
    assert copy.domain == "com.microsoft" and [through.get(n, n) for n in copy.input] == ["p", "mask", "ratio", "mode"]
    mask_readers = [n.op_type for n in result.graph.node if "mask" in n.input]
    assert sorted(mask_readers) == ["DropoutGrad", "PassThrough"]  # the backward's own, and the gate to the copy
    ort.set_seed(3)
    expected = _run(model, {"x": _x()})
    ort.set_seed(3)
    actual = _run(result, {"x": _x()})
    for name in ("loss", "W1_grad", "W2_grad"):
        np.testing.assert_array_equal(actual[name], expected[name])


@needs_training_build
def test_inference_dropout_is_copied_as_identity_and_a_run_time_training_mode_is_never_copied():
    model = _attention(None)
    result = recompute(model, ["loss"], attention_dropout_nodes(model.graph, forward_nodes(model.graph, ["loss"])))
    assert count_recompute_nodes(result) == {"Identity": 1}
    np.testing.assert_array_equal(_run(result, {"x": _x()})["W1_grad"], _run(model, {"x": _x()})["W1_grad"])
    runtime = _attention("input")
    selected = attention_dropout_nodes(runtime.graph, forward_nodes(runtime.graph, ["loss"]))
    assert recompute(runtime, ["loss"], selected) is runtime  # nothing can be copied: unchanged


def _layered():
    """Two 'layers' named like the TorchScript exporter names a ModuleList; layer 1 has a fused, renamed node whose
    output keeps the scope. loss = sum(L1(L0(x))^2), Lk(h) = Gelu(h @ Wk) @ Vk + h."""
    inits = _weights((8, 8), (8, 8), (8, 8), (8, 8))
    nodes = []
    h = "x"
    for k, (w, v) in enumerate([("W1", "W2"), ("W3", "W4")]):
        s = f"/m/layers.{k}/"
        gelu_name = f"{s}gelu" if k == 0 else "BiasGelu_fused"
        nodes += [
            helper.make_node("MatMul", [h, w], [f"{s}a"], name=f"{s}fc1"),
            helper.make_node("Gelu", [f"{s}a"], [f"{s}g"], name=gelu_name, domain="com.microsoft"),
            helper.make_node("MatMul", [f"{s}g", v], [f"{s}b"], name=f"{s}fc2"),
            helper.make_node("Add", [f"{s}b", h], [f"{s}out"], name=f"{s}residual"),
        ]
        h = f"{s}out"
    nodes += _sum_of_squares(h)
    forward = onnx_model(nodes, [value_info("x", [4, 8])], [value_info("loss")], inits, ms=True)
    return build_ort_gradient_graph(forward, "loss", ["W1", "W2", "W3", "W4"], ["W1", "W2", "W3", "W4"])


@needs_training_build
def test_transformer_layers_follow_the_exporter_scopes_and_keep_each_layer_output():
    model = _layered()
    layers = transformer_layers(model.graph, forward_nodes(model.graph, ["loss"]))
    assert [layer.scope for layer in layers] == ["/m/layers.0/", "/m/layers.1/"]
    names = [[model.graph.node[i].name for i in layer.interior] for layer in layers]
    assert names[0] == ["/m/layers.0/fc1", "/m/layers.0/gelu", "/m/layers.0/fc2"]  # not the residual: layer output
    assert "BiasGelu_fused" in names[1]  # found through its output's name


@needs_training_build
@pytest.mark.parametrize("layers", [0, 5])
def test_layer_recompute_copies_what_the_backward_reads_of_every_layer_but_the_last(layers):
    model = _layered()
    result, notes = apply_plan(model, ["loss"], RecomputePlan(layers=layers))
    assert count_recompute_nodes(result) == {"MatMul": 1, "Gelu": 1}  # fc1 and gelu: fc2's output is not read
    assert all(n.name.startswith("/m/layers.0/") for n in result.graph.node if n.name.endswith("_recompute"))
    assert bool(notes) == (layers == 5)  # clipping is reported
    expected, actual = _run(model, {"x": _x()}), _run(result, {"x": _x()})
    for name in ("W1_grad", "W2_grad", "W3_grad", "W4_grad"):
        np.testing.assert_array_equal(actual[name], expected[name])


@needs_training_build
def test_options_that_find_nothing_say_so():
    model = _attention("const")
    result, notes = apply_plan(model, ["loss"], RecomputePlan(gelu=True, layers=0))
    assert result is model
    assert any("gelu_recompute" in n for n in notes) and any("transformer_layer_recompute" in n for n in notes)


@needs_training_build
def test_an_unsorted_graph_is_refused():
    model = _gelu_mlp()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    with pytest.raises(ValueError, match="topologically sorted"):
        recompute(model, ["loss"], [])
