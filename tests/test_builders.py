"""Unit tests of `trainer/builders.py` on hand-built graphs and plain values: the builder choice rules, the state
contract every input-shape signature must keep, and the state inputs the trainer does not hold."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from helpers import adam_weights, make_trainer, needs_training_build, trainer_weights
from models import LSTMTagger

from orttrainer import optim
from orttrainer.trainer.compile.contract import check_same_state_contract
from orttrainer.trainer.gradient.choice import BuilderChoice, choose_builder
from orttrainer.trainer.gradient.torch_graphs import bind_foreign_state
from orttrainer.trainer.graph.training import build_training_graph
from orttrainer.trainer.runtime import has_training_build
from orttrainer.trainer.update.path import param_groups


def test_builder_choice_rules():
    assert choose_builder("auto") == BuilderChoice("auto", "auto: no custom torch.autograd.Function")
    assert choose_builder("auto", custom_functions=["F"]).builder == "torch"
    assert choose_builder("torch").builder == "torch" and choose_builder("ort").builder == "ort"
    assert choose_builder("auto", onnx_model=True).builder == "ort"
    assert choose_builder("auto", training_build=False).builder == "torch"
    recurrent = choose_builder("auto", recurrent_layers=["LSTM", "GRU", "LSTM"])
    assert recurrent.builder == "torch" and "recurrent layers (GRU, LSTM)" in recurrent.reason
    assert choose_builder("auto", recurrent_layers=["LSTM"], cpu=False).builder == "auto"  # measured on the CPU only
    assert choose_builder("ort", recurrent_layers=["LSTM"]).builder == "ort"
    with pytest.raises(NotImplementedError, match=r"Function\(s\) \['F'\]"):
        choose_builder("ort", custom_functions=["F"])
    with pytest.raises(NotImplementedError, match="extra_postprocess edits the exported forward graph"):
        choose_builder("auto", custom_functions=["F"], edits_forward=True)
    stops = [f"m.py:{line} (`h.detach()`)" for line in range(1, 6)]
    stopped = choose_builder("auto", gradient_edits=stops)
    assert stopped.builder == "torch" and "m.py:1 (`h.detach()`); m.py:2" in stopped.reason
    assert "and 2 more" in stopped.reason
    assert choose_builder("torch", gradient_edits=stops).builder == "torch"
    with pytest.raises(NotImplementedError, match="stops or rewrites a gradient that reaches the loss"):
        choose_builder("ort", gradient_edits=stops)
    with pytest.raises(NotImplementedError, match="extra_postprocess edits the exported forward graph"):
        choose_builder("torch", gradient_edits=stops, edits_forward=True)


def test_every_signature_must_keep_the_state_contract():
    def graph(trainable, shape):
        model = onnx.helper.make_model(
            onnx.helper.make_graph(
                [onnx.helper.make_node("Identity", [f"{p}"], [f"{p}_grad"]) for p in trainable],
                "g",
                [onnx.helper.make_tensor_value_info(p, onnx.TensorProto.FLOAT, shape) for p in trainable],
                [onnx.helper.make_tensor_value_info(f"{p}_grad", onnx.TensorProto.FLOAT, shape) for p in trainable],
            )
        )
        return build_training_graph(
            model,
            data_inputs=[],
            outputs=[],
            trainable=trainable,
            optimizer_name="AdamOptimizer",
            groups=param_groups(optim.AdamConfig(), trainable),
            accumulation_steps=2,
            clip_grad_norm=False,
        )

    check_same_state_contract(graph(["w"], [3]), graph(["w"], [3]))
    with pytest.raises(RuntimeError, match="differs from the first one in state_shapes"):
        check_same_state_contract(graph(["w"], [3]), graph(["w"], [4]))


def test_state_the_trainer_does_not_hold_becomes_a_constant_or_disappears():
    f = onnx.TensorProto.FLOAT
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Add", ["x", "w"], ["h"]), onnx.helper.make_node("Mul", ["h", "used"], ["y"])],
            "g",
            [onnx.helper.make_tensor_value_info(n, f, [2]) for n in ("x", "w", "used", "unused")],
            [onnx.helper.make_tensor_value_info("y", f, [2])],
        )
    )
    values = {"used": torch.tensor([2.0, 3.0]), "unused": torch.zeros(2)}
    bound = bind_foreign_state(copy.deepcopy(model), 1, ["w"], values)
    assert [i.name for i in bound.graph.input] == ["x", "w"]
    assert [(i.name, onnx.numpy_helper.to_array(i).tolist()) for i in bound.graph.initializer] == [("used", [2, 3])]
    with pytest.raises(ValueError, match=r"\['used'\] are neither trainer state"):
        bind_foreign_state(copy.deepcopy(model), 1, ["w"], {})


def test_a_bfloat16_constant_keeps_its_element_type_and_bits():
    bf16 = onnx.TensorProto.BFLOAT16
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["scale"], ["y"])],
            "g",
            [onnx.helper.make_tensor_value_info(n, bf16, [2]) for n in ("x", "scale")],
            [onnx.helper.make_tensor_value_info("y", bf16, [2])],
        )
    )
    value = torch.tensor([2.5, -3.0078125], dtype=torch.bfloat16)  # the second needs bfloat16's last mantissa bit
    (constant,) = bind_foreign_state(model, 1, [], {"scale": value}).graph.initializer
    assert constant.data_type == bf16 and list(constant.dims) == [2]
    assert constant.raw_data == value.view(torch.int16).numpy().tobytes()


@needs_training_build
def test_auto_trains_recurrent_layers_with_the_torch_builder_on_the_cpu():
    """On the training runtime 'auto' would try the 'ort' builder, whose LSTM gradient kernels train ~3x slower on
    the CPU: an LSTM model goes to the torch builder, and trains as torch.optim does."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 30, (3, 6), generator=g), torch.randint(0, 5, (3, 6), generator=g)) for _ in range(3)]
    desc = {"inputs": [("tokens", [3, 6]), ("labels", [3, 6])], "outputs": [("loss", [], True)]}
    torch.manual_seed(0)
    trainer = make_trainer(LSTMTagger(), desc, optim.AdamConfig(lr=1e-2), extra={"utils": {"grad_norm_clip": False}})
    for tokens, labels in batches:
        trainer.train_step(tokens, labels)
    choice = trainer._built.builder
    assert choice.builder == "torch" and "recurrent layers (LSTM)" in choice.reason
    expected = adam_weights(LSTMTagger, batches, lr=1e-2)
    weights = trainer_weights(trainer)
    assert max(float(np.abs(weights[n] - expected[n]).max()) for n in expected) < 1e-5


