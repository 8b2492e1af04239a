"""gather_grad_to_scatter_add on hand-built graphs: same values as GatherGrad, opset raised to 16, guards respected."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import needs_training_build, run_onnx
from onnx import TensorProto, helper

from orttrainer.trainer.graph.scatter_grad import gather_grad_to_scatter_add


def _gather_grad_model(opset: int = 14, data_shape=(7, 3, 2), axis: int = 0, extra_nodes=()):
    index_shape, row = [4, 5], list(data_shape[1:])
    nodes = [
        helper.make_node(
            "GatherGrad", ["shape", "idx", "dy"], ["dw"], domain="com.microsoft", axis=axis, name="embedding_grad"
        ),
        *extra_nodes,
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("shape", TensorProto.INT64, [len(data_shape)]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, index_shape),
            helper.make_tensor_value_info("dy", TensorProto.FLOAT, index_shape + row),
        ],
        [helper.make_tensor_value_info("dw", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    return model


def _run(model, data_shape=(7, 3, 2)):
    rng = np.random.default_rng(0)
    feeds = {
        "shape": np.array(data_shape, np.int64),
        "idx": rng.integers(0, data_shape[0], (4, 5)),
        "dy": rng.standard_normal((4, 5, *data_shape[1:])).astype(np.float32),
    }
    return run_onnx(model, feeds, ["dw"])[0], feeds


@needs_training_build
def test_scatter_add_equals_gather_grad_with_repeated_indices():
    model = _gather_grad_model()
    rewritten = gather_grad_to_scatter_add(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "GatherGrad" not in ops and ops[-2:] == ["ScatterND", "CastLike"]
    assert next(o.version for o in rewritten.opset_import if o.domain == "") == 16
    expected, feeds = _run(model)
    actual, _ = _run(rewritten)
    reference = np.zeros((7, 3, 2), np.float32)
    np.add.at(reference, feeds["idx"].reshape(-1), feeds["dy"].reshape(-1, 3, 2))
    assert len(set(feeds["idx"].reshape(-1))) < feeds["idx"].size  # duplicates occur and must accumulate
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(actual, reference, rtol=1e-6, atol=1e-6)
    assert [n.op_type for n in model.graph.node] == ["GatherGrad"]  # the argument is not modified


@pytest.mark.parametrize(
    "model",
    [
        _gather_grad_model(opset=13),
        _gather_grad_model(axis=1),
        _gather_grad_model(extra_nodes=[helper.make_node("RoiAlign", ["a", "b", "c"], ["d"])]),
    ],
    ids=["opset13", "axis1", "roialign"],
)
def test_graphs_where_the_rule_does_not_apply_are_returned_unchanged(model):
    assert gather_grad_to_scatter_add(model) is model
