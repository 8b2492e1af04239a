"""The torch path without the TorchScript exporter: models whose TorchScript export fails or is wrong train with
the `torch` builder and match PyTorch (weights after 4 steps, and eval_step against the module's eval forward);
the TorchScript exporter is never called; model_desc's string dims give one graph for many batch sizes."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import (
    clone,
    in_threads,
    make_trainer,
    max_difference,
    needs_training_build,
    torch_weights,
    trainer_weights,
)
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from orttrainer import optim

CE = F.cross_entropy
TORCH = {"_internal_use": {"gradient_builder": "torch"}}
NO_CLIP = {"utils": {"grad_norm_clip": False}}
DESC = {
    "inputs": [("x", ["batch", 16]), ("target", ["batch"])],
    "outputs": [("loss", [], True), ("logits", ["batch", 4])],
}


def batches(sizes=(8, 8, 8, 8), seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in sizes]


def train_and_compare(model, data, extra=None, config=None, reference=None):
    """Train `model` with ORTTrainer and a copy in PyTorch on `data`; assert equal weights and eval outputs."""
    torch.manual_seed(0)
    config = config or optim.SGDConfig(lr=0.1)
    make_reference = reference or (lambda ps: torch.optim.SGD(ps, lr=0.1))
    ref = clone(model)
    trainer = make_trainer(model, DESC, config, CE, {**NO_CLIP, **(extra or {})})
    optimizer = make_reference(ref.parameters())
    for x, y in data:
        trainer.train_step(x, y)
        optimizer.zero_grad()
        CE(ref(x), y).backward()
        optimizer.step()
    assert max_difference(trainer_weights(trainer), trainable_weights(ref, trainer)) < 1e-5
    x, y = data[0]
    loss, logits = trainer.eval_step(x, y)
    ref.eval()
    with torch.no_grad():
        want = ref(x)
    np.testing.assert_allclose(logits.numpy(), want.numpy(), atol=1e-5)
    np.testing.assert_allclose(loss.item(), CE(want, y).item(), atol=1e-5)
    return trainer, ref


def trainable_weights(ref: nn.Module, trainer) -> dict[str, np.ndarray]:
    weights = torch_weights(ref)
    return {n: weights[n] for n in trainer._built.compiled.trainable}


# 1. a Function whose forward and backward call TorchScript code (Megatron's fused bias-GeLU) ---------------------


@torch.jit.script
def _bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


@torch.jit.script
def _bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


class FusedBiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return _bias_gelu(bias, input)

    @staticmethod
    def backward(ctx, grad):
        input, bias = ctx.saved_tensors
        tmp = _bias_gelu_back(grad, bias, input)
        return tmp, tmp  # autograd sums the bias gradient over the batch


class GeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.bias = nn.Parameter(torch.randn(32) * 0.1)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(FusedBiasGelu.apply(self.fc1(x), self.bias))


# 2. torch.utils.checkpoint, both implementations ------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, on_input: bool = False) -> None:
        super().__init__()
        self.reentrant, self.on_input = reentrant, on_input
        self.fc0, self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 32), nn.Linear(32, 4)

    def block(self, h):
        return F.gelu(self.fc1(h))

    def forward(self, x):
        h = x if self.on_input else self.fc0(x)
        return self.fc2(checkpoint(self.block, h, use_reentrant=self.reentrant))


# 3. a Function returning an input unchanged next to a product with a parameter -----------------------------------


class PassAndScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input0, x, y):
        ctx.save_for_backward(x, y)
        return input0, x * y

    @staticmethod
    def backward(ctx, g0, g1):
        x, y = ctx.saved_tensors
        return g0, g1 * y, (g1 * x).sum(0)


class PassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 4))  # used only through PassAndScale

    def forward(self, x):
        h = self.fc(x)
        passed, scaled = PassAndScale.apply(h, h, self.scale)
        return passed + scaled


# 4. a plain tensor attribute (not a registered buffer) -------------------------------------------------------------


class WithOffset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.offset = torch.tensor([0.5, -1.0, 2.0, 0.25])

    def forward(self, x):
        return self.fc(x) * 2 + self.offset


# 6. parameters at values an exporter could fold (zero biases, LayerNorm at 1 and 0), and a tied bias whose
# first name is not the one the forward reads (Hugging Face BERT's decoder bias) ------------------------------------


class TiedZeroBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))  # first name; the forward reads it as head.bias
        self.body, self.norm, self.head = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)
        nn.init.zeros_(self.body.bias)
        self.head.bias = self.bias

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.body(x))))


# 7. a forward that skips a step in eager mode after reading a tensor's value, unless torch is tracing it
# (transformers' attention masks: `padding_mask.all()` unless torch.compiler.is_compiling()) ---------------------


class EagerShortcut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        keep = x > -100.0  # all true for these batches
        if not torch.compiler.is_compiling() and bool(keep.all()):
            return self.fc(x)
        return self.fc(x.masked_fill(~keep, 0.0))


PATTERNS = {
    "torchscript_function": GeluMLP,
    "checkpoint_reentrant": lambda: Checkpointed(reentrant=True),
    "checkpoint_non_reentrant": lambda: Checkpointed(reentrant=False),
    "pass_through_function": PassModel,
    "tensor_attribute": WithOffset,
    "tied_zero_bias": TiedZeroBias,
    "eager_shortcut": EagerShortcut,
}


@pytest.fixture
def no_torchscript_export(monkeypatch):
    """Any use of the TorchScript exporter fails the test: torch.onnx.export must be called with dynamo=True."""
    from torch.onnx._internal.torchscript_exporter import utils as torchscript_utils

    export = torch.onnx.export

    def dynamo_only(*args, **kwargs):
        if kwargs.get("dynamo") is not True:
            raise AssertionError("the torch path called the TorchScript exporter")
        return export(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the torch path called the TorchScript exporter")

    monkeypatch.setattr(torch.onnx, "export", dynamo_only)
    monkeypatch.setattr(torchscript_utils, "export", refuse)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_pattern_trains_like_pytorch_without_the_torchscript_exporter(pattern, no_torchscript_export, tmp_path):
    torch.manual_seed(0)
    extra = {**TORCH, "debug": {"check_model_export": True}}  # the eval graph reproduces PyTorch's outputs
    trainer, ref = train_and_compare(PATTERNS[pattern](), batches(), extra)
    assert trainer.gradient_builder == "torch"
    assert set(trainer._built.compiled.trainable) == {n for n, _ in ref.named_parameters()}
    path = str(tmp_path / "model.onnx")
    trainer.save_as_onnx(path)
    saved = onnx.load(path)
    assert {i.name for i in saved.graph.initializer} >= set(trainer._built.compiled.trainable)
    x, y = batches()[1]
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    loss, logits = session.run(["loss", "logits"], {"x": x.numpy(), "target": y.numpy()})
    with torch.no_grad():
        want = ref(x)  # ref is in eval mode: the saved model is the eval-mode forward with the trained weights
    np.testing.assert_allclose(logits, want.numpy(), atol=1e-5)
    np.testing.assert_allclose(loss, CE(want, y).item(), atol=1e-5)


def test_a_parameter_used_only_through_a_custom_function_trains_with_adam():
    model = PassModel()
    before = model.scale.detach().clone()
    trainer, _ = train_and_compare(
        model, batches(), config=optim.AdamConfig(lr=1e-2), reference=lambda ps: torch.optim.Adam(ps, lr=1e-2)
    )  # 'auto': the custom Function picks the torch builder
    assert trainer.gradient_builder == "torch" and "scale" in trainer._built.compiled.trainable
    assert np.abs(trainer_weights(trainer)["scale"] - before.numpy()).max() > 1e-3


def test_auto_picks_torch_for_a_torchscript_calling_function_before_any_torchscript_export(no_torchscript_export):
    trainer, _ = train_and_compare(GeluMLP(), batches())
    assert trainer.gradient_builder == "torch"
    assert "FusedBiasGelu" in trainer._built.builder.reason


def test_reentrant_checkpoint_on_an_input_gives_its_parameters_no_gradient_as_in_pytorch():
    """use_reentrant=True on a tensor that requires no grad: PyTorch leaves the inner parameters' grad None (fc0
    is not used at all). Both are named in the warning and stay as they were, as in PyTorch."""
    match = r"\['fc0.weight', 'fc0.bias', 'fc1.weight', 'fc1.bias'\] do not influence the loss"
    with pytest.warns(UserWarning, match=match):
        trainer, ref = train_and_compare(Checkpointed(reentrant=True, on_input=True), batches(), TORCH)
    assert "fc1.weight" in trainer._built.compiled.frozen
    assert ref.fc1.weight.grad is None


class GlobalScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x) * _GLOBAL_SCALE


_GLOBAL_SCALE = torch.tensor([1.0, 2.0, 0.5, -1.0])


def test_tensors_that_are_not_state_are_constants_and_stay_out_of_the_state_dict():
    for model in (WithOffset(), GlobalScale()):
        trainer, _ = train_and_compare(model, batches(), TORCH)
        assert set(trainer.state_dict(pytorch_format=True)) == set(model.state_dict())


class LogAddExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.logaddexp(h, -h))  # no TorchScript symbolic for aten::logaddexp


@needs_training_build
def test_auto_trains_with_torch_when_the_torchscript_export_fails(caplog):
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, _ = train_and_compare(LogAddExp(), batches())
    assert trainer.gradient_builder == "torch"
    assert "auto: the TorchScript exporter failed (exporting LogAddExp to ONNX failed" in trainer._built.builder.reason
    assert "building with the torch gradient builder" in caplog.text


class TransposedConvolution(nn.Module):
    """x (batch, 16) as a 4x4 image, up-sampled by a transposed convolution: ONNX Runtime builds its gradient graph
    but its CPU build has no `ConvTransposeGrad` kernel, so the 'ort' builder's session cannot be opened."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(1, 2, 3, stride=2)
        self.fc = nn.Linear(2 * 9 * 9, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.up(x.view(-1, 1, 4, 4))).flatten(1))


