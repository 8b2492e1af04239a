"""ONNX models trained with the torch gradient builder (an OnnxModule traced, orttrainer/trainer/gradient/
onnx_module/): the same weights and eval outputs as ONNX Runtime's gradient builder, 'auto' without the training
build, the first-step build, initializer names in checkpoints, and what is refused."""

from __future__ import annotations

import copy
import os
import sys
import warnings

import numpy as np
import onnx
import pytest
import torch
from helpers import (
    export_training_onnx,
    make_trainer,
    max_difference,
    needs_training_build,
    trainer_weights,
)
from models import TinyTransformer, mlp_batches, transformer_desc, transformer_loss
from onnx import helper, numpy_helper
from test_trainer_features import _export_with_loss, _log_softmax_nll_model, _ModelWithLoss

from orttrainer import optim
from orttrainer.trainer.build import forward as build_forward
from orttrainer.trainer.gradient.choice import choose_builder
from orttrainer.trainer.gradient.errors import GradientBuildError
from orttrainer.trainer.graph.passes import VERIFY_ENVIRONMENT_VARIABLE

TORCH = {"_internal_use": {"gradient_builder": "torch"}}
ORT = {"_internal_use": {"gradient_builder": "ort"}}
MLP_DESC = {
    "inputs": [("x", ["batch", 32]), ("target", ["batch"])],
    "outputs": [("loss", [], True), ("logits", ["batch", 10])],
}


def digits_mlp():
    """examples/onnx_model.py's classifier (Gemm, Relu, SoftmaxCrossEntropyLoss)."""
    pytest.importorskip("sklearn", reason="examples/onnx_model.py imports scikit-learn (the examples extra)")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from onnx_model import build_model

    g = torch.Generator().manual_seed(3)
    data = [(torch.rand(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]
    desc = {
        "inputs": [("pixels", ["batch", 64]), ("label", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", 10])],
    }
    return build_model(), desc, data


def exported_mlp():
    """tests/test_trainer_features.py's MLP with cross-entropy, exported by the TorchScript exporter (opset 14)."""
    torch.manual_seed(0)
    return _export_with_loss(_ModelWithLoss()), MLP_DESC, mlp_batches(4)


def log_softmax_nll():
    """MatMul, LogSoftmax, NegativeLogLikelihoodLoss (post-processed into SoftmaxCrossEntropyLoss)."""
    desc = {"inputs": [("x", ["batch", 32]), ("target", ["batch"])], "outputs": [("loss", [], True)]}
    return _log_softmax_nll_model(), desc, mlp_batches(4)


class _TransformerWithLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer(dropout=0.0)

    def forward(self, tokens, target):
        logits = self.model(tokens)
        return transformer_loss(logits, target), logits


def exported_transformer(seq: int = 8):
    """A 2-layer post-LN transformer (embedding, attention, LayerNorm, GELU) with its loss, exported by the
    TorchScript exporter at opset 17. The export bakes the sequence length into its attention reshapes, so the
    batches keep `seq`; the batch size varies."""
    torch.manual_seed(0)
    module = _TransformerWithLoss()
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 50, (b, seq), generator=g), torch.randint(0, 50, (b, seq), generator=g)) for b in (2, 3)]
    dims = {0: "batch", 1: "seq"}
    axes = {"tokens": dims, "target": dims, "logits": dims}
    model = export_training_onnx(module, data[0], ["tokens", "target"], ["loss", "logits"], axes, opset_version=17)
    return model, transformer_desc(), data + data


class _SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 4 * 4, 10)

    def forward(self, x, target):
        h = torch.nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
        logits = self.head(h.flatten(1))
        return torch.nn.functional.cross_entropy(logits, target), logits


