"""Real ONNX models through OnnxModule (orttrainer/trainer/gradient/onnx_module/) and the torch gradient builder:
a transformers BERT at opsets 12 and 17, a ResNet-style CNN with BatchNorm and an LSTM, each exported by torch.onnx
(the TorchScript exporter in training mode, as legacy ORTTrainer users made their models) and run through ONNX
Runtime's transformer optimizer (`onnxruntime.transformers.optimizer`, which fuses BERT's layer norms and GELUs into
com.microsoft SkipLayerNormalization and BiasGelu).

- On both lanes, the optimized model trains with the torch builder and its per-step losses equal PyTorch's
  training of the module it was exported from (SGD, the same batches; dropout off, BatchNorm on batch
  statistics). With the training build, ONNX Runtime's own gradient builder trains the exported model to the same
  losses (it has no gradient for SkipLayerNormalization, so not the optimized BERT: the torch builder is how that
  one trains).
- A model saved with its weights in an external data file trains as the in-memory model does.
- BatchNormalization's running statistics: OnnxModule computes the spec's (population variance, momentum the
  weight of the old value) and writes them into its buffers, and the torch builder records them as mutated
  buffers, as for a PyTorch BatchNorm.

ONNX Runtime's transformers package imports `coloredlogs` (in the test extra). The optimizer imports its sibling
modules by top-level names, one of which (`onnx_model`) examples/ has too: see `_transformer_optimizer`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import tempfile
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import torch
from helpers import export_training_onnx, make_trainer, needs_training_build
from torch import nn

from orttrainer import optim
from orttrainer.trainer.gradient.errors import GradientBuildError
from orttrainer.trainer.gradient.onnx_module import OnnxModule, running_statistics
from orttrainer.trainer.gradient.torch_builder import build_torch_gradient_graph
from orttrainer.trainer.graph.passes import VERIFY_ENVIRONMENT_VARIABLE

pytest.importorskip("transformers", reason="the BERT models come from transformers (the examples extra)")
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

LR = 0.1


class Bert(nn.Module):
    """BertForSequenceClassification (hidden 32, 2 layers, 4 heads, random init, dropout off) returning its loss."""

    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
        self.bert = BertForSequenceClassification(config)

    def forward(self, ids, mask, labels):
        out = self.bert(input_ids=ids, attention_mask=mask, labels=labels)
        return out.loss, out.logits


class Block(nn.Module):
    """A residual block: conv-BN-ReLU-conv-BN plus a 1x1 conv-BN projection shortcut, then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        h = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    """Stem (conv, BN, ReLU, max pool), one residual block, global average pool, linear head, cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.block = Block(8, 16, 2)
        self.fc = nn.Linear(16, 5)

    def forward(self, x, y):
        h = nn.functional.adaptive_avg_pool2d(self.block(self.stem(x)), 1)
        logits = self.fc(torch.flatten(h, 1))
        return nn.functional.cross_entropy(logits, y), logits


class Tagger(nn.Module):
    """Embedding, a batch-first LSTM, a linear head per step, cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lstm, self.head = nn.Embedding(20, 8), nn.LSTM(8, 12, batch_first=True), nn.Linear(12, 20)

    def forward(self, ids, y):
        out, _ = self.lstm(self.embed(ids))
        logits = self.head(out)
        return nn.functional.cross_entropy(logits.reshape(-1, 20), y.reshape(-1)), logits


@dataclass(frozen=True)
class RealModel:
    module: nn.Module
    batches: list[tuple[torch.Tensor, ...]]
    desc: dict
    axes: dict[str, dict[int, str]]
    opset: int


def _bert(opset: int) -> RealModel:
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        mask = torch.ones(4, 8, dtype=torch.int64)
        mask[0, 6:] = 0
        batches.append((torch.randint(0, 50, (4, 8), generator=g), mask, torch.randint(0, 2, (4,), generator=g)))
    desc = {
        "inputs": [("ids", ["batch", "seq"]), ("mask", ["batch", "seq"]), ("labels", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", 2])],
    }
    axes = {"ids": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}, "labels": {0: "batch"}}
    return RealModel(Bert(), batches, desc, {**axes, "logits": {0: "batch"}}, opset)


def _resnet() -> RealModel:
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(4)]
    desc = {
        "inputs": [("x", ["batch", 3, 12, 12]), ("y", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", 5])],
    }
    return RealModel(ResNet(), batches, desc, {"x": {0: "batch"}, "y": {0: "batch"}, "logits": {0: "batch"}}, 14)


def _lstm() -> RealModel:
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 20, (4, 5), generator=g), torch.randint(0, 20, (4, 5), generator=g)) for _ in range(4)]
    desc = {
        "inputs": [("ids", ["batch", 5]), ("y", ["batch", 5])],
        "outputs": [("loss", [], True), ("logits", ["batch", 5, 20])],
    }
    return RealModel(Tagger(), batches, desc, {"ids": {0: "batch"}, "y": {0: "batch"}, "logits": {0: "batch"}}, 14)