@needs_training_build
def test_auto_trains_with_torch_when_onnx_runtime_cannot_open_the_ort_builder_s_graph(caplog):
    with pytest.raises(Exception, match="ConvTransposeGrad"):  # the 'ort' builder alone
        make_trainer(
            TransposedConvolution(), DESC, optim.SGDConfig(lr=0.1), CE, {"_internal_use": {"gradient_builder": "ort"}}
        ).train_step(*batches()[0])
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, _ = train_and_compare(TransposedConvolution(), batches())
    assert trainer.gradient_builder == "torch"
    assert "auto: the 'ort' builder's graph failed to compile or open" in trainer._built.builder.reason
    assert "ConvTransposeGrad" in trainer._built.builder.reason
    assert caplog.text.count("building with the torch gradient builder") == 1  # one INFO line


class BagOfWords(nn.Module):
    """EmbeddingBag (mean): the TorchScript export writes a Loop that ONNX Runtime's gradient builder rejects."""

    def __init__(self) -> None:
        super().__init__()
        self.bag, self.fc = nn.EmbeddingBag(10, 4, mode="mean"), nn.Linear(4, 3)

    def forward(self, tokens, offsets):
        return self.fc(self.bag(tokens, offsets))


@needs_training_build
def test_auto_trains_with_torch_when_onnx_runtime_s_gradient_build_fails():
    desc = {"inputs": [("tokens", [8]), ("offsets", [2]), ("y", [2])], "outputs": [("loss", [], True)]}
    torch.manual_seed(0)
    model = BagOfWords()
    reference = clone(model)
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.1), CE, NO_CLIP)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens, offsets, y = torch.randint(0, 10, (8,), generator=g), torch.tensor([0, 3]), torch.tensor([0, 2])
        trainer.train_step(tokens, offsets, y)
        sgd.zero_grad()
        CE(reference(tokens, offsets), y).backward()
        sgd.step()
    assert trainer.gradient_builder == "torch"
    assert trainer._built.builder.reason.startswith("auto: ")  # the tests' pass checker may see the failure first
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5


