"""The torch gradient builder against eager PyTorch autograd: same weights and batch, loss and every `<p>_grad`
from ONNX Runtime (CPU) within 1e-5."""

from __future__ import annotations

import copy
import time

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from models import ScalarAndTupleFunction, StraightThrough
from torch import nn

from orttrainer.trainer.build.export import _ModelWithLoss
from orttrainer.trainer.gradient.errors import GradientBuildError
from orttrainer.trainer.gradient.torch_builder import (
    TorchGradientGraph,
    UntraceableFunctionError,
    build_torch_gradient_graph,
)
from orttrainer.trainer.runtime.session import ShapeKeyedCache, shape_signature

ATOL = 1e-5


def build(module, loss_fn, inputs, names=("x", "y"), outputs=("loss",), frozen=(), **kw) -> TorchGradientGraph:
    trainable = [n for n, p in module.named_parameters() if p.requires_grad and n not in frozen]
    return build_torch_gradient_graph(
        module, loss_fn, list(names), list(inputs), list(outputs), trainable, list(frozen), **kw
    )


def run(graph: TorchGradientGraph, module: nn.Module, inputs) -> dict[str, np.ndarray]:
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    feeds = {n: t.detach().numpy().copy() for n, t in zip(graph.input_names, inputs, strict=True)}
    feeds.update({n: state[n].detach().numpy().copy() for n in graph.state_names})
    session = ort.InferenceSession(graph.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in graph.model.graph.output]
    return dict(zip(names, session.run(None, feeds), strict=True))


def eager(module, loss_fn, inputs, names=("x", "y")) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs and .grad of each trainable parameter from plain PyTorch, on a copy of the module."""
    module = copy.deepcopy(module)
    outputs = _ModelWithLoss(module, loss_fn, list(names))(*inputs)
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    outputs[0].backward()
    return [o.detach() for o in outputs], {n: p.grad for n, p in module.named_parameters() if p.requires_grad}


def assert_matches(module, loss_fn, inputs, graph=None, names=("x", "y"), outputs=("loss",)) -> TorchGradientGraph:
    graph = graph or build(module, loss_fn, inputs, names, outputs)
    got = run(graph, module, inputs)
    want_outputs, want_grads = eager(module, loss_fn, inputs, names)
    for name, want in zip(graph.output_names, want_outputs, strict=False):
        np.testing.assert_allclose(got[name], want.numpy(), atol=ATOL, rtol=0, err_msg=name)
    assert graph.gradient_names == [f"{n}_grad" for n in want_grads]
    for name, want in want_grads.items():
        assert want is not None, name
        np.testing.assert_allclose(got[f"{name}_grad"], want.numpy(), atol=ATOL, rtol=0, err_msg=name)
    return graph


# (a) MLP with GELU and cross-entropy --------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=16, classes=4) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def test_mlp_gelu_cross_entropy_matches_pytorch():
    torch.manual_seed(0)
    model, x, y = MLP(), torch.randn(5, 8), torch.randint(0, 4, (5,))
    graph = assert_matches(model, F.cross_entropy, (x, y), outputs=("loss", "logits"))
    assert [i.name for i in graph.model.graph.input] == ["x", "y", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert [o.name for o in graph.model.graph.output] == [
        "loss",
        "logits",
        "fc1.weight_grad",
        "fc1.bias_grad",
        "fc2.weight_grad",
        "fc2.bias_grad",
    ]
    assert graph.model.ir_version <= 10
    assert graph.opset_version == 18  # the default request (18) is the exporter's minimum


def test_opset_rules():
    torch.manual_seed(0)
    model, inputs = MLP(), (torch.randn(2, 8), torch.randint(0, 4, (2,)))
    assert build(model, F.cross_entropy, inputs, opset_version=14).opset_version == 18
    graph = build(model, F.cross_entropy, inputs, opset_version=21)
    assert {o.domain: o.version for o in graph.model.opset_import}[""] == 21
    run(graph, model, inputs)
    with pytest.raises(ValueError, match="up to 21"):
        build(model, F.cross_entropy, inputs, opset_version=22)


# (b) transformer ------------------------------------------------------------------------------------------------------


class TinyTransformer(nn.Module):
    def __init__(self, dropout: float, vocab=50, d=32) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.norm(self.encoder(self.embed(x))))


def token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def tokens(batch=4, seq=16, vocab=50):
    return torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))


def test_transformer_matches_pytorch():
    torch.manual_seed(0)
    model, inputs = TinyTransformer(dropout=0.0), tokens()
    start = time.perf_counter()
    graph = build(model, token_loss, inputs, outputs=("loss", "logits"))
    print(f"transformer build: {time.perf_counter() - start:.1f} s")
    assert_matches(model, token_loss, inputs, graph, outputs=("loss", "logits"))


def test_transformer_with_dropout_runs():
    torch.manual_seed(0)
    model, inputs = TinyTransformer(dropout=0.1), tokens()
    graph = build(model, token_loss, inputs)
    got = run(graph, model, inputs)
    assert np.isfinite(got["loss"]) and abs(float(got["loss"]) - np.log(50)) < 1.0
    for name in graph.gradient_names:
        assert np.isfinite(got[name]).all(), name
    assert np.abs(got["embed.weight_grad"]).sum() > 0


class DropoutProbe(nn.Module):
    """loss = sum(c * dropout(x * w)): d loss / d w[i] = c[i] x[i] m[i] / (1 - p) exposes the backward's mask."""

    def __init__(self, n: int, p: float) -> None:
        super().__init__()
        self.w, self.drop = nn.Parameter(torch.rand(n) + 0.5), nn.Dropout(p)

    def forward(self, x):
        return self.drop(x * self.w)


