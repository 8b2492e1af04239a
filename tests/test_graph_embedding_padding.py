"""padding_rows_without_gradient on hand-built graphs (the padding row's lookups add nothing; other weights, other
rows and other uses are unchanged), and an embedding with a padding_idx tied to the output projection trained by
each builder like torch.optim (the 'ort' builder updated the padding row from its lookups before the pass)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import make_trainer, needs_training_build, run_onnx
from onnx import TensorProto, helper

from orttrainer import optim
from orttrainer.trainer.graph.embedding_padding import padding_rows_without_gradient

ROWS, WIDTH = 7, 3


def _lookup_gradient_model(opset: int = 17, cast: bool = False, index_type: int = TensorProto.INT64):
    """dW of a lookup in W: `GatherGrad(Shape(W), ids, dy)`, the shape read through a Cast when `cast`."""
    nodes = []
    source = "W"
    if cast:
        nodes.append(helper.make_node("Cast", ["W"], ["W16"], to=TensorProto.FLOAT16))
        source = "W16"
    nodes += [
        helper.make_node("Shape", [source], ["shape"]),
        helper.make_node("GatherGrad", ["shape", "ids", "dy"], ["dW"], domain="com.microsoft", name="lookup_grad"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("W", TensorProto.FLOAT, [ROWS, WIDTH]),
            helper.make_tensor_value_info("ids", index_type, [2, 5]),
            helper.make_tensor_value_info("dy", TensorProto.FLOAT, [2, 5, WIDTH]),
        ],
        [helper.make_tensor_value_info("dW", TensorProto.FLOAT, [ROWS, WIDTH])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    return model


def test_the_padding_rows_gradient_is_masked_before_the_lookup_gradient():
    rewritten = padding_rows_without_gradient(_lookup_gradient_model(), {"W": 0})
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops[-1] == "GatherGrad" and "Mul" in ops and "Equal" in ops
    (lookup,) = [n for n in rewritten.graph.node if n.op_type == "GatherGrad"]
    assert lookup.input[:2] == ["shape", "ids"] and lookup.input[2] != "dy"


@pytest.mark.parametrize("model", [_lookup_gradient_model(), _lookup_gradient_model(cast=True)], ids=["", "cast"])
def test_another_weight_is_left_unchanged(model):
    assert padding_rows_without_gradient(model, {"other": 0}) is model


@needs_training_build
@pytest.mark.parametrize(
    "opset, cast, index_type",
    [(17, False, TensorProto.INT64), (12, False, TensorProto.INT64), (17, True, TensorProto.INT32)],
    ids=["opset 17", "opset 12", "through a cast, int32 ids"],
)
def test_the_padding_row_gets_nothing_from_its_lookups(opset, cast, index_type):
    rng = np.random.default_rng(0)
    ids = np.array([[2, 2, 5, 1, 2], [0, 2, 6, 2, 1]], np.int64)
    feeds = {
        "W": rng.standard_normal((ROWS, WIDTH)).astype(np.float32),
        "ids": ids.astype(np.int32 if index_type == TensorProto.INT32 else np.int64),
        "dy": rng.standard_normal((2, 5, WIDTH)).astype(np.float32),
    }
    (found,) = run_onnx(padding_rows_without_gradient(_lookup_gradient_model(opset, cast, index_type), {"W": 2}), feeds)
    expected = np.zeros((ROWS, WIDTH), np.float32)
    np.add.at(expected, ids.reshape(-1), feeds["dy"].reshape(-1, WIDTH))
    assert np.abs(expected[2]).max() > 0  # the padding index is looked up five times
    expected[2] = 0
    np.testing.assert_allclose(found, expected, rtol=1e-6, atol=1e-6)


class _TiedLanguageModel(torch.nn.Module):
    """A seq2seq-style decoder input: every sequence starts with the padding token (Pegasus, Marian), and the output
    projection shares the embedding's weight, so the padding row still gets the projection's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(20, 8, padding_idx=0)
        self.mix = torch.nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embedding(ids)))
        return torch.nn.functional.linear(hidden, self.embedding.weight).flatten(0, 1)


@pytest.mark.parametrize("builder", [pytest.param("ort", marks=needs_training_build), "torch"])
def test_an_embedding_with_a_padding_index_trains_like_pytorch(builder):
    torch.manual_seed(0)
    model = _TiedLanguageModel()
    reference = copy.deepcopy(model)
    desc = {"inputs": [("ids", ["batch", 6]), ("label", ["tokens"])], "outputs": [("loss", [], True)]}
    ce = torch.nn.functional.cross_entropy
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.5), ce, {"_internal_use": {"gradient_builder": builder}})
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(1, 20, (4, 6), generator=g)
        ids[:, 0] = 0  # the padding token starts every sequence
        labels = torch.randint(0, 20, (24,), generator=g)
        trainer.train_step(ids, labels)
        sgd.zero_grad()
        ce(reference(ids), labels).backward()
        sgd.step()
    assert trainer.gradient_builder == builder
    weights = trainer.state_dict(pytorch_format=True)
    for name, value in reference.named_parameters():
        torch.testing.assert_close(weights[name], value.detach(), rtol=1e-4, atol=1e-5, msg=name)
