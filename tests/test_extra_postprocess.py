"""`_internal_use.extra_postprocess` on a PyTorch model, on both gradient builders: the function receives the forward
ONNX model (loss first, initializers named like the module's parameters), and training follows the graph it returns
— a Relu replaced by a Sigmoid trains exactly like the PyTorch model with a sigmoid. The 'ort' builder edits the
TorchScript export, the torch builder torch.export's (build/forward.edited_torch_forward)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from helpers import make_trainer, max_difference, torch_weights, trainer_weights
from models import StraightThrough
from torch import nn

from orttrainer import amp, optim
from orttrainer.trainer.runtime import has_training_build

BUILDERS = ["torch", "ort"] if has_training_build() else ["torch"]
DESC = {"inputs": [("x", ["batch", 8]), ("y", ["batch"])], "outputs": [("loss", [], True), ("logits", ["batch", 4])]}
CE = nn.functional.cross_entropy


class Net(nn.Module):
    def __init__(self, activation=torch.relu) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.activation = activation

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x)))


def _batches(n: int, batch: int = 6):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


def relu_to_sigmoid(seen: list):
    def edit(model: onnx.ModelProto) -> onnx.ModelProto:
        seen.append(model)
        relus = [n for n in model.graph.node if n.op_type == "Relu"]
        assert len(relus) == 1
        relus[0].op_type = "Sigmoid"
        return model

    return edit


@pytest.mark.parametrize("builder", BUILDERS)
def test_an_edit_of_the_forward_graph_is_what_trains_and_evaluates(builder):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    reference.activation = torch.sigmoid
    seen: list[onnx.ModelProto] = []
    options = {"_internal_use": {"extra_postprocess": relu_to_sigmoid(seen), "gradient_builder": builder}}
    trainer = make_trainer(model, DESC, optim.AdamConfig(lr=1e-2), CE, options)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    for x, y in _batches(6):
        loss, _ = trainer.train_step(x, y)
        ref_opt.zero_grad()
        expected = CE(reference(x), y)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert trainer.gradient_builder == builder
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5
    forward = seen[0]  # the forward model: the loss first, the state named as the module names it
    assert [o.name for o in forward.graph.output] == ["loss", "logits"]
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} <= {i.name for i in forward.graph.initializer}
    x, y = _batches(1, batch=3)[0]  # another batch size
    loss, logits = trainer.eval_step(x, y)
    with torch.no_grad():
        np.testing.assert_allclose(logits.numpy(), reference(x).numpy(), rtol=1e-4, atol=1e-5)
        assert float(loss) == pytest.approx(float(CE(reference(x), y)), rel=1e-5)


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_parameter_the_edit_disconnects_is_not_trained_and_says_so(builder):
    def bypass_fc1(model: onnx.ModelProto) -> onnx.ModelProto:
        """The activation reads concat(x, x) instead of fc1(x); fc1's node and weights go."""
        graph = model.graph
        activation = next(n for n in graph.node if n.op_type == "Relu")
        fc1 = next(n for n in graph.node if activation.input[0] in n.output)
        graph.node.remove(fc1)
        concat = onnx.helper.make_node("Concat", ["x", "x"], [activation.input[0]], axis=1)
        graph.node.insert(list(graph.node).index(activation), concat)
        for name in ("fc1.weight", "fc1.bias"):
            graph.initializer.remove(next(i for i in graph.initializer if i.name == name))
        return model

    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    options = {"_internal_use": {"extra_postprocess": bypass_fc1, "gradient_builder": builder}}
    trainer = make_trainer(model, DESC, optim.SGDConfig(lr=0.1), CE, options)
    with pytest.warns(UserWarning, match=r"fc1\.weight"):
        for x, y in _batches(2):
            trainer.train_step(x, y)
    state = trainer.state_dict(pytorch_format=True)
    assert torch.equal(torch.as_tensor(state["fc1.weight"]), before["fc1.weight"])
    assert not torch.equal(torch.as_tensor(state["fc2.weight"]), before["fc2.weight"])


def test_custom_functions_with_an_edited_forward_are_refused():
    model = Net(activation=StraightThrough.apply)
    options = {"_internal_use": {"extra_postprocess": lambda m: m}}
    trainer = make_trainer(model, DESC, optim.SGDConfig(), CE, options)
    with pytest.raises(NotImplementedError, match=r"extra_postprocess .* \['StraightThrough'\].* their backward"):
        trainer.train_step(*_batches(1)[0])


@pytest.mark.parametrize("builder", BUILDERS)
def test_mixed_precision_trains_the_edited_graph_within_float16_tolerance(builder):
    from test_mixed_precision import FP16_TOLERANCE

    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    reference.activation = torch.sigmoid
    options = {
        "_internal_use": {"extra_postprocess": relu_to_sigmoid([]), "gradient_builder": builder},
        "mixed_precision": {"enabled": True, "loss_scaler": amp.DynamicLossScaler(loss_scale=1024.0)},
    }
    trainer = make_trainer(model, DESC, optim.AdamConfig(lr=1e-3), CE, options)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    for x, y in _batches(8):
        trainer.train_step(x, y)
        ref_opt.zero_grad()
        CE(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < FP16_TOLERANCE