def test_dropout_backward_uses_the_forward_mask():
    torch.manual_seed(0)
    n, p = 256, 0.5
    model, x, c = DropoutProbe(n, p), torch.rand(n) + 0.5, torch.rand(n) + 0.5
    graph = build(model, lambda y, c: (y * c).sum(), (x, c), ("x", "c"), ("loss", "y"))
    for _ in range(3):  # a fresh mask every run, always the same one in forward and backward
        got = run(graph, model, (x, c))
        mask = got["w_grad"] * (1 - p) / (c * x).numpy()
        np.testing.assert_allclose(mask, np.round(mask), atol=1e-5)
        assert 0.3 < mask.mean() < 0.7
        np.testing.assert_allclose(got["y"], (x * model.w).detach().numpy() * mask / (1 - p), atol=1e-5)
        np.testing.assert_allclose(got["loss"], (got["y"] * c.numpy()).sum(), rtol=1e-5)


# (c), (d), (e) custom autograd Functions -----------------------------------------------------------------------------


class WithFunction(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn, self.fc1, self.fc2 = fn, nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.fn(self.fc1(x)))


def mse(pred, target):
    return F.mse_loss(pred, target)


def test_scalar_and_tuple_function():
    torch.manual_seed(0)
    model = WithFunction(lambda h: ScalarAndTupleFunction.apply(h, 2, (1.5, True), 0.5))
    assert_matches(model, mse, (torch.randn(5, 6), torch.randn(5, 3)))


def test_straight_through_estimator_uses_the_users_backward():
    torch.manual_seed(0)
    model, inputs = WithFunction(StraightThrough.apply), (torch.randn(5, 6) * 3, torch.randn(5, 3))
    assert_matches(model, mse, inputs)
    got = run(build(model, mse, inputs), model, inputs)
    assert np.abs(got["fc1.weight_grad"]).max() > 1e-3  # round() alone has gradient 0


class SortWithGrads(torch.autograd.Function):
    """(x * w) sorted: the indices are non-differentiable; grads only where ctx.needs_input_grad says so."""

    seen: list[tuple[bool, ...]] = []

    @staticmethod
    def forward(ctx, x, w, descending):
        values, indices = (x * w).sort(dim=-1, descending=descending)
        ctx.save_for_backward(x, w, indices)
        ctx.mark_non_differentiable(indices)
        return values, indices

    @staticmethod
    def backward(ctx, grad_values, grad_indices):
        SortWithGrads.seen.append(tuple(ctx.needs_input_grad))
        x, w, indices = ctx.saved_tensors
        grad = torch.zeros_like(grad_values).scatter(-1, indices, grad_values)
        return (
            grad * w if ctx.needs_input_grad[0] else None,
            (grad * x).sum(0) if ctx.needs_input_grad[1] else None,
            None,
        )


class SortModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.scale = nn.Linear(4, 4), nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        values, indices = SortWithGrads.apply(self.fc(x), self.scale, True)
        return values * torch.linspace(1, 2, 4) + indices.float() * 0.1


