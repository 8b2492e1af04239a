"""The torch builder's eager fallback (gradient/eager_fallback.py, runtime/eager_ops.py): aten ops without an ONNX
translation (torch.linalg) run in PyTorch inside ONNX Runtime, and a model that uses them trains as torch.optim
trains it and evaluates as PyTorch does; graphs that translate stay plain ONNX; a missing onnxruntime-extensions is
a clear error."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
import torch
from helpers import clone, make_trainer, max_difference, steps_like_pytorch, torch_weights, trainer_weights
from torch import nn

from orttrainer import optim
from orttrainer.trainer.gradient.eager_fallback import topological
from orttrainer.trainer.gradient.torch_builder import build_torch_gradient_graph
from orttrainer.trainer.runtime import eager_ops

TORCH = {"_internal_use": {"gradient_builder": "torch"}}


class LinalgModel(nn.Module):
    """A linear layer whose weight goes through linalg.solve, linalg.inv and linalg.eigh: every op of the joint
    graph's linear algebra (forward and backward) has no ONNX translation."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.eye(d) * 3 + 0.3 * torch.randn(d, d, generator=g))
        self.b = nn.Parameter(0.3 * torch.randn(d, d, generator=g))
        self.fc = nn.Linear(d, 3)

    def forward(self, x):
        solved = torch.linalg.solve(self.a, x.T).T  # a @ solved.T = x.T
        inverse = torch.linalg.inv(self.a)
        eigenvalues, eigenvectors = torch.linalg.eigh(self.b @ self.b.T + torch.eye(self.b.shape[0]))
        h = solved @ inverse + x @ eigenvectors * eigenvalues
        return self.fc(torch.tanh(h))


class SquaredSum(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).square().sum()


def _desc(d: int = 4) -> dict:
    return {"inputs": [("x", ["batch", d]), ("target", ["batch"])], "outputs": [("loss", [], True)]}


