"""orttrainer's cast propagation pass (graph/cast_propagation.py) on hand-built graphs: every strategy, level and
allow list moves the casts of the AMP graph exactly as ONNX Runtime's PropagateCastOps does (the table measured on
onnxruntime-training 1.19.2 in test_graph_gradient_options), the reductions, the float32 no-op, and the numbers."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_graph_gradient_options import CASES, WEIGHTS, _amp_graph, _float16_ops

from orttrainer.trainer.graph.cast_propagation import (
    CastPropagation,
    apply_cast_propagation,
    cast_propagation_pass,
    count_casts,
    has_float16,
)
from orttrainer.trainer.graph.passes import run_passes
from orttrainer.trainer.graph.state_inputs import move_initializers_to_inputs

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16


def _amp() -> onnx.ModelProto:
    return move_initializers_to_inputs(_amp_graph(), WEIGHTS)


@pytest.mark.parametrize("options, casts, float16_ops", CASES, ids=[str(c[0]) for c in CASES])
def test_each_setting_moves_the_casts_as_onnx_runtime_does(options, casts, float16_ops):
    model = _amp()
    result = run_passes(model, [cast_propagation_pass(CastPropagation(*options))], verify=True)
    assert count_casts(result) == casts
    assert _float16_ops(result) == float16_ops
    assert [(o.name, o.type.tensor_type.elem_type) for o in result.graph.output] == [("loss", FLOAT)]
    assert [i.name for i in result.graph.input] == [i.name for i in model.graph.input]


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("options", [c[0] for c in CASES], ids=[str(c[0]) for c in CASES])
def test_the_moved_graph_computes_the_same_loss_within_float16_rounding(options):
    model = _amp()
    rng = np.random.default_rng(4)
    feeds = {i.name: numpy_helper.to_array(i) for i in _amp_graph().graph.initializer}
    feeds |= {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": np.array([1, 2, 3, 4])}
    expected = _run(model, feeds)
    actual = _run(apply_cast_propagation(model, CastPropagation(*options)), feeds)
    np.testing.assert_allclose(actual, expected, rtol=2e-3)


def _float32_graph() -> onnx.ModelProto:
    node = helper.make_node
    graph = helper.make_graph(
        [node("Relu", ["x"], ["r"]), node("Tanh", ["r"], ["t"]), node("Add", ["t", "x"], ["y"])],
        "f32",
        [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", FLOAT, [2, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("strategy", ["INSERT_AND_REDUCE", "FLOOD_FILL"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_a_float32_graph_is_unchanged(strategy, level):
    model = _float32_graph()
    assert not has_float16(model)
    assert apply_cast_propagation(model, CastPropagation(strategy, level, ("Add",))) is model


@pytest.mark.parametrize("options", [("NONE", 2, ("Sigmoid",)), ("INSERT_AND_REDUCE", -1, ()), ("FLOOD_FILL", -1, ())])
def test_none_or_level_minus_one_changes_nothing(options):
    model = _amp()
    config = CastPropagation(*options)
    assert config.off and apply_cast_propagation(model, config) is model


def _chain(casts: list[int], graph_output: bool = False) -> onnx.ModelProto:
    """x (float16) -> Cast(casts[0]) -> Cast(casts[1]) ... -> Neg -> y; with `graph_output` the last cast's output
    is also a graph output."""
    nodes, previous, elem = [], "x", HALF
    for k, to in enumerate(casts):
        nodes.append(helper.make_node("Cast", [previous], [f"c{k}"], name=f"cast{k}", to=to))
        previous, elem = f"c{k}", to
    nodes.append(helper.make_node("Neg", [previous], ["y"]))
    outputs = [helper.make_tensor_value_info("y", elem, [3])]
    if graph_output:
        outputs.append(helper.make_tensor_value_info(previous, elem, [3]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", HALF, [3])], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


FLOOD = CastPropagation("FLOOD_FILL", 0)  # level 0, nothing allowed: the reductions alone


def test_float16_to_float32_to_float16_is_removed_and_the_lossy_round_trip_kept():
    exact = apply_cast_propagation(_chain([FLOAT, HALF]), FLOOD)
    assert count_casts(exact) == 0 and list(exact.graph.node[0].input) == ["x"]
    lossy = _chain([FLOAT, HALF, FLOAT])  # x16 -> 32 -> 16 -> 32: the first pair goes, 16 -> 32 stays
    assert count_casts(apply_cast_propagation(lossy, FLOOD)) == 1


def test_a_cast_whose_output_is_a_graph_output_stays():
    result = apply_cast_propagation(_chain([FLOAT, HALF], graph_output=True), FLOOD)
    assert count_casts(result) == 2
    onnx.checker.check_model(result, full_check=True)


def test_sibling_casts_fuse_and_no_op_and_dead_casts_go():
    node = helper.make_node
    nodes = [
        node("Cast", ["x"], ["a"], name="a", to=FLOAT),
        node("Cast", ["x"], ["b"], name="b", to=FLOAT),  # sibling of a
        node("Cast", ["a"], ["c"], name="c", to=FLOAT),  # no-op: a is float32 already
        node("Cast", ["x"], ["d"], name="d", to=HALF),  # no-op on the float16 input
        node("Cast", ["b"], ["unused"], name="dead", to=HALF),  # back-to-back with b, read by nothing
        node("Add", ["b", "c"], ["s"]),
        node("Cast", ["d"], ["e"], name="e", to=FLOAT),
        node("Mul", ["s", "e"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", HALF, [3])], [helper.make_tensor_value_info("y", FLOAT, [3])]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = apply_cast_propagation(model, FLOOD)
    assert [(n.op_type, list(n.input)) for n in result.graph.node] == [
        ("Cast", ["x"]),
        ("Add", ["a", "a"]),
        ("Mul", ["s", "a"]),
    ]
    x = np.array([1.5, -2.0, 3.25], np.float16)
    np.testing.assert_array_equal(_run(result, {"x": x}), _run(model, {"x": x}))


def test_value_info_follows_the_new_types_so_onnx_runtime_accepts_the_graph():
    model = onnx.shape_inference.infer_shapes(_amp())  # value_info for every tensor, as the torch exporter writes
    result = apply_cast_propagation(model, CastPropagation("FLOOD_FILL", 2, ("Sigmoid",)))
    declared = {v.name: v.type.tensor_type.elem_type for v in result.graph.value_info}
    produced = {o for n in result.graph.node for o in n.output}
    assert set(declared) <= produced | {i.name for i in result.graph.input}
    for node in result.graph.node:
        if node.op_type == "Cast":
            assert declared.get(node.output[0], node.attribute[0].i) == node.attribute[0].i
    onnx.checker.check_model(result, full_check=True)


def test_an_unknown_strategy_is_an_error():
    with pytest.raises(ValueError, match="unknown cast propagation strategy 'SOME'"):
        CastPropagation("SOME")