@needs_training_build
def test_auto_names_both_reasons_when_neither_builder_trains_the_model(monkeypatch):
    from orttrainer.trainer import model as model_mod

    def torch_route_fails(*args, **kwargs):
        raise RuntimeError("no ONNX translation for aten::logaddexp")  # as if the torch route failed as well

    monkeypatch.setattr(model_mod, "torch_route_forward", torch_route_fails)
    trainer = make_trainer(LogAddExp(), DESC, optim.SGDConfig(lr=0.1), CE)
    message = r"neither gradient builder can train LogAddExp: the 'ort' builder: the TorchScript exporter failed .*"
    with pytest.raises(RuntimeError, match=message + "the torch builder: RuntimeError: no ONNX translation"):
        trainer.train_step(*batches()[0])


@needs_training_build
def test_auto_raises_the_user_s_error_as_it_is_when_both_routes_meet_it():
    """An error both routes raise alike (a legacy option check) is the user's, not a builder's: no NoBuilderTrainsError
    around it, the legacy type and message kept."""
    from orttrainer.trainer.build.forward import NoBuilderTrainsError

    class Linear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(x)

    options = {"utils": {"frozen_weights": ["no_such.weight"]}}
    trainer = make_trainer(Linear(), DESC, optim.SGDConfig(lr=0.1), CE, options)
    with pytest.raises(RuntimeError, match=r"^\['no_such.weight'\] params from 'frozen_weights' not found") as caught:
        trainer.train_step(*batches()[0])
    assert not isinstance(caught.value, NoBuilderTrainsError)


