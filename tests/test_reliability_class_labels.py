"""Class labels are range-checked as PyTorch checks them (orttrainer/trainer/graph/class_labels.py): a label outside
[0, classes) that is not the ignore_index fails the step, which changes nothing, on both gradient builders, in
train_step and eval_step, for PyTorch models and ONNX models; the ignore_index still trains. Before the check a
label of -3 for 5 classes trained silently (ONNX counts negative indices from the end)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import make_trainer, needs_training_build
from onnx import TensorProto, helper, numpy_helper
from test_reliability_trainer import _same, _snapshot

from orttrainer import optim
from orttrainer.trainer.graph.class_labels import guard_class_labels, guard_pytorch_indices

BUILDERS = [pytest.param("ort", marks=needs_training_build), "torch"]
REFUSED = "PyTorch refuses it"
DESC = {
    "inputs": [("x", ["batch", 4]), ("y", ["batch"])],
    "outputs": [("loss", [], True), ("logits", ["batch", 5])],
}
X = torch.ones(2, 4)


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(x)


def _torch_trainer(builder: str, ignore_index: int = -100):
    torch.manual_seed(0)

    def loss_fn(logits, y):
        return torch.nn.functional.cross_entropy(logits, y, ignore_index=ignore_index)

    options = {"_internal_use": {"gradient_builder": builder}}
    trainer = make_trainer(_Linear(), DESC, optim.SGDConfig(lr=0.1), loss_fn, options)
    trainer.train_step(X, torch.tensor([0, 1]))  # the first step's dry run in PyTorch would refuse a bad label
    return trainer


def _onnx_model(ignore_index: int | None = None) -> onnx.ModelProto:
    attrs = {} if ignore_index is None else {"ignore_index": ignore_index}
    weight = numpy_helper.from_array(np.linspace(-1, 1, 20, dtype=np.float32).reshape(4, 5), "W")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["logits"], name="matmul"),
            helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"], name="ce", **attrs),
        ],
        "labels",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("y", TensorProto.INT64, ["batch"]),
        ],
        [
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5]),
        ],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def _onnx_trainer(builder: str, ignore_index: int | None = None):
    options = {"_internal_use": {"gradient_builder": builder}}
    trainer = make_trainer(_onnx_model(ignore_index), DESC, optim.SGDConfig(lr=0.1), None, options)
    trainer.train_step(X, torch.tensor([0, 1]))
    return trainer


@pytest.mark.parametrize("label", [-3, 5])
@pytest.mark.parametrize("source", ["pytorch", "onnx"])
@pytest.mark.parametrize("builder", BUILDERS)
def test_a_label_outside_the_classes_fails_the_step_and_changes_nothing(builder, source, label):
    trainer = _torch_trainer(builder) if source == "pytorch" else _onnx_trainer(builder)
    before = _snapshot(trainer)
    with pytest.raises(Exception, match=REFUSED):
        trainer.train_step(X, torch.tensor([label, 1]))
    after = _snapshot(trainer)
    assert after[1] == before[1] and _same(after[0], before[0])
    trainer.train_step(X, torch.tensor([2, 1]))  # and training goes on
    assert trainer.step == 2


@pytest.mark.parametrize("source", ["pytorch", "onnx"])
@pytest.mark.parametrize("builder", BUILDERS)
def test_eval_step_refuses_a_label_outside_the_classes(builder, source):
    trainer = _torch_trainer(builder) if source == "pytorch" else _onnx_trainer(builder)
    with pytest.raises(Exception, match=REFUSED):
        trainer.eval_step(X, torch.tensor([-3, 1]))


@pytest.mark.parametrize("builder", BUILDERS)
def test_the_ignore_index_still_trains_and_counts_for_nothing(builder):
    """Labels equal to ignore_index (PyTorch's default -100, or a negative one chosen by the user) train, with the
    loss of the other labels only, as in PyTorch."""
    for ignore_index in (-100, -3):
        trainer = _torch_trainer(builder, ignore_index)
        module = _Linear()
        module.load_state_dict(trainer.state_dict(pytorch_format=True))
        loss, _ = trainer.eval_step(X, torch.tensor([ignore_index, 1]))
        expected = torch.nn.functional.cross_entropy(
            module(X), torch.tensor([ignore_index, 1]), ignore_index=ignore_index
        )
        assert torch.allclose(loss, expected, atol=1e-6)
        trainer.train_step(X, torch.tensor([ignore_index, 1]))


@pytest.mark.parametrize("builder", BUILDERS)
def test_an_onnx_models_own_ignore_index_trains(builder):
    trainer = _onnx_trainer(builder, ignore_index=-1)
    trainer.train_step(X, torch.tensor([-1, 1]))
    with pytest.raises(Exception, match=REFUSED):
        trainer.train_step(X, torch.tensor([-2, 1]))


# --- the pass on hand-built graphs --------------------------------------------------------------------------------


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_guard_class_labels_keeps_the_loss_and_refuses_out_of_range_labels():
    model = _onnx_model(ignore_index=-1)
    guarded = guard_class_labels(model)
    assert guarded is not model and len(guarded.graph.node) > len(model.graph.node)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    for labels in ([0, 4, -1], [2, 2, 2]):
        feeds = {"x": x, "y": np.array(labels, np.int64)}
        assert np.array_equal(_run(guarded, feeds)[0], _run(model, feeds)[0])
    for labels in ([0, 5, 1], [-3, 0, 0]):
        with pytest.raises(Exception, match=r"a class label of SoftmaxCrossEntropyLoss 'ce' is outside \[0, classes\)"):
            _run(guarded, {"x": x, "y": np.array(labels, np.int64)})


def _gather_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("GatherElements", ["data", "index"], ["out"], name="gather", axis=1)],
        "gather",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("index", TensorProto.INT64, [2, 1]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def test_negative_gather_indices_are_refused_only_in_graphs_traced_from_pytorch():
    """ONNX counts a negative GatherElements index from the end, so an ONNX model keeps that meaning; PyTorch's
    gather refuses it, so a graph traced from PyTorch does too."""
    model = _gather_model()
    feeds = {"data": np.arange(6, dtype=np.float32).reshape(2, 3), "index": np.array([[-1], [0]], np.int64)}
    assert guard_class_labels(model) is model
    assert _run(model, feeds)[0].tolist() == [[2.0], [3.0]]
    guarded = guard_pytorch_indices(model)
    with pytest.raises(Exception, match=r"an index of GatherElements 'gather' is outside \[0, size of axis 1\)"):
        _run(guarded, feeds)
    feeds["index"] = np.array([[2], [0]], np.int64)
    assert _run(guarded, feeds)[0].tolist() == [[2.0], [3.0]]


def test_the_checked_labels_keep_their_static_shape():
    """Shape inference sees through the check (ONNX Runtime specialises graphs to static shapes with it)."""
    guarded = onnx.shape_inference.infer_shapes(guard_class_labels(_onnx_model()))
    checked = next(n.input[1] for n in guarded.graph.node if n.op_type == "SoftmaxCrossEntropyLoss")
    assert checked != "y"
    shape = next(v.type.tensor_type.shape for v in guarded.graph.value_info if v.name == checked)
    assert [d.dim_param or d.dim_value for d in shape.dim] == ["batch"]


def test_labels_of_an_untold_type_are_checked_by_the_reshape_form():
    """Labels computed by an op the type tracing does not know (Neg) get the type-free form of the check."""
    model = _onnx_model()
    model.graph.node.insert(0, helper.make_node("Neg", ["y"], ["y_neg"], name="neg"))
    model.graph.node[-1].input[1] = "y_neg"
    guarded = guard_class_labels(model)
    assert any(n.op_type == "Reshape" and n.input[0] == "y_neg" for n in guarded.graph.node)
    x = np.ones((2, 4), np.float32)
    assert np.array_equal(
        _run(guarded, {"x": x, "y": np.array([0, -4])})[0], _run(model, {"x": x, "y": np.array([0, -4])})[0]
    )
    with pytest.raises(Exception, match=REFUSED):
        _run(guarded, {"x": x, "y": np.array([0, 3])})
