"""graph/summed_uses.py on hand-built graphs: a sum of matrix products over the same [M, N] becomes one product
of the concatenated operands, with the same values; what the rule does not cover is left as it is."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import onnx_model, run_onnx_by_name, value_info
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.passes import PassPreconditionError, run_passes
from orttrainer.trainer.graph.summed_uses import MAX_CONTRACTION, MAX_REDUCED, SUMMED_USES_TO_ONE, summed_uses_to_one

M, N = 5, 3


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
        for v in model.graph.input
    }


def _same_values(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    feeds = _feeds(before)
    expected, got = run_onnx_by_name(before, feeds), run_onnx_by_name(after, feeds)
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-5)


def _products_model(
    ks=(2, 4, 3),
    transposed_a=True,
    transposes_after=2,
    sum_node=False,
    bias=False,
    extra_reader=None,
    a_rows=None,
):
    """`y` = the sum over k of `MatMul(A_k, B_k)` — A_k = `Transpose(x_k)` when `transposed_a` (the torch builder's
    weight gradients), the product seen through `transposes_after` [1, 0] transposes — as a chain of `Add`s or one
    `Sum`, plus a bias [N] when `bias`. `extra_reader` ('inner', 'product'): that node's output is also a graph
    output. `a_rows`: the M of each product (default M for all)."""
    nodes, inputs, terms = [], [], []
    for k, size in enumerate(ks):
        rows = M if a_rows is None else a_rows[k]
        if transposed_a:
            inputs.append(value_info(f"x{k}", [size, rows]))
            nodes.append(helper.make_node("Transpose", [f"x{k}"], [f"a{k}"], perm=[1, 0]))
        else:
            inputs.append(value_info(f"a{k}", [rows, size]))
        # an odd chain transposes the product: [rows, rows] products keep the sum well formed
        inputs.append(value_info(f"b{k}", [size, rows if transposes_after % 2 else N]))
        nodes.append(helper.make_node("MatMul", [f"a{k}", f"b{k}"], [f"p{k}_0"]))
        for t in range(transposes_after):
            nodes.append(helper.make_node("Transpose", [f"p{k}_{t}"], [f"p{k}_{t + 1}"], perm=[1, 0]))
        terms.append(f"p{k}_{transposes_after}")
    if bias:
        inputs.append(value_info("bias", [N]))
        terms.append("bias")
    if sum_node:
        nodes.append(helper.make_node("Sum", terms, ["y"]))
    else:
        total = terms[0]
        for i, term in enumerate(terms[1:]):
            out = "y" if i == len(terms) - 2 else f"s{i}"
            nodes.append(helper.make_node("Add", [total, term], [out]))
            total = out
    square = transposes_after % 2 == 1
    outputs = [value_info("y", [M, M] if square else [M, N])]
    if extra_reader == "inner":
        outputs.append(value_info("s0", None))
    if extra_reader == "product":
        outputs.append(value_info("p0_0", None))
    return onnx_model(nodes, inputs, outputs, opset=17)


@pytest.mark.parametrize("transposed_a", [True, False])
@pytest.mark.parametrize("transposes_after", [0, 1, 2])
@pytest.mark.parametrize("sum_node", [False, True])
def test_the_summed_products_become_one_product(transposed_a, transposes_after, sum_node):
    model = _products_model(transposed_a=transposed_a, transposes_after=transposes_after, sum_node=sum_node)
    result = run_passes(model, [SUMMED_USES_TO_ONE], verify=True)
    ops = _ops(result)
    assert ops.count("MatMul") == 1 and "Add" not in ops and "Sum" not in ops
    assert ops.count("Concat") == 2
    # the transposed operands are joined untransposed and transposed once; an odd chain transposes the product
    assert ops.count("Transpose") == int(transposed_a) + transposes_after % 2
    _same_values(model, result)


def test_other_leaves_are_added_to_the_product():
    model = _products_model(bias=True)
    result = run_passes(model, [SUMMED_USES_TO_ONE], verify=True)
    assert _ops(result).count("MatMul") == 1 and _ops(result).count("Sum") == 1
    _same_values(model, result)


def test_products_of_different_shapes_form_groups_of_their_own():
    """Two [5, 3] products and two [1, 3] ones (the sum broadcasts): one product for each pair, then their sum."""
    model = _products_model(ks=(2, 4, 3, 2), a_rows=(M, 1, M, 1), transposes_after=0)
    result = run_passes(model, [SUMMED_USES_TO_ONE], verify=True)
    assert _ops(result).count("MatMul") == 2 and _ops(result).count("Sum") == 1
    _same_values(model, result)


def test_a_lone_product_of_its_shape_is_added_as_it_is():
    model = _products_model(ks=(2, 4, 3), a_rows=(M, M, 1), transposes_after=0)
    result = run_passes(model, [SUMMED_USES_TO_ONE], verify=True)
    assert _ops(result).count("MatMul") == 2 and _ops(result).count("Sum") == 1
    _same_values(model, result)


def test_an_inner_sum_read_elsewhere_ends_the_tree():
    """`s0 = p0 + p1` is also a graph output: `y = s0 + p2` has one product leaf and stays; `s0` itself, a tree of
    two products, becomes one."""
    model = _products_model(extra_reader="inner")
    result = run_passes(model, [SUMMED_USES_TO_ONE], verify=True)
    assert _ops(result).count("MatMul") == 2 and _ops(result).count("Add") == 1
    _same_values(model, result)


def test_a_product_read_elsewhere_is_not_joined():
    model = _products_model(ks=(2, 4), extra_reader="product")
    assert summed_uses_to_one(model) is model


def test_products_of_unknown_shape_stay():
    model = _products_model(ks=(2, 4), transposed_a=False, transposes_after=0)
    model.graph.input[0].type.tensor_type.ClearField("shape")
    assert _ops(summed_uses_to_one(model)) == _ops(model)


def test_a_sum_read_inside_a_subgraph_is_not_the_tree_s_alone():
    """An `If` branch that reads `s0` (an outer-scope value) makes `s0` a leaf of `y`'s tree."""
    model = _products_model()
    branch = helper.make_graph(
        [helper.make_node("Identity", ["s0"], ["branch_out"])], "branch", [], [value_info("branch_out", None)]
    )
    model.graph.input.append(value_info("flag", [], TensorProto.BOOL))
    model.graph.node.append(helper.make_node("If", ["flag"], ["z"], then_branch=branch, else_branch=branch))
    model.graph.output.append(value_info("z", None))
    result = summed_uses_to_one(model)
    assert _ops(result).count("MatMul") == 2  # s0's two products joined; y = s0 + p2 kept
    feeds = _feeds(model) | {"flag": np.array(True)}
    expected, got = run_onnx_by_name(model, feeds), run_onnx_by_name(result, feeds)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-5)