def test_auto_does_not_switch_for_the_user_s_errors_or_a_named_opset():
    from orttrainer.trainer.build.export import OpsetTooLowError
    from orttrainer.trainer.build.forward import auto_fallback
    from orttrainer.trainer.gradient.choice import BuilderChoice

    auto, ort_builder = BuilderChoice("auto", "default"), BuilderChoice("ort", "asked for")
    assert auto_fallback(auto, ValueError("input 'x' has shape [3]")) is None
    assert auto_fallback(auto, TypeError("not a tensor")) is None
    assert auto_fallback(auto, MemoryError()) is None
    assert auto_fallback(ort_builder, RuntimeError("session")) is None
    assert auto_fallback(auto, OpsetTooLowError("M", "aten::unflatten", 12, 13, 13)) is None
    assert auto_fallback(auto, RuntimeError("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : x\nmore")) == (
        "auto: the 'ort' builder's graph failed to compile or open (RuntimeError: [ONNXRuntimeError] : 9 : "
        "NOT_IMPLEMENTED : x)"
    )


# dynamic shapes ----------------------------------------------------------------------------------------------------


class GroupMean(nn.Module):
    """A view sized by the batch and a mean over a batch-sized axis: both are symbolic in a dynamic trace."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(x)
        return h.view(h.shape[0], 2, 4).mean(dim=1) - h.mean(dim=0, keepdim=True)[:, :4]


def test_new_batch_sizes_reuse_the_dynamic_graph(caplog):
    """The first STATIC_SIGNATURES batch sizes get graphs with their shapes; the next one traces the dynamic-dims
    graph, which serves every later size."""
    data = batches(sizes=(8, 5, 3, 8, 6, 4, 6))
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, _ = train_and_compare(GroupMean(), data, TORCH)
    assert trainer._training_session.training_graph_count == 4  # 8, 5, 3, then the dynamic one
    assert "the new input shapes [[5, 16], [5]] (torch gradient builder)" in caplog.text
    assert "the new input shapes [[3, 16], [3]] (torch gradient builder)" in caplog.text
    assert "the training graph is traced with dynamic dims [[0], [0]]" in caplog.text
    assert "input shapes [[4, 16], [4]]: an earlier training graph serves them" in caplog.text
    first = [i for i in trainer._built.compiled.training.model.graph.input if i.name == "x"]
    assert first[0].type.tensor_type.shape.dim[0].dim_value == 8  # the first batch's shapes
    dynamic = trainer._built.compiled.graph_for([x for x in batches(sizes=(6,))[0]]).model
    inputs = [i for i in dynamic.graph.input if i.name == "x"]
    assert inputs[0].type.tensor_type.shape.dim[0].dim_param  # a symbolic batch dim in the ONNX graph


def test_the_first_graph_is_dynamic_without_the_static_shapes_rewrite(caplog, monkeypatch):
    monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "static_shapes")
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, _ = train_and_compare(GroupMean(), batches(sizes=(8, 5, 3)), TORCH)
    assert trainer._training_session.training_graph_count == 1
    assert "input shapes [[5, 16], [5]]: an earlier training graph serves them" in caplog.text


def test_shapes_outside_the_dynamic_graphs_guards_get_their_own_graph_on_the_same_state(caplog):
    """Batch 1 is outside every dynamic trace (PyTorch's tracer specialises sizes 0 and 1): it gets its own graph,
    sharing the weights with the first one."""
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, _ = train_and_compare(GroupMean(), batches(sizes=(8, 5, 3, 6, 1, 8, 1, 4)), TORCH)
    assert trainer._training_session.training_graph_count == 5  # 8, 5, 3, 6 (dynamic), 1 (its own)
    assert "tracing and compiling a training graph for the new input shapes [[1, 16], [1]]" in caplog.text
    assert "input shapes [[4, 16], [4]]: an earlier training graph serves them" in caplog.text


class Specialising(GroupMean):
    def forward(self, x):
        if x.shape[0] != 8:  # Python code on a size: the trace specialises the batch to 8
            x = x * 1.0
        return super().forward(x)


def test_a_model_whose_trace_specialises_the_batch_gets_one_graph_per_batch_size(caplog, monkeypatch):
    monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "traced_eval_graphs")  # the exported eval graphs specialise too
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, ref = train_and_compare(Specialising(), batches(sizes=(8, 5, 8, 5, 3, 6, 4)), TORCH)
        x, y = batches(sizes=(5,))[0]  # the eval graph is static in the batch too: another one is exported
        _, logits = trainer.eval_step(x, y)
    # 8: the first graph; 5 and 3 their own; 6: the dynamic trace, whose guard (size != 8) also admits 4
    assert trainer._training_session.training_graph_count == 4
    assert "input shapes [[4, 16], [4]]: an earlier training graph serves them" in caplog.text
    with torch.no_grad():
        np.testing.assert_allclose(logits.numpy(), ref(x).numpy(), atol=1e-5)
    assert "exporting an eval graph for the input shapes [[5, 16], [5]]" in caplog.text
    trainer, _ = train_and_compare(GeluMLP(), batches(sizes=(8, 5, 8, 5)))  # TorchScript code: either way, exact


class DropoutNorm(nn.Module):
    """Eval mode turns the dropout off and runs the BatchNorm on its running statistics; a plain tensor attribute;
    a cast (`Tensor.float`, which the eval trace records with a check of the tensor's metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.5)
        self.offset = torch.tensor([0.5, -1.0, 2.0, 0.25])

    def forward(self, x):
        return (self.fc2(self.drop(torch.relu(self.norm(self.fc1(x))))) + self.offset).float()


def _counted_exports(monkeypatch) -> list[int]:
    """The batch size of each torch.export of the eval-mode forward, from now on."""
    from orttrainer.trainer.build import torch_route

    sizes: list[int] = []
    export = torch_route.export_forward

    def counted(source, inputs, *args, **kwargs):
        sizes.append(inputs[0].shape[0])
        return export(source, inputs, *args, **kwargs)

    monkeypatch.setattr(torch_route, "export_forward", counted)
    return sizes


def _eval_like_pytorch(trainer, loss_fn, sizes: tuple[int, ...]) -> None:
    """eval_step on batches of `sizes` against the module's eval forward on the trainer's state."""
    from orttrainer.trainer.build.torch_route import eval_mode

    ref = DropoutNorm()
    ref.load_state_dict(trainer.state_dict(pytorch_format=True))
    for x, y in batches(sizes=sizes, seed=2):
        loss, logits = trainer.eval_step(x, y)
        with eval_mode(ref), torch.no_grad():
            want = ref(x)
        np.testing.assert_allclose(logits.numpy(), want.numpy(), atol=1e-5)
        np.testing.assert_allclose(loss.item(), loss_fn(want, y).item(), atol=1e-5)


def test_eval_graphs_are_traced_for_the_first_shapes_then_one_is_exported(monkeypatch, caplog):
    """The first STATIC_SIGNATURES batch shapes each get a traced eval graph, without torch.export; the next one
    gets the exported graph, whose dynamic batch then serves the others. All compute PyTorch's eval forward: no
    dropout, BatchNorm on the running statistics training left, the loss's class weights. save_as_onnx writes
    the exported forward model."""
    from orttrainer.trainer.gradient.torch_graphs import STATIC_SIGNATURES

    assert STATIC_SIGNATURES == 3  # the sizes below
    torch.manual_seed(0)
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 1.5]))
    trainer = make_trainer(DropoutNorm(), DESC, optim.SGDConfig(lr=0.1), loss_fn, TORCH)
    for x, y in batches(sizes=(8, 8)):
        trainer.train_step(x, y)
    exports = _counted_exports(monkeypatch)
    _eval_like_pytorch(trainer, loss_fn, (8, 5, 3, 8))
    assert exports == []
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        _eval_like_pytorch(trainer, loss_fn, (6, 7, 2))
    assert exports == [6]  # one dynamic export serves 6, 7 and 2