MODELS: dict[str, Callable[[], RealModel]] = {
    "bert12": lambda: _bert(12),
    "bert17": lambda: _bert(17),
    "resnet": _resnet,
    "lstm": _lstm,
}


@functools.cache
def real_model(name: str) -> RealModel:
    torch.manual_seed(0)
    model = MODELS[name]()
    return RealModel(model.module.train(), model.batches, model.desc, model.axes, model.opset)


@functools.cache
def exported(name: str) -> onnx.ModelProto:
    m = real_model(name)
    inputs = [n for n, _ in m.desc["inputs"]]
    return export_training_onnx(m.module, m.batches[0], inputs, ["loss", "logits"], m.axes, opset_version=m.opset)


_ORT_MODULES: dict[str, types.ModuleType] = {}


@contextlib.contextmanager
def _transformer_optimizer() -> Iterator[Callable]:
    """`optimize_model`, with the top-level module `onnx_model` the optimizer imports from its own folder resolving
    to its own file while it runs: examples/onnx_model.py has that name too, and another test module puts
    examples/ at the front of sys.path (the optimizer's package only appends its folder). The name is given back
    afterwards."""
    import onnxruntime.transformers as package

    folder = os.path.dirname(package.__file__)
    previous = sys.modules.pop("onnx_model", None)
    sys.path.insert(0, folder)
    try:
        if "onnx_model" in _ORT_MODULES:
            sys.modules["onnx_model"] = _ORT_MODULES["onnx_model"]
        from onnxruntime.transformers.optimizer import optimize_model

        _ORT_MODULES["onnx_model"] = sys.modules["onnx_model"]
        yield optimize_model
    finally:
        sys.path.remove(folder)
        sys.modules.pop("onnx_model", None)
        if previous is not None:
            sys.modules["onnx_model"] = previous


@functools.cache
def optimized(name: str) -> onnx.ModelProto:
    """The exported model after ONNX Runtime's transformer optimizer (BERT's fusions; saved and loaded again, as a
    user would)."""
    with tempfile.TemporaryDirectory() as folder, _transformer_optimizer() as optimize_model:
        source, target = os.path.join(folder, "model.onnx"), os.path.join(folder, "optimized.onnx")
        onnx.save(exported(name), source)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = optimize_model(source, model_type="bert", num_heads=4, hidden_size=32, opt_level=0)
        optimizer.save_model_to_file(target)
        return onnx.load(target)


@functools.cache
def pytorch_losses(name: str) -> tuple[float, ...]:
    """The per-step losses of the module itself trained with torch.optim.SGD on the batches."""
    m = real_model(name)
    module = copy.deepcopy(m.module)
    sgd = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for batch in m.batches:
        sgd.zero_grad()
        loss, _ = module(*batch)
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return tuple(losses)


