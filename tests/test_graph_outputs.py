"""graph/outputs.py's pruning on hand-built graphs: which outputs read an input, and the graph pruned to outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.outputs import outputs_reading, prune_to_outputs
from orttrainer.trainer.graph.passes import PassPreconditionError


def _classifier() -> onnx.ModelProto:
    """logits = x @ W; loss = mean((logits - label)^2); W is an initializer, label feeds only the loss."""
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "W"], ["logits"]),
        node("Sub", ["logits", "label"], ["diff"]),
        node("Mul", ["diff", "diff"], ["squared"]),
        node("ReduceMean", ["squared"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("label", TensorProto.FLOAT, [2, 4]),
        ],
        [
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 4]),
        ],
        [numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_outputs_reading_follows_the_nodes():
    model = _classifier()
    assert outputs_reading(model, ["label"]) == {"loss"}
    assert outputs_reading(model, ["x"]) == {"loss", "logits"}
    assert outputs_reading(model, []) == set()


def test_the_pruned_graph_needs_no_feed_for_what_its_outputs_do_not_read():
    model = _classifier()
    pruned = prune_to_outputs(model, ["logits"])
    onnx.checker.check_model(pruned, full_check=True)
    assert [i.name for i in pruned.graph.input] == ["x"] and [o.name for o in pruned.graph.output] == ["logits"]
    assert [n.op_type for n in pruned.graph.node] == ["MatMul"] and len(model.graph.node) == 4  # argument untouched
    x = np.ones((2, 3), np.float32)
    session = ort.InferenceSession(pruned.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x @ np.arange(12, dtype=np.float32).reshape(3, 4))


def test_pruning_to_an_output_the_graph_lacks_is_refused():
    with pytest.raises(PassPreconditionError, match="prune_to_outputs"):
        prune_to_outputs(_classifier(), ["probability"])