def test_a_failed_eval_trace_exports_that_graph_and_every_later_one(monkeypatch, caplog):
    from orttrainer.trainer.build import torch_route
    from orttrainer.trainer.gradient.aten_onnx import UntranslatableGraph

    traces = []

    def untranslatable(*args, **kwargs):
        traces.append(args[3][0].shape[0])
        raise UntranslatableGraph("no direct translation of aten.some_op")

    torch.manual_seed(0)
    loss_fn = nn.CrossEntropyLoss()
    trainer = make_trainer(DropoutNorm(), DESC, optim.SGDConfig(lr=0.1), loss_fn, TORCH)
    trainer.train_step(*batches(sizes=(8,))[0])
    monkeypatch.setattr(torch_route, "build_torch_forward_graph", untranslatable)
    exports = _counted_exports(monkeypatch)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        _eval_like_pytorch(trainer, loss_fn, (8, 5))
    assert "the eval graph for the input shapes [[8, 16], [8]] is exported, as every later one" in caplog.text
    assert "UntranslatableGraph: no direct translation of aten.some_op" in caplog.text
    assert traces == [8] and exports == [8]  # the dynamic export serves batch 5 too


def test_eval_graphs_are_exported_with_the_traced_eval_graphs_rewrite_off(monkeypatch):
    monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "traced_eval_graphs")
    torch.manual_seed(0)
    loss_fn = nn.CrossEntropyLoss()
    trainer = make_trainer(DropoutNorm(), DESC, optim.SGDConfig(lr=0.1), loss_fn, TORCH)
    trainer.train_step(*batches(sizes=(8,))[0])
    exports = _counted_exports(monkeypatch)
    _eval_like_pytorch(trainer, loss_fn, (8, 5))
    assert exports == [8]


