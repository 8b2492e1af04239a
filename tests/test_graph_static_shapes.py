"""graph/static_shapes.py on hand-built graphs: each pass gives the values the graph gave before, and leaves alone
what its rule does not cover; runtime/static_graphs.py's specialisation round trip on a small model."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import needs_training_build, onnx_model, run_onnx, value_info
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.passes import PassPreconditionError, run_passes
from orttrainer.trainer.graph.static_shapes import (
    DROP_NOOP_REDUCTIONS,
    FOLD_BROADCAST_GRADIENT_ARGS,
    SCATTER_SUM_TO_CONCAT,
    WHERE_SUM_TO_CONCAT,
    WITHOUT_DEAD_NODES,
    broadcast_gradient_axes,
    static_inputs_pass,
)


def _ops(model):
    return [n.op_type for n in model.graph.node]


# ----------------------------------------------------------------------------------------------------- static inputs
def test_static_inputs_declare_the_dims_and_check_them():
    model = onnx_model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [value_info("x", ["batch", 4])],
        [value_info("y", ["batch", 4])],
        opset=16,
        ms=True,
    )
    static = run_passes(model, [static_inputs_pass({"x": (3, 4)})], verify=True)
    assert [d.dim_value for d in static.graph.input[0].type.tensor_type.shape.dim] == [3, 4]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"  # a copy
    for shapes, message in [({"z": (3, 4)}, "missing"), ({"x": (3,)}, "rank"), ({"x": (3, 5)}, "differ")]:
        with pytest.raises(PassPreconditionError, match=message):
            run_passes(model, [static_inputs_pass(shapes)])


# --------------------------------------------------------------------------------------- BroadcastGradientArgs
SHAPE_PAIRS = [
    ([16, 128, 1000], [1000]),
    ([1000], [16, 128, 1000]),
    ([16, 128, 256], [16, 128, 256]),
    ([16, 4, 128, 64], [1]),
    ([3, 1, 5], [1, 4, 1]),
    ([2, 3], [4, 1, 3]),
    ([], [2, 2]),
]


def _bga_model(a, b):
    node = helper.make_node("BroadcastGradientArgs", ["a", "b"], ["ra", "rb"], domain="com.microsoft")
    inits = [numpy_helper.from_array(np.array(a, np.int64), "a"), numpy_helper.from_array(np.array(b, np.int64), "b")]
    return onnx_model(
        [node],
        [],
        [value_info("ra", None, TensorProto.INT64), value_info("rb", None, TensorProto.INT64)],
        inits,
        opset=16,
        ms=True,
    )


@needs_training_build
@pytest.mark.parametrize(("a", "b"), SHAPE_PAIRS)
def test_the_axes_are_onnx_runtime_s(a, b):
    """The rule's axes equal the BroadcastGradientArgs kernel's (as sets: ReduceSum does not care about order)."""
    kernel = run_onnx(_bga_model(a, b), {})
    mine = broadcast_gradient_axes(a, b)
    assert [sorted(k.tolist()) for k in kernel] == [sorted(m) for m in mine]
    folded = run_passes(_bga_model(a, b), [FOLD_BROADCAST_GRADIENT_ARGS], verify=True)
    assert _ops(folded) == []
    assert [sorted(v.tolist()) for v in run_onnx(folded, {})] == [sorted(m) for m in mine]


def test_shapes_that_do_not_broadcast_are_a_precondition_error():
    with pytest.raises(PassPreconditionError, match="do not broadcast"):
        run_passes(_bga_model([3, 4], [5]), [FOLD_BROADCAST_GRADIENT_ARGS])


def test_a_runtime_shape_is_not_folded():
    node = helper.make_node("BroadcastGradientArgs", ["a", "b"], ["ra", "rb"], domain="com.microsoft")
    model = onnx_model(
        [node],
        [value_info("a", [2], TensorProto.INT64)],
        [value_info("ra", None, TensorProto.INT64), value_info("rb", None, TensorProto.INT64)],
        [numpy_helper.from_array(np.array([3], np.int64), "b")],
        opset=16,
        ms=True,
    )
    assert _ops(run_passes(model, [FOLD_BROADCAST_GRADIENT_ARGS])) == ["BroadcastGradientArgs"]


# ----------------------------------------------------------------------------------------------- no-op reductions
def _reduce_model(axes, noop):
    nodes = [
        helper.make_node("ReduceSum", ["x", "axes"], ["r"], noop_with_empty_axes=noop),
        helper.make_node("Sum", ["r"], ["y"]),
    ]
    return onnx_model(
        nodes,
        [value_info("x", [2, 3])],
        [value_info("y", None)],
        [numpy_helper.from_array(np.array(axes, np.int64), "axes")],
        opset=16,
        ms=True,
    )


def test_an_empty_reduction_becomes_an_identity():
    model = _reduce_model([], 1)
    dropped = run_passes(model, [DROP_NOOP_REDUCTIONS], verify=True)
    assert _ops(dropped) == ["Identity", "Identity"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(run_onnx(dropped, {"x": x})[0], run_onnx(model, {"x": x})[0])


@pytest.mark.parametrize(("axes", "noop"), [([], 0), ([0], 1)])
def test_real_reductions_stay(axes, noop):
    """With noop_with_empty_axes=0 an empty list sums everything; a non-empty one sums."""
    dropped = run_passes(_reduce_model(axes, noop), [DROP_NOOP_REDUCTIONS])
    assert _ops(dropped) == ["ReduceSum", "Identity"]


def _one_value_model(op, axes, keepdims, shape=(1, 3, 1), opset=18, as_attribute=False):
    """`y = op(x, axes, keepdims)` then `Neg`, x of `shape` (None: unknown)."""
    inputs, initializers, attributes = ["x"], [], {"keepdims": keepdims}
    if as_attribute:
        attributes["axes"] = axes
    else:
        inputs.append("axes")
        initializers.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    nodes = [helper.make_node(op, inputs, ["r"], **attributes), helper.make_node("Neg", ["r"], ["y"])]
    x = value_info("x", None if shape is None else list(shape))
    return onnx_model(nodes, [x], [value_info("y", None)], initializers, opset=opset)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"])
@pytest.mark.parametrize(
    ("axes", "keepdims", "replaced_by"), [([0], 1, "Identity"), ([0, -1], 1, "Identity"), ([2, 0], 0, "Squeeze")]
)
def test_a_reduction_over_axes_of_size_one_is_its_input(op, axes, keepdims, replaced_by):
    model = _one_value_model(op, axes, keepdims)
    dropped = run_passes(model, [DROP_NOOP_REDUCTIONS], verify=True)
    assert _ops(dropped) == [replaced_by, "Neg"]
    x = np.arange(3, dtype=np.float32).reshape(1, 3, 1) - 1.0
    expected, got = run_onnx(model, {"x": x})[0], run_onnx(dropped, {"x": x})[0]
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_a_reduction_with_axes_as_an_attribute_is_read_too():
    model = _one_value_model("ReduceMean", [0], 1, opset=13, as_attribute=True)
    assert _ops(run_passes(model, [DROP_NOOP_REDUCTIONS], verify=True)) == ["Identity", "Neg"]


@pytest.mark.parametrize(("axes", "shape"), [([1], (1, 3, 1)), ([0], None), ([0, 1], (1, 3, 1))])
def test_reductions_over_a_longer_or_unknown_axis_stay(axes, shape):
    model = _one_value_model("ReduceSum", axes, 1, shape=shape)
    assert _ops(run_passes(model, [DROP_NOOP_REDUCTIONS])) == ["ReduceSum", "Neg"]


# -------------------------------------------------------------------------------------------- scatter-sum -> concat
def _scatter_model(rows, first_dim=3, cast=True, fill_initializer=False, elem=TensorProto.FLOAT):
    """Sum over k of ScatterND(zeros[first_dim, 4, 5], [[rows[k]]], u_k), u_k inputs of shape [1, 4, 5]."""
    nodes, inputs, inits = [], [], [numpy_helper.from_array(np.array([first_dim, 4, 5], np.int64), "shape")]
    parts = []
    for k, row in enumerate(rows):
        zeros = f"zeros{k}"
        if fill_initializer:
            inits.append(numpy_helper.from_array(np.zeros((first_dim, 4, 5), np.float32), zeros))
        else:
            nodes.append(helper.make_node("ConstantOfShape", ["shape"], [zeros]))
        inits.append(numpy_helper.from_array(np.array([[row]], np.int64), f"index{k}"))
        inputs.append(value_info(f"u{k}", [1, 4, 5], elem))
        nodes.append(helper.make_node("ScatterND", [zeros, f"index{k}", f"u{k}"], [f"s{k}"], reduction="add"))
        part = f"s{k}"
        if cast:
            nodes.append(helper.make_node("Cast", [part], [f"c{k}"], to=TensorProto.FLOAT))
            part = f"c{k}"
        parts.append(part)
    nodes.append(helper.make_node("Sum", parts, ["y"], name="accumulate"))
    return onnx_model(nodes, inputs, [value_info("y", [first_dim, 4, 5], elem)], inits, opset=16, ms=True)


def _feeds(n):
    rng = np.random.default_rng(0)
    return {f"u{k}": rng.standard_normal((1, 4, 5)).astype(np.float32) for k in range(n)}


@pytest.mark.parametrize(("rows", "cast", "fill_initializer"), [((2, 0, 1), True, False), ((0, 1, 2), False, True)])
def test_the_scatter_sum_becomes_a_concat(rows, cast, fill_initializer):
    model = _scatter_model(rows, cast=cast, fill_initializer=fill_initializer)
    concat = run_passes(model, [SCATTER_SUM_TO_CONCAT, WITHOUT_DEAD_NODES], verify=True)
    assert _ops(concat) == ["Concat"] and not concat.graph.initializer
    np.testing.assert_array_equal(run_onnx(concat, _feeds(3))[0], run_onnx(model, _feeds(3))[0])


@pytest.mark.parametrize(("rows", "first_dim"), [((0, 0, 2), 3), ((0, 1, 2), 4), ((0, 1), 3)])
def test_rows_that_do_not_cover_the_tensor_stay_scattered(rows, first_dim):
    model = _scatter_model(rows, first_dim=first_dim)
    assert "Concat" not in _ops(run_passes(model, [SCATTER_SUM_TO_CONCAT]))


def test_float16_graphs_are_refused():
    with pytest.raises(PassPreconditionError, match="float16"):
        run_passes(_scatter_model((0, 1, 2), cast=False, elem=TensorProto.FLOAT16), [SCATTER_SUM_TO_CONCAT])


# --------------------------------------------------------------------------------------------- where-sum -> concat
def _where_model(rows, n=3, axis=0, x_shape=None, zeros="constant_of_shape", reshape=True, extra_reader=False):
    """Add-tree over k of Where(onehot(rows[k]) along `axis`, Expand(X_k, S), zeros), S = [n, 4, 5] with n moved to
    `axis`; X_k is a graph input `x{k}` reshaped to (or, `reshape` False, declared as) `x_shape`, by default S with
    1 at `axis`. `extra_reader`: the first inner Add is also a graph output."""
    full = [4, 5]
    full.insert(axis, n)
    part = list(x_shape) if x_shape is not None else [1 if i == axis else d for i, d in enumerate(full)]
    nodes, inputs = [], []
    inits = [numpy_helper.from_array(np.array(full, np.int64), "S")]
    if zeros == "initializer":
        inits.append(numpy_helper.from_array(np.zeros(full, np.float32), "Z"))
    else:
        nodes.append(helper.make_node("ConstantOfShape", ["S"], ["Z"]))
    leaves = []
    for k, row in enumerate(rows):
        condition = np.zeros([n if i == axis else 1 for i in range(3)], np.bool_)
        condition.reshape(-1)[row] = True
        inits.append(numpy_helper.from_array(condition, f"C{k}"))
        if reshape:
            inputs.append(value_info(f"x{k}", [int(np.prod(part))]))
            inits.append(numpy_helper.from_array(np.array(part, np.int64), f"shape{k}"))
            nodes.append(helper.make_node("Reshape", [f"x{k}", f"shape{k}"], [f"r{k}"]))
            source = f"r{k}"
        else:
            inputs.append(value_info(f"x{k}", part))
            source = f"x{k}"
        nodes.append(helper.make_node("Expand", [source, "S"], [f"e{k}"]))
        nodes.append(helper.make_node("Where", [f"C{k}", f"e{k}", "Z"], [f"w{k}"]))
        leaves.append(f"w{k}")
    total = leaves[0]
    for k, leaf in enumerate(leaves[1:], 1):
        nodes.append(helper.make_node("Add", [total, leaf], [f"a{k}"], name=f"add{k}"))
        total = f"a{k}"
    outputs = [value_info(total, full)] + ([value_info("a1", full)] if extra_reader and len(leaves) > 2 else [])
    return onnx_model(nodes, inputs, outputs, inits, opset=16, ms=True)


def _where_feeds(model):
    rng = np.random.default_rng(0)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize(
    ("rows", "axis", "zeros", "reshape"),
    [((2, 0, 1), 0, "constant_of_shape", True), ((0, 1, 2), 1, "initializer", False), ((1, 0), 2, "initializer", True)],
)
def test_the_where_sum_becomes_a_concat(rows, axis, zeros, reshape):
    model = _where_model(rows, n=len(rows), axis=axis, zeros=zeros, reshape=reshape)
    concat = run_passes(model, [WHERE_SUM_TO_CONCAT], verify=True)
    ops = _ops(concat)
    assert ops.count("Concat") == 1 and not {"Where", "Expand", "Add", "ConstantOfShape"} & set(ops)
    assert helper.get_attribute_value(concat.graph.node[-1].attribute[0]) == axis
    assert {i.name for i in concat.graph.initializer} <= {f"shape{k}" for k in range(len(rows))}
    feeds = _where_feeds(model)
    np.testing.assert_array_equal(run_onnx(concat, feeds)[0], run_onnx(model, feeds)[0])


@pytest.mark.parametrize(
    ("rows", "n", "x_shape"),
    [
        ((0, 0, 2), 3, None),  # an index twice: rows 1 is zero, not a slice
        ((0, 1), 3, None),  # a row no leaf writes
        ((0, 1, 2), 3, [3, 4, 5]),  # X already has the axis: Where selects its slice, not X itself
        ((0, 1, 2), 3, [1, 1, 5]),  # X broadcasts on another axis too
    ],
)
def test_where_sums_that_are_not_a_concat_stay(rows, n, x_shape):
    model = _where_model(rows, n=n, x_shape=x_shape)
    assert "Concat" not in _ops(run_passes(model, [WHERE_SUM_TO_CONCAT], verify=True))


def test_an_inner_sum_read_elsewhere_keeps_the_tree():
    """An inner Add that is also read elsewhere is not the tree's alone: nothing is rewritten."""
    model = _where_model((0, 1, 2), extra_reader=True)
    assert "Concat" not in _ops(run_passes(model, [WHERE_SUM_TO_CONCAT], verify=True))