def _batches(n: int, d: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, d, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def test_linalg_model_trains_like_torch_optim():
    model = LinalgModel()
    reference = clone(model)
    loss_fn = nn.CrossEntropyLoss()
    trainer = make_trainer(model, _desc(), optim.SGDConfig(lr=0.1), loss_fn, TORCH)
    batches = _batches(4)
    losses = [float(trainer.train_step(x, y)) for x, y in batches]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for x, y in batches:
        loss = loss_fn(reference(x), y)
        expected.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5
    x, y = batches[0]  # the eval-mode forward, exported by torch.onnx with the same eager nodes
    with torch.no_grad():
        want = loss_fn(reference(x), y).item()
    got = trainer.eval_step(x, y)
    np.testing.assert_allclose(float(got[0] if isinstance(got, (list, tuple)) else got), want, rtol=1e-5)


class Probit(nn.Module):
    """A probit classifier's negative log-likelihood, `torch.special.log_ndtr` of scores down to about -30, which
    PyTorch decomposes through `special_erfcx`: torchlib's translation of it gave NaN there."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.mul_(8)

    def forward(self, x, y):
        z = self.fc(x).squeeze(-1)
        return -(y * torch.special.log_ndtr(z) + (1 - y) * torch.special.log_ndtr(-z)).mean()


def test_a_probit_loss_trains_like_torch_optim_with_erfcx_run_eagerly():
    torch.manual_seed(0)
    model = Probit()
    reference = clone(model)
    desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.1), None, TORCH)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 4, generator=g), (torch.rand(16, generator=g) < 0.5).float()) for _ in range(3)]
    steps_like_pytorch(trainer, reference, optimizer, data)
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5
    x, y = data[-1]
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(trainer.eval_step(x, y)), reference(x, y))


def test_only_untranslatable_nodes_run_eagerly():
    model = SquaredSum(LinalgModel())
    x = torch.randn(6, 4)
    graph = build_torch_gradient_graph(model, None, ["x"], [x], ["y"], [n for n, _ in model.named_parameters()])
    ops = eager_ops.eager_op_names(graph.model)
    assert {"aten._linalg_solve_ex.default", "aten.linalg_inv_ex.default", "aten._linalg_eigh.default"} <= set(ops)
    assert all(op.startswith("aten.linalg") or op.startswith("aten._linalg") for op in ops), ops
    assert eager_ops.DOMAIN in {o.domain for o in graph.model.opset_import}
    plain = SquaredSum(nn.Linear(4, 3))
    pure = build_torch_gradient_graph(plain, None, ["x"], [x], ["y"], ["model.weight", "model.bias"])
    assert not eager_ops.eager_nodes(pure.model)
    assert all(o.domain in ("", "ai.onnx") for o in pure.model.opset_import), list(pure.model.opset_import)


def test_gradients_match_autograd_through_onnx_runtime():
    import onnxruntime as ort

    model = SquaredSum(LinalgModel())
    x = torch.randn(6, 4)
    names = [n for n, _ in model.named_parameters()]
    graph = build_torch_gradient_graph(model, None, ["x"], [x], ["loss"], names)
    options = ort.SessionOptions()
    eager_ops.prepare_options(graph.model, options)
    session = ort.InferenceSession(graph.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    state = dict(model.named_parameters())
    feeds = {"x": x.numpy()} | {n: state[n].detach().numpy() for n in graph.state_names}
    got = dict(zip([o.name for o in graph.model.graph.output], session.run(None, feeds), strict=True))
    loss = model(x)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.detach().numpy(), rtol=1e-5)
    for name, parameter in state.items():
        np.testing.assert_allclose(got[f"{name}_grad"], parameter.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_missing_onnxruntime_extensions_is_a_clear_error(monkeypatch):
    model = SquaredSum(LinalgModel())
    x = torch.randn(6, 4)
    graph = build_torch_gradient_graph(model, None, ["x"], [x], ["y"], ["model.a"])
    monkeypatch.setitem(sys.modules, "onnxruntime_extensions", None)  # import fails
    with pytest.raises(ImportError, match=r"aten\._linalg_solve_ex\.default.*onnxruntime-extensions"):
        eager_ops.prepare_options(graph.model, object())


def test_kernel_call_round_trip():
    call = eager_ops.encode_call(
        "aten.sum.dim_IntList",
        ([{"input": 0}, [1], True], {"dtype": torch.float64}),
        [torch.float32],
        [torch.float64],
    )
    x = np.arange(6, dtype=np.float64).reshape(2, 3)
    out = eager_ops._kernel(1, x, **{eager_ops.CALL_ATTRIBUTE: call})
    np.testing.assert_array_equal(out, x.sum(1, keepdims=True))
    with pytest.raises(TypeError, match="cannot be written"):
        eager_ops.encode_call("aten.add.Tensor", ([object()], {}), [], [torch.float32])


def test_complex_tensors_cross_as_real_views():
    call = eager_ops.encode_call(
        "aten.mul.Tensor", ([{"input": 0}, {"input": 1}], {}), [torch.complex64] * 2, [torch.complex64]
    )
    a, b = torch.randn(3, dtype=torch.complex64), torch.randn(3, dtype=torch.complex64)
    real = [torch.view_as_real(t).double().numpy() for t in (a, b)]
    out = eager_ops._kernel(1, *real, **{eager_ops.CALL_ATTRIBUTE: call})
    np.testing.assert_allclose(out, torch.view_as_real(a * b).numpy(), rtol=1e-6)


def test_topological_order_puts_producers_first():
    make = onnx.helper.make_node
    nodes = [make("Relu", ["b"], ["c"]), make("Neg", ["a"], ["b"]), make("Abs", ["c"], ["d"])]
    ordered = topological(nodes, {"a"})
    assert [n.op_type for n in ordered] == ["Neg", "Relu", "Abs"]