def test_two_threads_making_eval_graphs_at_once_get_what_one_thread_gets():
    """Tracing, exporting and the compile cache's digests hold the process-wide lock (build/export.TRACING): two
    trainers' first eval steps in two threads, traced (batch sizes 8, 5, 3) and exported (6), give what each gives
    alone, and torch's functions the tracers patch are restored."""
    from torch.nn.modules import transformer

    detect = transformer._detect_is_causal_mask  # torch_private.causal_mask_detection_off patches it
    loss_fn = nn.CrossEntropyLoss()
    sizes = (8, 5, 3, 6)

    def trainer():
        torch.manual_seed(0)
        made = make_trainer(DropoutNorm(), DESC, optim.SGDConfig(lr=0.1), loss_fn, TORCH)
        made.train_step(*batches(sizes=(8,))[0])
        return made

    def logits(made) -> list[np.ndarray]:
        return [made.eval_step(x, y)[1].numpy() for x, y in batches(sizes=sizes, seed=2)]

    alone = logits(trainer())
    results = in_threads(logits, [trainer(), trainer()])
    assert transformer._detect_is_causal_mask is detect
    for k in range(2):
        for got, want in zip(results[k], alone, strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_model_saved_from_the_torch_route_trains_again_as_an_onnx_model_on_it(tmp_path):
    """save_as_onnx's file names its constants `val_<k>`, as torch.onnx names its values: as state of the ONNX
    model, they are the inputs of the new training graph, whose exporter gives the same names to values of its own
    (two values of one name, once)."""
    torch.manual_seed(0)
    trainer = make_trainer(GeluMLP(), DESC, optim.SGDConfig(lr=0.1), CE, TORCH)
    data = batches()
    trainer.train_step(*data[0])
    path = str(tmp_path / "model.onnx")
    trainer.save_as_onnx(path)
    saved = onnx.load(path)
    again = make_trainer(saved, DESC, optim.SGDConfig(lr=0.1), None, TORCH)
    for ours, theirs in zip(trainer.eval_step(*data[1]), again.eval_step(*data[1]), strict=True):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-6)
    again.train_step(*data[1])
    trainer.train_step(*data[1])
    ours = trainer_weights(trainer)  # the ONNX model also trains its float constants (initializers), as legacy
    assert max_difference({n: v for n, v in trainer_weights(again).items() if n in ours}, ours) < 1e-6