def test_the_where_sum_rule_needs_a_sorted_graph():
    model = _where_model((0, 1, 2))
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    with pytest.raises(PassPreconditionError, match="before"):
        run_passes(model, [WHERE_SUM_TO_CONCAT])


def test_dead_nodes_and_initializers_go_live_ones_stay():
    nodes = [
        helper.make_node("Relu", ["x"], ["dead"]),
        helper.make_node("Neg", ["dead"], ["dead2"]),
        helper.make_node("Add", ["x", "one"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.ones(2, np.float32), n) for n in ("one", "unused")]
    model = run_passes(
        onnx_model(nodes, [value_info("x", [2])], [value_info("y", [2])], inits, opset=16, ms=True),
        [WITHOUT_DEAD_NODES],
        verify=True,
    )
    assert _ops(model) == ["Add"] and [i.name for i in model.graph.initializer] == ["one"]


def test_dead_node_removal_needs_a_sorted_graph():
    nodes = [helper.make_node("Neg", ["h"], ["y"]), helper.make_node("Relu", ["x"], ["h"])]
    with pytest.raises(PassPreconditionError, match="reads 'h' before"):
        run_passes(
            onnx_model(nodes, [value_info("x", [2])], [value_info("y", [2])], opset=16, ms=True), [WITHOUT_DEAD_NODES]
        )


def test_reduction_removal_needs_one_writer_per_name():
    nodes = [helper.make_node("Sum", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["y"])]
    with pytest.raises(PassPreconditionError, match="assigned twice"):
        run_passes(
            onnx_model(nodes, [value_info("x", [2])], [value_info("y", [2])], opset=16, ms=True), [DROP_NOOP_REDUCTIONS]
        )


# ------------------------------------------------------------------------------------------- the specialisation
def _broadcast_gradient_model():
    """y = x + b with the gradient written for any shape, as ONNX Runtime's builder writes it."""
    nodes = [
        helper.make_node("Add", ["x", "b"], ["y"]),
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Shape", ["b"], ["sb"]),
        helper.make_node("BroadcastGradientArgs", ["sx", "sb"], ["ax", "ab"], domain="com.microsoft"),
        helper.make_node("ReduceSum", ["dy", "ax"], ["rx"], noop_with_empty_axes=1, keepdims=1),
        helper.make_node("Reshape", ["rx", "sx"], ["dx"]),
        helper.make_node("ReduceSum", ["dy", "ab"], ["rb"], noop_with_empty_axes=1, keepdims=1),
        helper.make_node("Reshape", ["rb", "sb"], ["db"]),
        helper.make_node("ConstantOfShape", ["sx"], ["zeros"]),
        helper.make_node("Add", ["zeros", "dx"], ["dx_plus_zero"]),
    ]
    inputs = [value_info("x", ["batch", 5]), value_info("b", [5]), value_info("dy", ["batch", 5])]
    return onnx_model(
        nodes,
        inputs,
        [value_info("y", None), value_info("dx_plus_zero", None), value_info("db", None)],
        opset=16,
        ms=True,
    )


@needs_training_build
def test_specialisation_folds_the_shape_arithmetic_and_keeps_the_values():
    from dataclasses import dataclass

    import torch

    from orttrainer.trainer.runtime.ort import optimized_model
    from orttrainer.trainer.runtime.static_graphs import specialized

    @dataclass
    class Graph:
        model: onnx.ModelProto
        data_inputs: list

    model = _broadcast_gradient_model()
    options = ort.SessionOptions()
    optimize = lambda m: optimized_model(m, options, ["CPUExecutionProvider"])  # noqa: E731
    graph = specialized(Graph(model, ["x", "dy"]), {"x": torch.zeros(3, 5), "dy": torch.zeros(3, 5)}, optimize)
    ops = _ops(graph.model)
    assert "BroadcastGradientArgs" not in ops and "Shape" not in ops and ops.count("ReduceSum") == 1
    assert "ConstantOfShape" in ops  # the fill is not materialised into an initializer (_hold_fills)
    assert not [i for i in graph.model.graph.input if "hold" in i.name]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 5)), "b": rng.standard_normal(5), "dy": rng.standard_normal((3, 5))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    for ours, theirs in itertools.zip_longest(run_onnx(graph.model, feeds), run_onnx(model, feeds)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_a_graph_fused_into_inference_only_ops_is_not_specialised():
    """ONNX Runtime's inference fusions (SkipLayerNormalization, ...) declare outputs their CPU kernels do not
    compute; should one appear in the optimised model, the specialisation is refused (None: the dynamic graph runs)."""
    from dataclasses import dataclass

    import torch

    from orttrainer.trainer.runtime.static_graphs import specialized

    @dataclass
    class Graph:
        model: onnx.ModelProto
        data_inputs: list

    def fused(model: onnx.ModelProto) -> onnx.ModelProto:
        node = helper.make_node("SkipLayerNormalization", ["x", "x", "g"], ["y"], domain="com.microsoft")
        return onnx_model([node], list(model.graph.input), [value_info("y", None)], opset=16, ms=True)

    model = onnx_model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [value_info("x", ["batch", 4])],
        [value_info("y", None)],
        opset=16,
        ms=True,
    )
    assert specialized(Graph(model, ["x"]), {"x": torch.zeros(2, 4)}, fused) is None