def _reductions_model(
    shapes=((4, 3), (2, 3), (5, 3)), axes=(0,), keepdims=1, targets=((3,),) * 3, opset=17, extra=False
):
    """`y` = the sum over k of `ReduceSum(x_k, axes, keepdims)`, each reshaped to `targets[k]` when not None, as a
    chain of `Add`s; `extra`: plus a product term `MatMul(a, b)` of shape [1, 3]. Axes as an input from opset 13,
    as an attribute before."""
    nodes, inputs, initializers, terms = [], [], [], []
    if opset >= 13:
        initializers.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
    for k, (shape, target) in enumerate(zip(shapes, targets, strict=True)):
        inputs.append(value_info(f"x{k}", list(shape)))
        if opset >= 13:
            nodes.append(helper.make_node("ReduceSum", [f"x{k}", "axes"], [f"r{k}"], keepdims=keepdims))
        else:
            nodes.append(helper.make_node("ReduceSum", [f"x{k}"], [f"r{k}"], axes=list(axes), keepdims=keepdims))
        term = f"r{k}"
        if target is not None:
            initializers.append(numpy_helper.from_array(np.array(target, np.int64), f"shape{k}"))
            nodes.append(helper.make_node("Reshape", [term, f"shape{k}"], [f"t{k}"]))
            term = f"t{k}"
        terms.append(term)
    if extra:
        inputs += [value_info("a", [1, 2]), value_info("b", [2, 3]), value_info("c", [1, 4]), value_info("d", [4, 3])]
        nodes += [helper.make_node("MatMul", ["a", "b"], ["p0"]), helper.make_node("MatMul", ["c", "d"], ["p1"])]
        terms += ["p0", "p1"]
    total = terms[0]
    for i, term in enumerate(terms[1:]):
        out = "y" if i == len(terms) - 2 else f"s{i}"
        nodes.append(helper.make_node("Add", [total, term], [out]))
        total = out
    return onnx_model(nodes, inputs, [value_info("y", None)], initializers, opset=opset)