def test_the_dry_run_runs_a_forward_that_takes_a_gradient_of_its_own():
    """The dry run drops the activations autograd saves (it only reads the outputs and their graph); a forward that
    runs a backward itself (a gradient penalty) runs again keeping them."""
    from orttrainer.schema.model_desc import _ORTTrainerModelDesc
    from orttrainer.trainer.build import export

    class Penalised(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, x):
            y = self.linear(x)
            (slope,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            return y.sum() + slope.pow(2).sum()

    torch.manual_seed(0)
    model, x = Penalised(), torch.randn(4, 3, requires_grad=True)
    desc = _ORTTrainerModelDesc({"inputs": [("x", [4, 3])], "outputs": [("loss", [], True)]})
    for record_reads in (True, False):
        run = export.dry_run(model, None, desc, [x], record_reads=record_reads)
        assert torch.equal(run.sample_outputs[0], model(x).detach())
        assert run.custom_functions == []


def _trained_gradient_graph(model: nn.Module, switched_off: str | None, monkeypatch, tmp_path) -> list:
    """The nodes of the gradient graph `model` trained with (`train_and_compare`: like PyTorch), with the rewrite
    `switched_off` (if any) disabled."""
    if switched_off:
        monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", switched_off)
    path = str(tmp_path / "gradient.onnx")
    saved = {"debug": {"graph_save_paths": {"model_with_gradient_graph_path": path}}}
    train_and_compare(model, batches(), {**TORCH, **saved})
    return list(onnx.load(path).graph.node)


class ReluNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.threshold = nn.Linear(16, 32), nn.Linear(32, 4), nn.Threshold(0.1, 0.0)

    def forward(self, x):
        return self.fc2(self.threshold(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("product", [True, False], ids=["product", "where"])
def test_relu_backward_is_a_product_with_its_mask_unless_switched_off(product, monkeypatch, tmp_path):
    """ReLU's and Threshold's backward: the gradient times its mask (ONNX Runtime's CPU Where is about ten times
    slower, docs/engine.md §3.3), or with `threshold_backward_as_product` switched off the select PyTorch's
    decomposition writes; the weights follow PyTorch's either way."""
    nodes = _trained_gradient_graph(
        ReluNet(), None if product else "threshold_backward_as_product", monkeypatch, tmp_path
    )
    masks = {out for node in nodes if node.op_type == "LessOrEqual" for out in node.output}
    readers = [node.op_type for node in nodes if masks & set(node.input)]
    # one mask per activation's backward; nn.Threshold's forward is a select of its own
    assert sorted(readers) == (["Not", "Not", "Where"] if product else ["Where", "Where", "Where"])


class SafeSoftmaxNet(nn.Module):
    """Scores over 4 keys per query, some masked: query 0 of each sample sees no key (a row of -inf only, which
    `_safe_softmax`, the attention's softmax, turns into zeros), query 1 sees two."""

    def __init__(self):
        super().__init__()
        self.scores, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        masked = torch.zeros(4, 4, dtype=torch.bool)
        masked[0], masked[1, :2] = True, True
        self.register_buffer("masked", masked, persistent=False)

    def forward(self, x):
        scores = self.scores(x).view(-1, 4, 4).masked_fill(self.masked, float("-inf"))
        return self.head(torch.ops.aten._safe_softmax(scores, -1).reshape(-1, 16) * x)


@pytest.mark.parametrize("product", [True, False], ids=["product", "where"])
def test_the_attention_softmax_zeroes_dead_rows_by_a_product_unless_switched_off(product, monkeypatch, tmp_path):
    """`_safe_softmax`: its softmax times the rows' mask (docs/engine.md §28), or with `safe_softmax_as_product`
    switched off the select over the scores PyTorch's decomposition writes; the weights follow PyTorch's either
    way, with a row of -inf only in every sample."""
    nodes = _trained_gradient_graph(
        SafeSoftmaxNet(), None if product else "safe_softmax_as_product", monkeypatch, tmp_path
    )
    softmax = {out for node in nodes if node.op_type == "Softmax" for out in node.output}
    readers = sorted(node.op_type for node in nodes if softmax & set(node.input))
    assert readers == (["Mul"] if product else ["Where"])  # what zeroes the dead rows
    assert ("Max" in {node.op_type for node in nodes}) == product