def trainer_losses(model: onnx.ModelProto, name: str, builder: str) -> tuple[float, ...]:
    m = real_model(name)
    extra = {"_internal_use": {"gradient_builder": builder}, "utils": {"frozen_weights": running_statistics(model)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(copy.deepcopy(model), m.desc, optim.SGDConfig(lr=LR), extra=extra)
        assert trainer.gradient_builder in (None, builder)
        return tuple(float(trainer.train_step(*batch)[0]) for batch in m.batches)


@functools.cache
def torch_builder_losses(name: str) -> tuple[float, ...]:
    return trainer_losses(optimized(name), name, "torch")


def test_the_optimizer_fuses_bert_into_contrib_ops():
    for name in ("bert12", "bert17"):
        ops = {(n.domain, n.op_type) for n in optimized(name).graph.node}
        assert {("com.microsoft", "SkipLayerNormalization"), ("com.microsoft", "BiasGelu")} <= ops, ops
    assert ("", "LayerNormalization") in {(n.domain, n.op_type) for n in optimized("bert12").graph.node}  # at opset 12
    assert "LSTM" in {n.op_type for n in optimized("lstm").graph.node}
    assert {"Conv", "BatchNormalization", "MaxPool"} <= {n.op_type for n in optimized("resnet").graph.node}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_optimized_model_trains_on_the_torch_builder_like_pytorch(name):
    losses, expected = torch_builder_losses(name), pytorch_losses(name)
    np.testing.assert_allclose(losses, expected, rtol=2e-6, atol=2e-6)
    assert max(expected) - min(expected) > 1e-2  # the steps change the model


@needs_training_build
@pytest.mark.parametrize("name", list(MODELS))
def test_onnx_runtimes_gradient_builder_trains_the_exported_model_to_the_same_losses(name, monkeypatch):
    if name == "resnet":  # its gradient graph has MaxPoolGrad in the ONNX domain, which onnx.checker rejects
        monkeypatch.setenv(VERIFY_ENVIRONMENT_VARIABLE, "0")  # (docs/engine.md §11.1)
    np.testing.assert_allclose(trainer_losses(exported(name), name, "ort"), torch_builder_losses(name), rtol=2e-6)
    if name.startswith("bert"):
        with pytest.raises(GradientBuildError, match="cannot differentiate op 'SkipLayerNormalization'"):
            trainer_losses(optimized(name), name, "ort")


def test_a_model_with_external_data_trains_like_the_model_in_memory(tmp_path):
    path = str(tmp_path / "bert.onnx")
    onnx.save(optimized("bert17"), path, save_as_external_data=True, location="bert.weights", size_threshold=0)
    assert os.path.getsize(tmp_path / "bert.weights") > 10_000 and os.path.getsize(path) < 100_000
    lazy = onnx.load(path, load_external_data=False)
    with pytest.raises(GradientBuildError, match=r"external file 'bert.weights'.*onnx.load\(path\)"):
        OnnxModule(lazy, ["ids", "mask", "labels"], ["loss"], [])
    np.testing.assert_allclose(trainer_losses(onnx.load(path), "bert17", "torch"), torch_builder_losses("bert17"))


class _ConvNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3, momentum=0.2)

    def forward(self, x, y):
        h = self.norm(self.conv(x))
        return (h.mean(dim=(2, 3)) - y).pow(2).mean(), h


def _conv_norm():
    torch.manual_seed(0)
    module = _ConvNorm().train()
    with torch.no_grad():
        module.norm.running_mean.uniform_(-1, 1)
        module.norm.running_var.uniform_(0.5, 2)
    batch = (torch.randn(4, 2, 5, 5), torch.randn(4, 3))
    axes = {"x": {0: "batch"}, "y": {0: "batch"}, "h": {0: "batch"}}
    return module, batch, export_training_onnx(module, batch, ["x", "y"], ["loss", "h"], axes)


def test_batchnorm_running_statistics_follow_the_onnx_spec_and_update_the_buffers():
    """running_mean = momentum · old + (1 - momentum) · batch mean, as PyTorch's (ONNX's momentum is 1 - PyTorch's);
    running_var likewise with the batch's population variance (the spec's), where PyTorch takes the unbiased one."""
    module, batch, model = _conv_norm()
    statistics = running_statistics(model)
    assert statistics == ["norm.running_mean", "norm.running_var"]
    trainable = [i.name for i in model.graph.initializer if i.name not in statistics]
    onnx_module = OnnxModule(model, ["x", "y"], ["loss", "h"], trainable, statistics)
    assert set(onnx_module.statistics) == set(statistics)
    old_var = module.norm.running_var.clone()
    with torch.no_grad():
        conv = module.conv(batch[0])
        module(*batch)  # PyTorch's update
    onnx_module(*batch)
    buffers = {onnx_module.state_names[n]: b for n, b in onnx_module.named_buffers()}
    torch.testing.assert_close(buffers["norm.running_mean"], module.norm.running_mean, rtol=1e-6, atol=1e-6)
    population = conv.var(dim=(0, 2, 3), unbiased=False)
    torch.testing.assert_close(buffers["norm.running_var"], 0.8 * old_var + 0.2 * population, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(buffers["norm.running_var"], module.norm.running_var)  # Bessel's correction


def test_the_torch_builder_records_the_statistics_as_mutated_buffers():
    """What a trainer needs to carry the statistics into its state: the traced graph's in-place buffer updates."""
    _, batch, model = _conv_norm()
    statistics = running_statistics(model)
    trainable = [i.name for i in model.graph.initializer if i.name not in statistics]
    module = OnnxModule(model, ["x", "y"], ["loss"], trainable, statistics)
    names = {v: k for k, v in module.state_names.items()}
    graph = build_torch_gradient_graph(module, None, ["x", "y"], list(batch), ["loss"], [names[t] for t in trainable])
    assert sorted(module.state_names[b] for b in graph.mutated_buffers) == statistics


@needs_training_build
def test_onnx_module_computes_the_statistics_onnx_runtimes_training_graph_writes():
    """The ort builder's training graph (BatchNormInternal) writes the new running statistics into the trainer's
    state on every step: the same numbers OnnxModule writes into its buffers (population variance)."""
    _, batch, model = _conv_norm()
    statistics = running_statistics(model)
    desc = {"inputs": [("x", ["batch", 2, 5, 5]), ("y", ["batch", 3])], "outputs": [("loss", [], True)]}
    extra = {"_internal_use": {"gradient_builder": "ort"}, "utils": {"frozen_weights": statistics}}
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.0), extra=extra)
    trainer.train_step(*batch)
    written = trainer._training_session.get_state(statistics)
    trainable = [i.name for i in model.graph.initializer if i.name not in statistics]
    module = OnnxModule(model, ["x", "y"], ["loss"], trainable, statistics)
    module(*batch)
    buffers = {module.state_names[n]: b.numpy() for n, b in module.named_buffers()}
    for name in statistics:
        np.testing.assert_allclose(buffers[name], written[name], rtol=1e-6, atol=1e-6, err_msg=name)