@pytest.mark.parametrize("freeze_scale", [False, True])
def test_needs_input_grad_and_mark_non_differentiable(freeze_scale):
    torch.manual_seed(0)
    model, inputs = SortModel(), (torch.randn(3, 4), torch.randn(3, 4))
    model.scale.requires_grad_(not freeze_scale)
    SortWithGrads.seen.clear()
    eager(model, mse, inputs)
    want = list(SortWithGrads.seen)
    SortWithGrads.seen.clear()
    graph = assert_matches(model, mse, inputs)
    assert SortWithGrads.seen[0] == want[0] == (True, not freeze_scale, False)
    assert ("scale_grad" in graph.gradient_names) is not freeze_scale


class NoneForBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, b):
        return x + b

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # b gets no gradient through this Function


class NoneGradModel(nn.Module):
    def __init__(self, direct: bool) -> None:
        super().__init__()
        self.fc, self.b, self.direct = nn.Linear(4, 4), nn.Parameter(torch.randn(4)), direct

    def forward(self, x):
        out = NoneForBias.apply(self.fc(x), self.b)
        return out * self.b if self.direct else out


def test_none_gradient_keeps_the_other_paths():
    torch.manual_seed(0)
    assert_matches(NoneGradModel(direct=True), mse, (torch.randn(3, 4), torch.randn(3, 4)))


def test_parameter_without_gradient_is_a_clear_error():
    with pytest.raises(GradientBuildError, match=r"no gradient for \['b'\].*frozen_weights") as info:
        build(NoneGradModel(direct=False), mse, (torch.randn(3, 4), torch.randn(3, 4)))
    assert info.value.unreachable == ["b"]  # the compiler freezes these and retries, as with the ort builder


# (f) untraceable backward ---------------------------------------------------------------------------------------------


class ItemBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * grad.abs().max().item()


class BranchBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if grad.sum() > 0:
            return grad * 2
        return grad


class NumpyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return torch.from_numpy(grad.numpy() * 2)


class ItemForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * float(x.max())

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_value_read_with_item_that_feeds_tensor_arithmetic_is_part_of_the_graph():
    """The trace records `.item()` as a graph computation (a data-dependent scalar), so the backward is exact."""
    torch.manual_seed(0)
    assert_matches(WithFunction(ItemBackward.apply), mse, (torch.randn(5, 6), torch.randn(5, 3)))


@pytest.mark.parametrize(
    "fn, phase", [(BranchBackward, "backward"), (NumpyBackward, "backward"), (ItemForward, "forward")]
)
def test_untraceable_function_is_named(fn, phase):
    model = WithFunction(fn.apply)
    with pytest.raises(UntraceableFunctionError) as info:
        build(model, mse, (torch.randn(5, 6), torch.randn(5, 3)))
    assert info.value.function == fn.__qualname__ and info.value.phase == phase
    assert info.value.location.startswith(__file__ + ":")
    assert f"The {phase} of the custom torch.autograd.Function '{fn.__qualname__}'" in str(info.value)
    assert "tensor operations only" in str(info.value)
    assert all(p.requires_grad for p in model.parameters())  # flags restored after the failed trace


# (g) shapes -----------------------------------------------------------------------------------------------------------


class MeanModel(nn.Module):
    """A mean (divisor baked into the trace) and a view whose size comes from the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = self.fc(x)
        return h.view(h.shape[0], 2, 2).mean(dim=1)


def test_each_batch_size_gets_its_own_correct_graph():
    torch.manual_seed(0)
    model, cache = MeanModel(), ShapeKeyedCache[TorchGradientGraph](max_entries=4)
    builds = []

    def graph_for(inputs):
        return cache.get_or_build(inputs, lambda: builds.append(1) or build(model, mse, inputs))

    small, large = (torch.randn(4, 6), torch.randn(4, 2)), (torch.randn(7, 6), torch.randn(7, 2))
    g_small, g_large = graph_for(small), graph_for(large)
    assert graph_for((torch.randn(4, 6), torch.randn(4, 2))) is g_small and len(builds) == 2
    assert g_small.signature == shape_signature(small) != g_large.signature
    assert_matches(model, mse, small, g_small)
    assert_matches(model, mse, large, g_large)
    with pytest.raises(ValueError, match="traced for inputs"):
        g_small.check_inputs(large)
    with pytest.raises(Exception, match="[Ii]nvalid dimensions|[Ss]hape"):
        run(g_small, model, large)  # ONNX Runtime refuses: never a silently wrong loss


def test_shape_keyed_cache_evicts_least_recently_used():
    cache: ShapeKeyedCache[int] = ShapeKeyedCache(max_entries=2)
    a, b, c = [torch.zeros(1)], [torch.zeros(2)], [torch.zeros(3)]
    assert cache.get_or_build(a, lambda: 1) == 1 and cache.get_or_build(b, lambda: 2) == 2
    assert cache.get_or_build(a, lambda: 99) == 1  # a is now the most recent
    cache.get_or_build(c, lambda: 3)
    assert a in cache and c in cache and b not in cache and len(cache) == 2
    assert shape_signature([torch.zeros(2, dtype=torch.int64)]) != shape_signature([torch.zeros(2)])


def test_shape_keyed_cache_keys_by_the_key_it_is_given():
    """The torch builder's graphs for a forward that branches on values: inputs of one shape, two keys."""
    cache: ShapeKeyedCache[str] = ShapeKeyedCache(
        4, key=lambda inputs: (shape_signature(inputs), bool(inputs[0].any()))
    )
    zeros, ones = [torch.zeros(3)], [torch.ones(3)]
    assert cache.get_or_build(zeros, lambda: "none") == "none" and cache.get_or_build(ones, lambda: "some") == "some"
    assert cache.get_or_build([torch.zeros(3)], lambda: "again") == "none" and len(cache) == 2
    assert ones in cache and [torch.full((3,), 2.0)] in cache and [torch.ones(4)] not in cache