class StopsGradients(torch.nn.Module):
    """Stops a gradient three ways, each on a path to the loss (`.detach()`, `torch.no_grad()`, `.data`), rewrites
    it with a hook (on an activation, on a parameter), and once stops it where it reaches no gradient (a mask from a
    comparison): transformers' HRM runs its early cycles under `torch.no_grad()`, vector quantisers add
    `(q - x).detach()`, a hook on an embedding's weight trains only some of its rows."""

    def __init__(self, stop: str) -> None:
        super().__init__()
        self.stop = stop
        self.inner, self.outer = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)
        if stop == "parameter_hook":
            rows = torch.tensor([1.0, 0.0, 1.0, 0.5])[:, None]
            self.inner.weight.register_hook(lambda grad: grad * rows)

    def forward(self, x, labels):
        h = self.inner(x)
        if self.stop == "detach":
            h = h + (2 * h).detach()
        elif self.stop == "no_grad":
            with torch.no_grad():
                refined = self.inner(h)
            h = h + refined
        elif self.stop == "data":
            h = h * h.data
        elif self.stop == "activation_hook":
            h.register_hook(lambda grad: grad.clamp(-0.01, 0.01))
        elif self.stop == "mask":  # the detached value decides a mask only: no gradient to stop in any graph
            h = h * (h.detach() > 0)
        return torch.nn.functional.cross_entropy(self.outer(h), labels)


def _stops_desc() -> dict:
    return {"inputs": [("x", ["batch", 4]), ("labels", ["batch"])], "outputs": [("loss", [], True)]}


def _stops_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]


@pytest.mark.parametrize("stop", ["detach", "no_grad", "data", "activation_hook", "parameter_hook", "mask"])
def test_a_model_that_stops_or_hooks_a_gradient_trains_like_torch_optim(stop):
    """'auto' gives such a model to the torch builder: ONNX Runtime's gradient builder differentiated through the
    stop and dropped the hooks (a silently wrong step on the training runtime), and the torch builder's trace
    dropped parameter hooks. A stop that reaches no gradient changes no choice."""
    torch.manual_seed(0)
    model = StopsGradients(stop)
    reference = StopsGradients(stop)  # a copy would not carry the parameter hook
    reference.load_state_dict(model.state_dict())
    trainer = make_trainer(model, _stops_desc(), optim.SGDConfig(lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, labels in _stops_batches():
        trainer.train_step(x, labels)
        optimizer.zero_grad()
        reference(x, labels).backward()
        optimizer.step()
    weights = trainer_weights(trainer)
    expected = {name: p.detach().numpy() for name, p in reference.named_parameters()}
    assert max(float(np.abs(weights[n] - expected[n]).max()) for n in expected) < 1e-6
    choice = trainer._built.builder
    if stop == "mask":
        assert "a gradient that reaches the loss" not in choice.reason
    else:
        assert choice.builder == "torch"
        if has_training_build():  # else 'auto' means the torch builder anyway, for that reason
            assert "stops or rewrites a gradient that reaches the loss" in choice.reason
            assert ("parameter inner.weight" if stop == "parameter_hook" else "test_builders.py") in choice.reason


@needs_training_build
def test_the_ort_builder_refuses_a_forward_that_stops_a_gradient_naming_the_place():
    model = StopsGradients("detach")
    trainer = make_trainer(
        model, _stops_desc(), optim.SGDConfig(lr=0.1), extra={"_internal_use": {"gradient_builder": "ort"}}
    )
    with pytest.raises(NotImplementedError, match=r"test_builders.py:\d+ \(`h = h \+ \(2 \* h\).detach\(\)`\)"):
        trainer.train_step(*_stops_batches()[0])


def test_a_hook_that_runs_after_the_gradient_is_accumulated_is_refused_naming_the_parameter():
    model = StopsGradients("mask")
    model.outer.bias.register_post_accumulate_grad_hook(lambda parameter: None)
    trainer = make_trainer(model, _stops_desc(), optim.SGDConfig(lr=0.1))
    with pytest.raises(ValueError, match=r"parameters \['outer.bias'\] have hooks that run after .*register_hook"):
        trainer.train_step(*_stops_batches()[0])