def exported_cnn():
    """Conv, training-mode BatchNormalization, Relu, MaxPool, Flatten, Gemm, SoftmaxCrossEntropyLoss (opset 14)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(4)]
    axes = {"x": {0: "batch"}, "target": {0: "batch"}, "logits": {0: "batch"}}
    model = export_training_onnx(_SmallCNN(), data[0], ["x", "target"], ["loss", "logits"], axes)
    desc = {"inputs": [("x", ["batch", 1, 8, 8]), ("target", ["batch"])], "outputs": MLP_DESC["outputs"]}
    return model, desc, data


def oddly_named(bias: str = "/layer/b:0"):
    """x @ W + b with initializer names the trainer keeps in its state: a dot, slashes and a colon."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["h"]),
        helper.make_node("Add", ["h", bias], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "target"], ["loss"]),
    ]
    graph = helper.make_graph(
        nodes,
        "odd",
        [helper.make_tensor_value_info("x", 1, ["batch", 32]), helper.make_tensor_value_info("target", 7, ["batch"])],
        [helper.make_tensor_value_info("loss", 1, []), helper.make_tensor_value_info("logits", 1, ["batch", 10])],
        [
            numpy_helper.from_array(rng.standard_normal((32, 10)).astype(np.float32), "fc1.weight"),
            numpy_helper.from_array(np.zeros(10, np.float32), bias),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, MLP_DESC, mlp_batches(4)


MODELS = {
    "digits": digits_mlp,
    "mlp": exported_mlp,
    "nll": log_softmax_nll,
    "transformer": exported_transformer,
    "cnn": exported_cnn,
    "names": oddly_named,
}
CONFIGS = {"sgd": lambda: optim.SGDConfig(lr=0.1), "adam": lambda: optim.AdamConfig(lr=1e-2)}
# Attention's key bias and a convolution's bias before training-mode BatchNorm get gradients that are zero in exact
# arithmetic (softmax ignores a constant shift; BatchNorm subtracts the batch mean), so each builder's is rounding
# noise (1e-10); Adam divides a gradient by its own size and moves such a weight by up to lr per step, differently
# for two correct builders. Frozen under Adam, the rest is compared exactly.
ADAM_FROZEN = {
    "transformer": [f"model.encoder.layers.{k}.self_attn.in_proj_bias" for k in (0, 1)],
    "cnn": ["conv.bias"],
}
# BatchNorm's running statistics: ONNX Runtime's gradient builder fails on them ("failed to find NodeArg
# norm.running_mean_grad") instead of reporting them unreachable, so they are frozen for both builders
FROZEN = {"cnn": ["norm.running_mean", "norm.running_var"]}


def train(model, desc, config, data, extra):
    trainer = make_trainer(copy.deepcopy(model), desc, config, extra=extra)
    for batch in data:
        trainer.train_step(*batch)
    return trainer


@needs_training_build
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(MODELS))
def test_the_torch_builder_trains_an_onnx_model_like_the_ort_builder(name, config, monkeypatch):
    if name == "cnn":  # ONNX Runtime's gradient graph has MaxPoolGrad in the ONNX domain, which onnx.checker rejects
        monkeypatch.setenv(VERIFY_ENVIRONMENT_VARIABLE, "0")
    model, desc, data = MODELS[name]()
    adam_frozen = ADAM_FROZEN.get(name, []) if config == "adam" else []
    frozen = {"utils": {"frozen_weights": FROZEN.get(name, []) + adam_frozen}}
    ort_trainer = train(model, desc, CONFIGS[config](), data, {**ORT, **frozen})
    torch_trainer = train(model, desc, CONFIGS[config](), data, {**TORCH, **frozen})
    assert (ort_trainer.gradient_builder, torch_trainer.gradient_builder) == ("ort", "torch")
    assert max_difference(trainer_weights(torch_trainer), trainer_weights(ort_trainer)) < 1e-5
    weights = trainer_weights(torch_trainer)
    assert max_difference(weights, {n: v for n, v in initial_values(model).items() if n in weights}) > 1e-3
    if name == "cnn":  # both builders move the running statistics by the ONNX specification (population variance)
        statistics = torch_trainer._training_session.get_state(FROZEN["cnn"])
        assert max_difference(statistics, ort_trainer._training_session.get_state(FROZEN["cnn"])) < 1e-5
        assert max_difference(statistics, {n: v for n, v in initial_values(model).items() if n in statistics}) > 1e-2
        return
    got, expected = _listed(torch_trainer.eval_step(*data[0])), _listed(ort_trainer.eval_step(*data[0]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def initial_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _listed(outputs) -> list[torch.Tensor]:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def test_auto_trains_with_the_torch_builder_without_the_training_build(monkeypatch, caplog):
    """Like PyTorch: SGD on the exported MLP gives PyTorch's weights (with the training build installed, the
    check that chooses is made to say it is not)."""
    monkeypatch.setattr(build_forward, "has_training_build", lambda: False)
    torch.manual_seed(0)
    module = _ModelWithLoss()
    reference = copy.deepcopy(module)
    with caplog.at_level("INFO", logger="orttrainer"):
        trainer = make_trainer(_export_with_loss(module), MLP_DESC, optim.SGDConfig(lr=0.1))
        sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
        for x, y in mlp_batches(5, batch=8) + mlp_batches(2, batch=5, seed=2):  # two input shapes: two traced graphs
            trainer.train_step(x, y)
            sgd.zero_grad()
            reference(x, y)[0].backward()
            sgd.step()
    assert trainer.gradient_builder == "torch"
    assert "auto: an ONNX model, and onnxruntime-training is not installed" in caplog.text
    expected = {n: p.detach().numpy() for n, p in reference.named_parameters()}
    assert max_difference(trainer_weights(trainer), expected) < 1e-6


class _PooledCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Linear(4 * 4 * 4, 10)

    def forward(self, x, target):
        logits = self.head(torch.nn.functional.avg_pool2d(torch.relu(self.conv(x)), 2).flatten(1))
        return torch.nn.functional.cross_entropy(logits, target), logits


def _pooled_cnn():
    """`_PooledCNN` (seed 0) exported with its loss, a dynamic batch, and three batches."""
    torch.manual_seed(0)
    module = _PooledCNN()
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3)]
    axes = {"x": {0: "batch"}, "target": {0: "batch"}, "logits": {0: "batch"}}
    model = export_training_onnx(module, data[0], ["x", "target"], ["loss", "logits"], axes)
    desc = {"inputs": [("x", ["batch", 1, 8, 8]), ("target", ["batch"])], "outputs": MLP_DESC["outputs"]}
    return model, desc, data


@needs_training_build
def test_auto_trains_an_onnx_model_with_the_torch_builder_where_onnx_runtimes_gradient_build_fails(caplog):
    """An exported CNN with AveragePool and a dynamic batch: ONNX Runtime's AveragePool gradient kernel is refused
    (gradient/ort_builder.py), so 'auto' builds the ONNX model with the torch builder, which trains it like
    torch.optim.SGD trains the module it was exported from; an explicit 'ort' is the error."""
    model, desc, data = _pooled_cnn()
    torch.manual_seed(0)
    reference = _PooledCNN()
    with pytest.raises(GradientBuildError, match="AveragePool gradient kernel cannot train this model"):
        make_trainer(copy.deepcopy(model), desc, optim.SGDConfig(lr=0.1), extra=ORT)
    with caplog.at_level("INFO", logger="orttrainer"):
        trainer = train(model, desc, optim.SGDConfig(lr=0.1), data, {})
    assert trainer.gradient_builder == "torch"
    assert "auto: ONNX Runtime's gradient builder failed (ONNX Runtime's AveragePool gradient kernel" in caplog.text
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        sgd.zero_grad()
        reference(x, y)[0].backward()
        sgd.step()
    expected = {n: p.detach().numpy() for n, p in reference.named_parameters()}
    assert max_difference(trainer_weights(trainer), expected) < 1e-5


@needs_training_build
def test_an_onnx_model_neither_builder_trains_names_both_reasons(monkeypatch):
    def refused(*args, **kwargs):
        raise RuntimeError("the OnnxModule cannot run this graph")

    monkeypatch.setattr(build_forward, "_onnx_source", refused)
    model, desc, _ = _pooled_cnn()
    with pytest.raises(RuntimeError, match=r"neither gradient builder.*AveragePool.*the OnnxModule cannot run"):
        make_trainer(model, desc, optim.SGDConfig(lr=0.1))


def test_the_torch_builder_compiles_on_the_first_step_and_takes_a_state_loaded_before():
    model, desc, data = oddly_named()
    first = make_trainer(model, desc, optim.SGDConfig(lr=0.1), extra=TORCH)
    assert first._training_session is None and first.gradient_builder is None  # compiled with the first batch
    first.train_step(*data[0])
    state = first.state_dict()
    second = make_trainer(model, desc, optim.SGDConfig(lr=0.1), extra=TORCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert second.state_dict() == {}  # nothing before the first step, as for a PyTorch model
    second.load_state_dict(state)
    loss, logits = second.eval_step(*data[1])  # an eval step builds too
    assert max_difference(trainer_weights(second), trainer_weights(first)) == 0.0
    torch.testing.assert_close((loss, logits), tuple(first.eval_step(*data[1])))


def test_the_state_dict_keeps_the_initializer_names():
    model, desc, data = oddly_named()
    trainer = train(model, desc, optim.AdamConfig(lr=1e-2), data, TORCH)
    state = trainer.state_dict()
    assert sorted(state["model"]["full_precision"]) == ["/layer/b:0", "fc1.weight"]
    assert sorted(k for k in state["optimizer"] if k != "shared_optimizer_state") == ["/layer/b:0", "fc1.weight"]
    resumed = make_trainer(model, desc, optim.AdamConfig(lr=1e-2), extra=TORCH)
    resumed.load_state_dict(state)
    for trained in (trainer, resumed):
        trained.train_step(*data[0])
    assert max_difference(trainer_weights(resumed), trainer_weights(trainer)) == 0.0


def test_checkpoint_files_keep_the_initializer_names(tmp_path):
    """(HDF5 reads '/' in a key as a path: names with slashes go into state dicts, not checkpoint files.)"""
    model, desc, data = oddly_named(bias="dense.bias:0")
    trainer = train(model, desc, optim.AdamConfig(lr=1e-2), data, TORCH)
    path = str(tmp_path / "odd.ortcp")
    trainer.save_checkpoint(path)
    resumed = make_trainer(model, desc, optim.AdamConfig(lr=1e-2), extra=TORCH)
    resumed.load_checkpoint(path)
    for trained in (trainer, resumed):
        trained.train_step(*data[0])
    assert max_difference(trainer_weights(resumed), trainer_weights(trainer)) == 0.0


@needs_training_build
def test_a_torch_builder_checkpoint_continues_on_the_ort_builder(tmp_path):
    model, desc, data = oddly_named(bias="dense.bias:0")
    trainer = train(model, desc, optim.AdamConfig(lr=1e-2), data[:2], TORCH)
    path = str(tmp_path / "odd.ortcp")
    trainer.save_checkpoint(path)
    on_ort = make_trainer(model, desc, optim.AdamConfig(lr=1e-2), extra=ORT)
    on_ort.load_checkpoint(path)
    for batch in data[2:]:
        trainer.train_step(*batch)
        on_ort.train_step(*batch)
    assert max_difference(trainer_weights(on_ort), trainer_weights(trainer)) < 1e-6


def test_what_the_torch_builder_refuses_for_an_onnx_model_is_named_at_construction():
    model, desc, _ = oddly_named()
    last_loss = {"inputs": desc["inputs"], "outputs": [desc["outputs"][1], ("loss", [], True)]}
    with pytest.raises(ValueError, match="needs the loss as the first model_desc output"):
        make_trainer(model, last_loss, optim.SGDConfig(), extra=TORCH)
    unsupported = copy.deepcopy(model)
    unsupported.graph.node.insert(2, helper.make_node("TfIdfVectorizer", ["logits"], ["counts"], name="tf"))
    with pytest.raises(GradientBuildError, match=r"node 'tf' \(TfIdfVectorizer, opset 17\): no implementation of"):
        make_trainer(unsupported, desc, optim.SGDConfig(), extra=TORCH)


def test_the_builder_choice_for_an_onnx_model():
    assert choose_builder("auto", onnx_model=True, training_build=True).builder == "ort"
    assert choose_builder("auto", onnx_model=True, training_build=False).builder == "torch"
    assert choose_builder("torch", onnx_model=True, training_build=True).builder == "torch"
    with pytest.raises(ValueError, match="'ort' needs ONNX Runtime's gradient builder"):
        choose_builder("ort", onnx_model=True, training_build=False)


def test_an_initializer_that_does_not_reach_the_loss_is_frozen_under_its_own_name():
    model, desc, data = oddly_named()
    model.graph.initializer.append(numpy_helper.from_array(np.ones(10, np.float32), "aux.scale:0"))
    model.graph.node.append(helper.make_node("Mul", ["logits", "aux.scale:0"], ["aux"]))  # no output reads it
    with pytest.warns(UserWarning, match=r"parameters \['aux.scale:0'\] do not influence the loss"):
        trainer = train(model, desc, optim.SGDConfig(lr=0.1), data[:2], TORCH)
    assert trainer._built.compiled.frozen == ["aux.scale:0"]
    assert sorted(trainer_weights(trainer)) == ["/layer/b:0", "fc1.weight"]