@pytest.mark.parametrize(
    ("axes", "keepdims", "targets", "opset"),
    [
        ((0,), 1, ((3,),) * 3, 17),  # the torch builder's bias gradient: summed over the batch, reshaped
        ((0,), 0, (None,) * 3, 17),
        ((-2,), 1, (None,) * 3, 17),
        ((0,), 1, ((3,),) * 3, 11),  # axes as an attribute
    ],
)
def test_the_summed_reductions_become_one_reduction(axes, keepdims, targets, opset):
    model = _reductions_model(axes=axes, keepdims=keepdims, targets=targets, opset=opset)
    result = run_passes(model, [SUMMED_USES_TO_ONE], verify=True)
    ops = _ops(result)
    assert ops.count("ReduceSum") == 1 and ops.count("Concat") == 1 and "Add" not in ops
    _same_values(model, result)


def test_reductions_of_other_shapes_axes_or_targets_are_not_joined():
    for model in (
        _reductions_model(shapes=((4, 3), (4, 1), (5, 3)), targets=((3,), (1,), (3,))),  # [4, 1] is its own
        _reductions_model(targets=((3,), (1, 3), (3,))),
    ):
        result = run_passes(model, [SUMMED_USES_TO_ONE], verify=True)
        assert _ops(result).count("ReduceSum") == 2 and _ops(result).count("Sum") == 1
        _same_values(model, result)
    other_axes = _reductions_model(shapes=((4, 3), (4, 3)), axes=(0,), targets=(None, None))
    other_axes.graph.initializer.append(numpy_helper.from_array(np.array([-2], np.int64), "axes_again"))
    other_axes.graph.node[1].input[1] = "axes_again"  # the same axis by another name: joined
    assert _ops(summed_uses_to_one(other_axes)).count("ReduceSum") == 1
    other_axes.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array([1], np.int64), "axes_again"))
    other_axes.graph.output[0].type.tensor_type.ClearField("shape")
    assert summed_uses_to_one(other_axes) is other_axes  # [1, 3] + [4, 1]: another axis, not joined


def test_reductions_along_the_reduced_axis_may_differ_in_size():
    model = _reductions_model(shapes=((3, 4), (3, 5), (3, 1)), axes=(1,), keepdims=0, targets=(None,) * 3)
    result = run_passes(model, [SUMMED_USES_TO_ONE], verify=True)
    assert _ops(result).count("ReduceSum") == 1
    _same_values(model, result)


def test_products_and_reductions_in_one_tree_are_joined_each():
    model = _reductions_model(targets=((1, 3),) * 3, extra=True)
    result = run_passes(model, [SUMMED_USES_TO_ONE], verify=True)
    ops = _ops(result)
    assert ops.count("ReduceSum") == 1 and ops.count("MatMul") == 1 and ops.count("Sum") == 1
    _same_values(model, result)


def test_large_terms_are_left_as_they_are():
    """A contraction longer than MAX_CONTRACTION, or a reduced operand of more than MAX_REDUCED elements: the chain
    costs such terms little, and joining would keep every operand alive."""
    long = _products_model(ks=(MAX_CONTRACTION + 1, 2), transposed_a=False, transposes_after=0)
    assert _ops(summed_uses_to_one(long)).count("MatMul") == 2
    at_the_limit = _products_model(ks=(MAX_CONTRACTION, 2), transposed_a=False, transposes_after=0)
    assert _ops(summed_uses_to_one(at_the_limit)).count("MatMul") == 1
    rows = MAX_REDUCED // 3 + 1
    large = _reductions_model(shapes=((rows, 3), (rows, 3)), targets=(None, None))
    assert _ops(summed_uses_to_one(large)).count("ReduceSum") == 2


def test_the_argument_is_unchanged():
    model = _products_model()
    before = model.SerializeToString()
    summed_uses_to_one(model)
    assert model.SerializeToString() == before


def test_the_rule_needs_a_sorted_graph():
    model = _products_model()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    with pytest.raises(PassPreconditionError, match="before"):
        run_passes(model, [SUMMED_USES_TO_ONE])
