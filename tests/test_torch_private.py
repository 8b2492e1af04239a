"""Each wrapper over PyTorch's private API pins the behaviour the torch gradient builder relies on: when a torch
upgrade changes one, the failure points here."""

from __future__ import annotations

import inspect

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from models import StraightThrough
from torch import nn

from orttrainer.trainer.gradient import torch_private

aten = torch.ops.aten


def test_core_aten_decompositions_lower_backward_ops():
    table = torch_private.core_aten_decompositions()
    assert aten.gelu_backward.default in table and aten.native_layer_norm_backward.default in table


def test_training_decompositions_lower_batch_norm():
    table = torch_private.training_decompositions()
    assert aten._native_batch_norm_legit_functional.default in table
    assert aten.native_batch_norm.default in table
    assert aten.gelu_backward.default in table


def test_math_sdpa_forces_the_math_backend_and_restores():
    before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    with torch_private.math_sdpa():
        assert torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()) == before


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(3, 4), nn.BatchNorm1d(4)
        self.fc.bias.requires_grad_(False)

    def forward(self, x):
        out = self.bn(self.fc(x))
        return out.pow(2).mean(), out.detach()


def test_aot_export_joint_signature_and_values():
    torch.manual_seed(0)
    model, x = Small(), torch.randn(5, 3)
    graph, sig = torch_private.aot_export_joint(model, [x])
    assert sig.inputs == (
        ("parameter", "fc.weight"),
        ("parameter", "fc.bias"),
        ("parameter", "bn.weight"),
        ("parameter", "bn.bias"),
        ("buffer", "bn.running_mean"),
        ("buffer", "bn.running_var"),
        ("buffer", "bn.num_batches_tracked"),
        ("user", sig.inputs[-1][1]),
    )
    kinds = [kind for kind, _ in sig.outputs]
    assert kinds == ["mutation"] * 3 + ["user"] * 2 + ["gradient"] * 3
    assert [name for kind, name in sig.outputs if kind == "gradient"] == ["fc.weight", "bn.weight", "bn.bias"]
    assert not any(n.target == aten._native_batch_norm_legit_functional.default for n in graph.graph.nodes)
    state = [*model.parameters(), *model.buffers()]
    flat = graph(*[t.detach().clone() for t in state], x)
    loss, _ = model(x)
    loss.backward()
    np.testing.assert_allclose(flat[3].detach(), loss.detach(), atol=1e-6)
    for got, param in zip(flat[5:], [model.fc.weight, model.bn.weight, model.bn.bias], strict=True):
        np.testing.assert_allclose(got.detach(), param.grad, atol=1e-6)


def test_aot_export_joint_keeps_custom_function_backward():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return (StraightThrough.apply(x * self.w).sum(),)

    graph, _ = torch_private.aot_export_joint(Model(), [torch.tensor([1.0, 2.0, 3.0])])
    _, grad = graph(torch.ones(3), torch.tensor([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(grad, [3.0, 6.0, 9.0])  # round() alone would give 0


def test_is_missing_gradient_error():
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))

        def forward(self, x):
            return ((x * self.used).sum(),)

    with pytest.raises(Exception) as info:
        torch_private.aot_export_joint(Unused(), [torch.ones(2)])
    assert torch_private.is_missing_gradient_error(info.value)
    assert not torch_private.is_missing_gradient_error(AssertionError("something else"))
    assert not torch_private.is_missing_gradient_error(RuntimeError("did not receive a gradient"))


def test_autograd_function_of_frame():
    frames: dict[str, object] = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            frames["forward"] = inspect.currentframe()
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            frames["backward"] = inspect.currentframe()
            return grad * 2

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert torch_private.autograd_function_of_frame(frames["forward"]) == (Probe, "forward")
    assert torch_private.autograd_function_of_frame(frames["backward"]) == (Probe, "backward")

    def forward(self):  # a plain function named like a Function method
        return inspect.currentframe()

    assert torch_private.autograd_function_of_frame(forward(object())) is None
    assert torch_private.autograd_function_of_frame(inspect.currentframe()) is None


def test_export_graph_to_onnx():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    wrapped = _LinearLoss(model)
    graph, _ = torch_private.aot_export_joint(wrapped, [torch.randn(4, 3)])
    x = torch.randn(4, 3)
    onnx_model = torch_private.export_graph_to_onnx(
        graph, [model.weight.detach(), model.bias.detach(), x], ["w", "b", "x"], ["loss", "gw", "gb"], 18
    )
    assert onnx_model.ir_version <= 10
    assert {o.domain: o.version for o in onnx_model.opset_import}[""] == 18
    assert [i.name for i in onnx_model.graph.input] == ["w", "b", "x"]
    assert [d.dim_value for d in onnx_model.graph.input[2].type.tensor_type.shape.dim] == [4, 3]  # static shapes
    session = ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])
    loss, gw, gb = session.run(
        None, {"w": model.weight.detach().numpy(), "b": model.bias.detach().numpy(), "x": x.numpy()}
    )
    wrapped(x)[0].backward()
    np.testing.assert_allclose(loss, wrapped(x)[0].item(), atol=1e-6)
    np.testing.assert_allclose(gw, model.weight.grad, atol=1e-6)
    np.testing.assert_allclose(gb, model.bias.grad, atol=1e-6)
    with pytest.raises(ValueError, match=">= 18"):
        torch_private.export_graph_to_onnx(graph, [model.weight, model.bias, x], ["w", "b", "x"], ["l"], 17)


class _LinearLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return (F.gelu(self.model(x)).square().mean(),)
