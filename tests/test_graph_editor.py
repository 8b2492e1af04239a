"""GraphEditor and its helpers, on hand-built graphs: unique names, constant dedup, scalar folding; the editor's
passes topologically_sorted and raise_opset."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import onnx_model, run_onnx, value_info
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.editor import (
    TOPOLOGICALLY_SORTED,
    GraphEditor,
    copy_model,
    fresh_name,
    graph_value_names,
    raise_opset,
    raise_opset_pass,
    raised_opset,
    tensor_elem_type,
    topologically_sorted,
)
from orttrainer.trainer.graph.passes import PassPreconditionError


def _add_model() -> onnx.ModelProto:
    """y = x + b; a tensor and a node already use names the editor would invent."""
    b = numpy_helper.from_array(np.array(2.0, np.float32), "b")
    nodes = [
        helper.make_node("Add", ["x", "b"], ["orttrainer/t/Mul"], name="orttrainer/t/Mul_node"),
        helper.make_node("Identity", ["orttrainer/t/Mul"], ["y"], name="id"),
    ]
    return onnx_model(nodes, [value_info("x", [])], [value_info("y", [])], [b])


def test_fresh_name_skips_taken_names_and_records_the_result():
    taken = {"a", "a_1", "a_3"}
    assert fresh_name("a", taken) == "a_2"
    assert fresh_name("a", taken) == "a_4"  # a_3 is taken too
    assert fresh_name("b", taken) == "b"
    assert {"a_2", "a_4", "b"} <= taken


def test_graph_value_names_covers_every_tensor_and_ignores_empty_names():
    model = _add_model()
    model.graph.node.append(helper.make_node("Dropout", ["y"], ["z", ""]))
    assert graph_value_names(model.graph) == {"x", "y", "b", "orttrainer/t/Mul", "z"}


def test_copy_model_is_deep():
    model = _add_model()
    copy = copy_model(model)
    copy.graph.node[0].name = "changed"
    assert model.graph.node[0].name == "orttrainer/t/Mul_node"


def test_fresh_never_collides_with_tensor_or_node_names():
    model = _add_model()
    ed = GraphEditor(model.graph, "orttrainer/t")
    before = graph_value_names(model.graph) | {n.name for n in model.graph.node}
    names = [ed.fresh("Mul") for _ in range(3)] + [ed.fresh("Mul_node")]
    assert names == ["orttrainer/t/Mul_1", "orttrainer/t/Mul_2", "orttrainer/t/Mul_3", "orttrainer/t/Mul_node_1"]
    assert not set(names) & before
    assert ed.fresh("orttrainer/other/x") == "orttrainer/other/x"  # an explicit namespace is not prefixed again


def test_claim_reserves_exact_names_and_rejects_used_ones():
    model = _add_model()
    ed = GraphEditor(model.graph, "p")
    assert ed.claim("lr") == "lr"
    with pytest.raises(ValueError, match="'lr' is already used"):
        ed.claim("lr")
    with pytest.raises(ValueError, match="'x' is already used"):
        ed.claim("x")
    with pytest.raises(ValueError, match="'id' is already used"):  # node names count too
        ed.claim("id")
    assert ed.claim("p/lr") == "p/lr"
    assert ed.fresh("lr") == "p/lr_1"  # fresh names avoid claimed ones ...
    with pytest.raises(ValueError, match="'p/lr_1' is already used"):
        ed.claim("p/lr_1")  # ... and claimed names avoid fresh ones


def test_op_appends_uniquely_named_nodes():
    model = _add_model()
    ed = GraphEditor(model.graph, "orttrainer/t")
    out = ed.op("Mul", ["y", "y"])
    again = ed.op("Mul", ["y", "y"])
    assert (out, again) == ("orttrainer/t/Mul_1", "orttrainer/t/Mul_2")
    parts = ed.op_outputs("Split", [again], "split", outputs=2, axis=0)
    assert parts == ["orttrainer/t/split_out0", "orttrainer/t/split_out1"]
    named = ed.op("Identity", [out], outputs=["exact"])
    assert named == "exact"
    node_names = [n.name for n in model.graph.node]
    assert len(node_names) == len(set(node_names)) == 6
    assert node_names[2:4] == ["orttrainer/t/Mul_node_1", "orttrainer/t/Mul_node_2"]
    split = model.graph.node[4]
    assert helper.get_attribute_value(split.attribute[0]) == 0
    com = ed.op("Gelu", [out], domain="com.microsoft")
    assert model.graph.node[-1].domain == "com.microsoft" and com == "orttrainer/t/Gelu"


def test_explicit_output_names_are_reserved():
    model = _add_model()
    ed = GraphEditor(model.graph, "p")
    assert ed.op("Identity", ["x"], outputs=["p/Identity"]) == "p/Identity"
    assert ed.op("Identity", ["x"]) == "p/Identity_1"
    with pytest.raises(ValueError, match="already used"):
        ed.claim("p/Identity")
    outputs = [o for n in model.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))


def test_op_has_one_output_and_op_outputs_several():
    model = _add_model()
    ed = GraphEditor(model.graph, "p")
    with pytest.raises(ValueError, match="one output.*op_outputs"):
        ed.op("Split", ["x"], outputs=["a", "b"])
    assert len(model.graph.node) == 2  # nothing was appended
    assert ed.op_outputs("Split", ["x"], outputs=["a", "b"], axis=0) == ["a", "b"]
    assert ed.op_outputs("Identity", ["x"], "one") == ["p/one"]  # one fresh output is named by the hint alone
    with pytest.raises(ValueError, match="already used"):
        ed.claim("b")


def test_constant_deduplicates_by_value_dtype_and_shape():
    model = _add_model()
    ed = GraphEditor(model.graph, "c")
    first = ed.constant(0.5)
    assert ed.constant(0.5, hint="other") == first
    assert ed.constant(np.float32(0.5)) == first
    double = ed.constant(0.5, dtype="float64")
    vector = ed.constant([0.5])
    integer = ed.constant(2, dtype=np.int64)
    assert len({first, double, vector, integer}) == 4
    assert ed.constant(2.0) != "b"  # an equal user initializer is not reused: it may be trained or fed
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert len(values) == 6
    assert values[first].dtype == np.float32 and values[first].shape == ()
    assert values[double].dtype == np.float64
    assert values[vector].shape == (1,)
    assert values[integer].dtype == np.int64 and values[integer] == 2


def test_scalar_product_folds_floats_on_the_host():
    model = _add_model()
    ed = GraphEditor(model.graph, "s")
    assert ed.scalar_product([0.5, 4.0, 3], "f") == 6.0
    assert ed.scalar_product([], "f") == 1.0
    assert len(model.graph.node) == 2 and len(model.graph.initializer) == 1  # nothing was added


def test_scalar_product_of_one_tensor_and_unit_floats_adds_nothing():
    model = _add_model()
    ed = GraphEditor(model.graph, "s")
    assert ed.scalar_product(["y", 2.0, 0.5], "f") == "y"
    assert len(model.graph.node) == 2


def test_scalar_product_multiplies_tensors_and_the_folded_constant():
    model = _add_model()
    model.graph.input.append(value_info("z", []))
    ed = GraphEditor(model.graph, "s")
    product = ed.scalar_product([3.0, "y", 0.5, "z", 4.0], "f")
    assert isinstance(product, str)
    assert [n.op_type for n in model.graph.node[2:]] == ["Mul", "Mul"]
    ed.add_output(product, TensorProto.FLOAT, [])
    folded = numpy_helper.to_array(model.graph.initializer[-1])
    assert folded == np.float32(6.0)
    (value,) = run_onnx(model, {"x": np.array(1.5, np.float32), "z": np.array(-2.0, np.float32)}, [product])
    np.testing.assert_allclose(value, 6.0 * (1.5 + 2.0) * -2.0, rtol=0, atol=0)


def test_as_tensor_and_inputs_outputs():
    model = _add_model()
    ed = GraphEditor(model.graph, "s")
    assert ed.as_tensor("y") == "y"
    c = ed.as_tensor(0.25, hint="quarter")
    assert c == "s/quarter"
    ed.add_input("scale", TensorProto.FLOAT, [])
    with pytest.raises(ValueError, match="already used"):
        ed.add_input("scale", TensorProto.FLOAT, [])
    out = ed.op("Mul", [ed.op("Mul", ["y", c]), "scale"], outputs=["scaled"])
    ed.add_output(out, TensorProto.FLOAT, [])
    onnx.checker.check_model(model, full_check=True)
    (value,) = run_onnx(model, {"x": np.array(2.0, np.float32), "scale": np.array(3.0, np.float32)}, ["scaled"])
    np.testing.assert_allclose(value, (2.0 + 2.0) * 0.25 * 3.0, rtol=0, atol=0)


def test_tensor_elem_type_reads_initializers_inputs_outputs_and_value_info():
    model = _add_model()
    model.graph.value_info.append(value_info("orttrainer/t/Mul", [], TensorProto.DOUBLE))
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(2, np.int64), "idx"))
    assert tensor_elem_type(model, "b") == TensorProto.FLOAT
    assert tensor_elem_type(model, "idx") == TensorProto.INT64
    assert tensor_elem_type(model, "x") == TensorProto.FLOAT
    assert tensor_elem_type(model, "y") == TensorProto.FLOAT
    assert tensor_elem_type(model, "orttrainer/t/Mul") == TensorProto.DOUBLE
    with pytest.raises(KeyError, match="'nope'"):
        tensor_elem_type(model, "nope")


# ------------------------------------------------------------------------------------- topologically_sorted
def _shuffled_model() -> onnx.ModelProto:
    """z = (x + b) * 2 and w = Neg(x), with the Mul listed before the Add it reads, and the Neg last."""
    nodes = [
        helper.make_node("Mul", ["s", "two"], ["z"], name="mul"),
        helper.make_node("Add", ["x", "b"], ["s"], name="add"),
        helper.make_node("Neg", ["x"], ["w"], name="neg"),
    ]
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), n) for n in ("b", "two")]
    return onnx_model(nodes, [value_info("x", [3])], [value_info("z", [3]), value_info("w", [3])], inits)


def test_topologically_sorted_orders_producers_first_and_keeps_the_order_elsewhere():
    model = _shuffled_model()
    result = topologically_sorted(model)
    assert [n.name for n in result.graph.node] == ["add", "mul", "neg"]
    assert [n.name for n in model.graph.node] == ["mul", "add", "neg"]  # the argument is not modified
    x = np.array([1.0, -2.0, 3.0], np.float32)
    z, w = run_onnx(result, {"x": x}, ["z", "w"])
    np.testing.assert_array_equal(z, (x + 2.0) * 2.0)
    np.testing.assert_array_equal(w, -x)
    assert topologically_sorted(result) == result  # a sorted graph keeps its order


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (helper.make_node("Relu", ["nowhere"], ["r"]), "node 'Relu' reads 'nowhere', which nothing produces"),
        (helper.make_node("Relu", ["x"], ["s"], name="again"), "tensor 's' is assigned twice .*'again'"),
        (helper.make_node("Relu", ["x"], ["b"], name="init"), "tensor 'b' is assigned twice"),
    ],
    ids=["unproduced", "assigned_twice", "writes_an_initializer"],
)
def test_topologically_sorted_precondition(extra, message):
    model = _shuffled_model()
    model.graph.node.append(extra)
    with pytest.raises(PassPreconditionError, match=f"graph pass 'topologically_sorted': {message}"):
        topologically_sorted(model)
    with pytest.raises(PassPreconditionError):
        TOPOLOGICALLY_SORTED.check(model)


def test_topologically_sorted_rejects_a_cycle():
    nodes = [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Neg", ["a"], ["b"])]
    model = onnx_model(nodes, [value_info("x", [1])], [value_info("a", [1])])
    with pytest.raises(PassPreconditionError, match="'topologically_sorted': the graph has a cycle"):
        topologically_sorted(model)


# ---------------------------------------------------------------------------------------------------- raise_opset
def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {o.domain: o.version for o in model.opset_import}


def test_raise_opset_raises_the_default_domain_in_place_and_never_lowers_it():
    model = _add_model()
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    raise_opset(model, 16)
    assert _opsets(model) == {"": 16, "com.microsoft": 1}
    raise_opset(model, 15)
    assert _opsets(model)[""] == 16
    (y,) = run_onnx(model, {"x": np.array(1.0, np.float32)}, ["y"])
    assert y == 3.0


def test_raised_opset_and_its_pass_copy_the_model():
    model = _add_model()
    assert _opsets(raised_opset(model, 15))[""] == 15
    assert _opsets(raise_opset_pass(16)(model))[""] == 16
    assert _opsets(model)[""] == 14


@pytest.mark.parametrize(
    ("opset", "version", "extra", "message"),
    [
        (13, 14, None, "cannot raise this graph's opset 13 to 14 safely"),
        (14, 17, None, "cannot raise this graph's opset 14 to 17 safely"),
        (14, 16, helper.make_node("RoiAlign", ["x", "r", "i"], ["o"]), "opset 14 to 16 safely"),
        (0, 15, None, "imports no default-domain"),
    ],
    ids=["below_14", "above_16", "roialign", "no_default_domain"],
)
def test_raise_opset_precondition(opset, version, extra, message):
    model = _add_model()
    model.opset_import[0].version = opset
    if not opset:
        model.opset_import[0].domain = "com.microsoft"
    if extra is not None:
        model.graph.node.append(extra)
    with pytest.raises(PassPreconditionError, match=f"graph pass 'raise_opset': .*{message}"):
        raise_opset(model, version)
    with pytest.raises(PassPreconditionError):
        raise_opset_pass(version).check(model)
    assert _opsets(model).get("", 0) == opset  # untouched