# (h) frozen parameters, buffers, tied weights -------------------------------------------------------------------------


class FrozenAndBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.fc, self.bn, self.head = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.register_buffer("offset", torch.linspace(-1, 1, 8))

    def forward(self, x):
        return self.head(self.bn(F.relu(self.fc(self.embed(x)) + self.offset)))


def test_frozen_parameters_and_buffers():
    torch.manual_seed(0)
    model, inputs = FrozenAndBuffers(), (torch.randn(6, 6), torch.randn(6, 3))
    model.embed.weight.requires_grad_(False)
    frozen = ["embed.weight", "fc.bias"]  # one by requires_grad=False, one by the frozen list
    graph = build(model, mse, inputs, frozen=frozen)
    state = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert graph.state_names == state and [i.name for i in graph.model.graph.input] == ["x", "y", *state]
    assert "fc.bias_grad" not in graph.gradient_names and "embed.weight_grad" not in graph.gradient_names
    assert graph.mutated_buffers == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    assert model.fc.bias.requires_grad  # the caller's flags are untouched
    want_outputs, want_grads = eager(model, mse, inputs)
    with torch.no_grad():  # new state values: the graph reads state from its inputs, nothing is baked in
        model.offset.mul_(3)
        model.embed.weight.mul_(2)
        model.fc.weight.add_(0.1)
    got = run(graph, model, inputs)
    want_outputs, want_grads = eager(model, mse, inputs)
    np.testing.assert_allclose(got["loss"], want_outputs[0].numpy(), atol=ATOL)
    for name in graph.gradient_names:
        np.testing.assert_allclose(got[name], want_grads[name[:-5]].numpy(), atol=ATOL, err_msg=name)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.embed(x))


def test_tied_weights_are_one_input_with_the_summed_gradient():
    torch.manual_seed(0)
    model, inputs = Tied(), (torch.randint(0, 10, (5,)), torch.randint(0, 10, (5,)))
    graph = assert_matches(model, F.cross_entropy, inputs)
    assert graph.state_names == ["embed.weight", "head.bias"]
    assert graph.gradient_names == ["embed.weight_grad", "head.bias_grad"]


def test_loss_module_state_is_baked_and_arguments_are_checked():
    torch.manual_seed(0)
    model, inputs = MLP(), (torch.randn(5, 8), torch.randint(0, 4, (5,)))
    graph = assert_matches(model, nn.CrossEntropyLoss(weight=torch.rand(4)), inputs)
    assert graph.state_names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    with pytest.raises(ValueError, match="unknown"):
        build_torch_gradient_graph(model, F.cross_entropy, ["x", "y"], list(inputs), ["loss"], ["nope"], [])
    with pytest.raises(ValueError, match="one sample tensor per input"):
        build_torch_gradient_graph(model, F.cross_entropy, ["x"], list(inputs), ["loss"], [], [])


class ReturnsLoss(nn.Module):
    """No loss_fn: the module computes the loss itself and returns it first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 2)

    def forward(self, x, y):
        pred = self.fc(x)
        return F.mse_loss(pred, y), pred


def test_model_that_returns_its_loss():
    torch.manual_seed(0)
    model, inputs = ReturnsLoss(), (torch.randn(3, 6), torch.randn(3, 2))
    assert_matches(model, None, inputs, outputs=("loss", "pred"))
