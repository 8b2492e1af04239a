"""Unit tests of `trainer/builders.py` on hand-built graphs and plain values: the builder choice rules, the state
contract every input-shape signature must keep, and the state inputs the trainer does not hold."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch

from orttrainer import optim
from orttrainer.trainer.compile.contract import check_same_state_contract
from orttrainer.trainer.gradient.choice import BuilderChoice, choose_builder
from orttrainer.trainer.gradient.torch_graphs import bind_foreign_state
from orttrainer.trainer.graph.training import build_training_graph
from orttrainer.trainer.update.path import param_groups


def test_builder_choice_rules():
    assert choose_builder("auto") == BuilderChoice("auto", "auto: no custom torch.autograd.Function")
    assert choose_builder("auto", custom_functions=["F"]).builder == "torch"
    assert choose_builder("torch").builder == "torch" and choose_builder("ort").builder == "ort"
    assert choose_builder("auto", onnx_model=True).builder == "ort"
    assert choose_builder("auto", training_build=False).builder == "torch"
    with pytest.raises(NotImplementedError, match=r"Function\(s\) \['F'\]"):
        choose_builder("ort", custom_functions=["F"])
    with pytest.raises(NotImplementedError, match="extra_postprocess edits the exported forward graph"):
        choose_builder("auto", custom_functions=["F"], edits_forward=True)


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
