"""Each wrapper over PyTorch's private API pins the behaviour the torch gradient builder relies on: when a torch
upgrade changes one, the failure points here."""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from models import (
    CheckedInputs,
    DoubledGradient,
    StraightThrough,
    assert_all,
    assert_any,
    assert_plain,
    assert_with_message,
)
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

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


class Asserting(nn.Module):
    """Checks a tensor's value in its forward (`torch._assert_async`, as transformers' LongT5 does)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        torch._assert_async((x.abs() < 100).all(), "inputs are small")
        h = self.fc(x)
        return (h.sum(), h.detach())


@pytest.mark.parametrize("trace", ["joint", "joint_dynamic", "forward"])
def test_the_traces_leave_out_the_checks_a_forward_runs(trace):
    model, x = Asserting(), torch.randn(3, 4)
    if trace == "joint":
        graph, _ = torch_private.aot_export_joint(model, [x])
    elif trace == "joint_dynamic":
        graph, _, _, _ = torch_private.aot_export_joint_dynamic(model, [x], [[]])
    else:
        graph, _, _ = torch_private.aot_export_forward(model, [x])
    targets = {n.target for n in graph.graph.nodes}
    assert not {aten._assert_async.msg, aten._assert_async.default} & targets
    assert aten.addmm.default in targets or aten.mm.default in targets  # the rest of the forward is there


def test_aot_export_forward_signature_values_and_eval_batch_norm():
    """Forward only: no gradient outputs, nothing needs grad, and an eval-mode BatchNorm stays the op the direct
    translation writes as ONNX BatchNormalization (`forward_decompositions`)."""
    torch.manual_seed(0)
    model, x = Small().eval(), torch.randn(5, 3)
    model.bn.running_mean.uniform_(-1, 1)
    graph, sig, _ = torch_private.aot_export_forward(model, [x])
    assert [kind for kind, _ in sig.inputs] == ["parameter"] * 4 + ["buffer"] * 3 + ["user"]
    assert sig.outputs == (("user", sig.outputs[0][1]), ("user", sig.outputs[1][1]))
    targets = {n.target for n in graph.graph.nodes}
    assert aten._native_batch_norm_legit_no_training.default in targets
    assert aten._native_batch_norm_legit_no_training.default in torch_private.training_decompositions()
    state = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    with torch.no_grad():
        got, want = graph(*state, x), model(x)
    for ours, theirs in zip(got, want, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)

    class Casts(nn.Module):
        def forward(self, x):
            return (x.float() * 2).to(torch.float64), x.to(torch.int64)

    graph, _, _ = torch_private.aot_export_forward(Casts(), [x])
    assert aten._assert_tensor_metadata.default not in {n.target for n in graph.graph.nodes}  # the shapes are fixed
    assert [t.dtype for t in graph(x)] == [torch.float64, torch.int64]


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


def test_export_graph_to_onnx_reads_int32_indices_as_int64():
    """ONNX's GatherND and ScatterND take int64 indices only; PyTorch's unfold_backward indexes with int32."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def indexing(x, values, index):
        rows = torch.ops.aten.index.Tensor(x, [None, index])
        placed = torch.ops.aten._unsafe_index_put.default(torch.zeros_like(x), [None, index], values, True)
        return rows.sum(1) + placed.sum(1)

    x, values, index = torch.randn(3, 5), torch.randn(3, 4), torch.tensor([4, 0, 4, 2], dtype=torch.int32)
    graph = make_fx(indexing, tracing_mode="fake")(x, values, index)
    torch_private.int64_indices(graph)
    read = [n for n in graph.graph.nodes if n.op == "call_function" and "index" in str(n.target)]
    assert len(read) == 2
    for node in read:
        assert node.args[1][0] is None and node.args[1][1].meta["val"].dtype == torch.int64
    assert [n.meta["val"].dtype for n in graph.graph.nodes if n.op == "placeholder"][2] == torch.int32
    model = torch_private.export_graph_to_onnx(graph, [x, values, index], ["x", "values", "index"], ["y"], 18)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x.numpy(), "values": values.numpy(), "index": index.numpy()})
    np.testing.assert_allclose(y, indexing(x, values, index.long()).numpy(), atol=1e-6)


class _LinearLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return (F.gelu(self.model(x)).square().mean(),)


class _Rows(nn.Module):
    """`(loss, detached output)` with a batch-sized view and a mean: both symbolic in a dynamic trace."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        h = self.bn(self.fc(x)).view(x.shape[0], 2, 3).mean(dim=1)
        return h.square().mean(), h.detach()


def test_aot_export_joint_dynamic_signature_guards_and_values():
    torch.manual_seed(0)
    model = _Rows()
    graph, sig, guards, _ = torch_private.aot_export_joint_dynamic(model, [torch.randn(8, 4)[3:]], [[0]])  # a view
    assert sig.inputs[:4] == (("parameter", "fc.weight"), ("parameter", "fc.bias"), *sig.inputs[2:4])
    assert [kind for kind, _ in sig.inputs].count("buffer") == 3 and sig.inputs[-1][0] == "user"
    assert sorted(kind for kind, _ in sig.outputs) == ["gradient"] * 4 + ["mutation"] * 3 + ["user"] * 2
    assert guards.dynamic_dims == [[0]]
    assert guards.accepts([torch.randn(7, 4)]) and guards.accepts([torch.randn(9, 4)[2:]])  # any offset
    assert not guards.accepts([torch.randn(1, 4)]) and not guards.accepts([torch.randn(7, 5)])
    state = [*model.parameters(), *model.buffers()]
    x = torch.randn(7, 4)
    flat = graph(*[t.detach().clone() for t in state], x)
    values = {
        kind: [v for v, (k, _) in zip(flat, sig.outputs, strict=True) if k == kind] for kind in ("user", "gradient")
    }
    loss, _ = model(x)
    loss.backward()
    np.testing.assert_allclose(values["user"][0].detach(), loss.detach(), atol=1e-6)
    grads = dict(zip([n for k, n in sig.outputs if k == "gradient"], values["gradient"], strict=True))
    for name, param in model.named_parameters():
        np.testing.assert_allclose(grads[name].detach(), param.grad, atol=1e-6)


def test_aot_export_joint_dynamic_reports_specialised_dims_and_missing_gradients():
    class Specialised(_Rows):
        def forward(self, x):
            return super().forward(x * 2 if x.shape[0] == 5 else x)

    _, _, guards, _ = torch_private.aot_export_joint_dynamic(Specialised(), [torch.randn(5, 4)], [[0]])
    assert guards.dynamic_dims == [[]] and not guards.accepts([torch.randn(6, 4)])
    model = _Rows()
    model.extra = nn.Parameter(torch.ones(1))
    with pytest.raises(torch_private.MissingGradientError) as info:
        torch_private.aot_export_joint_dynamic(model, [torch.randn(5, 4)], [[0]])
    assert torch_private.is_missing_gradient_error(info.value) and "extra" in str(info.value)


def test_is_real_tensor_in_trace_error():
    scale = torch.tensor([2.0, 3.0])

    class Global(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            return ((x * self.w * scale).sum(),)

    with pytest.raises(Exception) as info:
        torch_private.aot_export_joint(Global(), [torch.ones(2)])
    assert torch_private.is_real_tensor_in_trace_error(info.value)
    assert not torch_private.is_real_tensor_in_trace_error(AssertionError("something else"))


def test_reentrant_checkpoint_traceable_routes_to_the_non_reentrant_form_and_restores():
    from torch.utils import checkpoint

    fc = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    before = checkpoint.CheckpointFunction.__dict__.get("apply")
    with torch_private.reentrant_checkpoint_traceable():
        out = checkpoint.checkpoint(fc, x, use_reentrant=True)
        assert out.grad_fn is not None and "CheckpointFunction" not in type(out.grad_fn).__name__
        (weight_grad,) = torch.autograd.grad(out.sum(), [fc.weight])  # refused by the reentrant form
        frozen = checkpoint.checkpoint(fc, x.detach(), use_reentrant=True)
        assert not frozen.requires_grad  # as the reentrant form: no input requires grad, no gradient
    assert checkpoint.CheckpointFunction.__dict__.get("apply") is before
    np.testing.assert_allclose(weight_grad, torch.autograd.grad(fc(x).sum(), [fc.weight])[0], atol=1e-6)


def test_export_module_to_onnx_reports_dynamic_ranges_and_specialised_dims():
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.randn(8, 3))

        def forward(self, x, y):
            torch._check(x.shape[1] <= 8)  # a range on the length
            z = x + self.pos[: x.shape[1]].sum(-1)
            return (z * 2 if y.shape[0] == 5 else z,)  # Python on y's size: specialised

    model, specs = torch_private.export_module_to_onnx(
        Positions(), [torch.randn(4, 6), torch.randn(5)], ["x", "y"], ["out"], 18, [[0, 1], [0]]
    )
    assert specs[0][0][1] is None and specs[0][1][1] == 8, specs  # the batch unbounded, the length at most 8
    assert specs[1] == [5]  # specialised, and static in the ONNX input too
    assert model.graph.input[1].type.tensor_type.shape.dim[0].dim_value == 5


def test_storage_reads_sees_views_and_torchscript_but_not_unread_buffers():
    @torch.jit.script
    def scaled(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * s

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    scale = nn.Parameter(torch.ones(4))
    unused = torch.zeros(2)
    named = {**model.state_dict(keep_vars=True), "scale": scale, "unused": unused}
    with torch_private.storage_reads(named) as read:
        scaled(model(torch.randn(2, 3)), scale[:4])
    assert read == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "scale"}


def test_trace_decompositions_cover_what_torch_onnx_cannot_translate():
    from orttrainer.trainer.gradient.torch_private.tracing import trace_decompositions

    assert aten.squeeze.dims in torch_private.onnx_decompositions()  # no ONNX function: decomposed while tracing
    table = trace_decompositions()
    assert aten.squeeze.dims in table and aten.gelu_backward.default in table
    assert aten._native_batch_norm_legit_functional.default in table  # the training-mode batch-norm fix wins


def test_aot_export_joint_dynamic_same_sizes_share_one_symbol():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, y):
            return ((self.fc(x) - y).square().mean(),)

    args = [torch.randn(5, 4), torch.randn(5, 4)]
    _, _, separate, _ = torch_private.aot_export_joint_dynamic(Pair(), args, [[0], [0]])
    _, _, shared, _ = torch_private.aot_export_joint_dynamic(Pair(), args, [[0], [0]], [[(0, 0), (1, 0)]])
    assert separate.accepts([torch.randn(6, 4), torch.randn(6, 4)]) and shared.accepts([torch.randn(6, 4)] * 2)
    assert not shared.accepts([torch.randn(6, 4), torch.randn(7, 4)])  # one size: a mismatch is another graph


def test_float16_traces_lower_layer_norm_and_the_export_keeps_the_state_read_through_casts():
    from orttrainer.trainer.gradient.torch_private.tracing import trace_decompositions

    assert aten.native_layer_norm.default not in trace_decompositions()  # float32: ONNX LayerNormalization
    assert aten.native_layer_norm.default in trace_decompositions(float16=True)  # docs/engine.md §15

    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return (x.half() * self.weight.half(),)

    model, _ = torch_private.export_module_to_onnx(Half(), [torch.randn(2, 3)], ["x"], ["y"], 18, [[]])
    assert {i.name for i in model.graph.initializer} == {"weight"}  # the Cast is not folded into a new constant
    assert "weight" in {name for node in model.graph.node for name in node.input}


def test_export_tracing_flags_are_torch_export_s_and_restored():
    assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()
    with torch_private.export_tracing_flags():
        assert torch.compiler.is_compiling() and torch.compiler.is_exporting()
    assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def test_aot_export_joint_dynamic_gives_a_tied_parameter_its_gradient_under_the_name_the_forward_reads():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(4))  # the first name; the forward reads it as fc.bias
            self.fc = nn.Linear(3, 4)
            self.fc.bias = self.bias

        def forward(self, x):
            return (self.fc(x).pow(2).mean(),)

    graph, sig, _, _ = torch_private.aot_export_joint_dynamic(Tied(), [torch.randn(5, 3)], [[0]])
    assert ("gradient", "fc.bias") in sig.outputs and ("gradient", "fc.weight") in sig.outputs


def test_export_module_to_onnx_keeps_parameters_whatever_their_values():
    class ZeroBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.norm = nn.Linear(3, 4), nn.LayerNorm(4)  # LayerNorm: weight 1, bias 0
            nn.init.zeros_(self.fc.bias)

        def forward(self, x):
            return (self.norm(self.fc(x)) * 2,)

    model, _ = torch_private.export_module_to_onnx(ZeroBias(), [torch.randn(5, 3)], ["x"], ["y"], 18, [[0]])
    names = {i.name for i in model.graph.initializer}
    assert {"fc.weight", "fc.bias", "norm.weight", "norm.bias"} <= names
    used = {name for node in model.graph.node for name in node.input}
    assert {"fc.bias", "norm.weight", "norm.bias"} <= used
    assert not {i.name for i in model.graph.input} - {"x"}


def test_has_translation_knows_torch_onnx_s_table():
    assert torch_private.has_translation(aten.add.Tensor, 18)
    assert not torch_private.has_translation(aten._linalg_solve_ex.default, 18)
    import operator

    assert torch_private.has_translation(operator.getitem, 18)  # the exporter's own business


def test_failed_node_reads_the_exporter_s_error():
    module = torch.fx.GraphModule({}, torch.fx.Graph())
    fx = module.graph
    a = fx.placeholder("a")
    a.meta["val"] = FakeTensorMode().from_tensor(torch.eye(3))  # as a traced graph's (torch.onnx detects the mode)
    node = fx.call_function(aten.cholesky.default, (a,))
    fx.output((node,))
    module.recompile()
    with pytest.raises(Exception) as caught:
        torch_private.export_graph_to_onnx(module, [torch.eye(3)], ["a"], ["l"], 18)
    assert torch_private.failed_node(caught.value) == (node.name, "aten.cholesky.default")
    assert torch_private.failed_node(ValueError("something else")) is None


def test_linalg_checks_untraced_lets_aot_autograd_trace_inv_and_restores():
    class Inverse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.eye(3) * 2)

        def forward(self, x):
            return ((torch.linalg.inv(self.w) * x).sum(),)

    with pytest.raises(IndexError):  # if this passes, PyTorch fixed it: the wrapper can go
        torch_private.aot_export_joint(Inverse(), [torch.ones(3, 3)], 0)
    with torch_private.linalg_checks_untraced():
        graph, _ = torch_private.aot_export_joint(Inverse(), [torch.ones(3, 3)], 0)
    assert aten.linalg_inv_ex.default in {n.target for n in graph.graph.nodes}
    with pytest.raises(IndexError):
        torch_private.aot_export_joint(Inverse(), [torch.ones(3, 3)], 0)


def test_causal_mask_detection_off_takes_is_causal_as_given_and_restores():
    from torch.nn.modules import transformer

    causal = nn.Transformer.generate_square_subsequent_mask(4)
    assert transformer._detect_is_causal_mask(causal, None, 4)  # PyTorch compares the values
    with torch_private.causal_mask_detection_off():
        assert not transformer._detect_is_causal_mask(causal, None, 4)
        assert transformer._detect_is_causal_mask(causal, True, 4)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
        x = torch.randn(4, 2, 8)
        with torch.no_grad():
            given = encoder(x, causal)
    with torch.no_grad():
        torch.testing.assert_close(given, encoder(x, causal))  # the flag is a hint: the same values
    assert transformer._detect_is_causal_mask(causal, None, 4)


class LayerDrop(nn.Module):
    """transformers' LayerDrop: in training mode, skip the layer when a draw falls below `probability`."""

    def __init__(self, probability: float, compare=lambda draw, p: draw < p) -> None:
        super().__init__()
        self.layer, self.probability, self.compare = nn.Linear(3, 3), probability, compare

    def forward(self, x):
        skip = self.training and self.compare(torch.rand([]), self.probability)
        return ((x if skip else self.layer(x)).sum(),)


@pytest.mark.parametrize(
    ("compare", "probability", "skipped"),
    [
        (lambda draw, p: draw < p, 0.0, False),  # transformers' default layerdrop
        (lambda draw, p: draw < p, 1.0, True),
        (lambda draw, p: draw <= p, -0.5, False),
        (lambda draw, p: p > draw, 2, True),  # a number on the left: Python calls draw.__lt__
        (lambda draw, p: draw > p, 1.0, False),
        (lambda draw, p: (draw >= p).item(), 0.0, True),
    ],
)
def test_random_branches_decided_traces_a_branch_every_draw_takes_alike(compare, probability, skipped):
    model = LayerDrop(probability, compare)
    with pytest.raises(Exception, match="data-dependent|_local_scalar_dense"):  # PyTorch alone refuses the branch
        torch_private.aot_export_forward(model, [torch.ones(2, 3)])
    with torch_private.random_branches_decided():
        graph, _, _ = torch_private.aot_export_forward(model, [torch.ones(2, 3)])
    assert (aten.addmm.default in {n.target for n in graph.graph.nodes}) is not skipped
    assert graph(*model.parameters(), torch.ones(2, 3))[0] == (6.0 if skipped else model(torch.ones(2, 3))[0])


def test_random_branches_decided_names_a_branch_whose_draws_differ():
    with torch_private.random_branches_decided(), pytest.raises(torch_private.RandomBranchError) as raised:
        torch_private.aot_export_forward(LayerDrop(0.1), [torch.ones(2, 3)])
    assert torch_private.random_branch(raised.value) == "torch.rand(...) < 0.1"
    with torch_private.random_branches_decided():  # eager code keeps its values
        model = LayerDrop(0.5)
        outcomes = {bool(model(torch.ones(2, 3))[0] == torch.ones(2, 3).sum()) for _ in range(64)}
    assert outcomes == {True, False}


INDEXED_BY_A_SCALAR_TENSOR = [  # (index of x of shape (5, 4, 3) built from the 0-dim tensor t, eager's own index)
    lambda t: t,
    lambda t: (slice(None), t),
    lambda t: (Ellipsis, t),
    lambda t: (None, slice(1, None), t, 2),
    lambda t: (t, Ellipsis, t),
    lambda t: (torch.tensor([True, False, True, True, False]), t),  # a mask takes its dims before t's
    lambda t: (slice(None), torch.tensor([0, 2, 1]), t),  # a tensor of indices beside it
]


@pytest.mark.parametrize("index", INDEXED_BY_A_SCALAR_TENSOR)
def test_tensor_indices_selected_traces_indexing_by_a_scalar_tensor_as_eager_indexes(index):
    """Rule: `x[..., t, ...]` with a 0-dim integer tensor t selects as `x[..., int(t), ...]` (PyTorch reads t's
    value); traced, it is a select by t, one graph for every value of t (negative ones too), with eager's gradient."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, t):
        out = x[index(t)]
        return out, torch.autograd.grad((out * out).sum(), x)[0]

    x = torch.randn(5, 4, 3, requires_grad=True)
    with pytest.raises(Exception, match="data-dependent|_local_scalar_dense"):  # PyTorch alone needs t's value
        make_fx(step, tracing_mode="fake")(x, torch.tensor(1))
    with torch_private.tensor_indices_selected():
        graph = make_fx(step, tracing_mode="fake")(x, torch.tensor(1))
    assert aten._local_scalar_dense.default not in {n.target for n in graph.graph.nodes}
    for value in (0, 2, -1, -3):
        t = torch.tensor(value)
        expected = step(x, t)
        got = graph(x, t)
        assert got[0].shape == expected[0].shape
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)


def test_tensor_indices_selected_leaves_other_indices_to_pytorch():
    """A float, bool or 1-dim tensor index, and an index with a list inside, are not rewritten."""
    from orttrainer.trainer.gradient.torch_private.tracing import _selected_dims

    assert _selected_dims([slice(None), torch.tensor([1])], 2) == []
    assert _selected_dims([torch.tensor(True)], 2) == []
    assert _selected_dims([torch.tensor(1.0)], 2) == []
    assert _selected_dims([[0, 1], torch.tensor(1)], 2) is None
    assert _selected_dims([Ellipsis, torch.tensor(1), Ellipsis], 2) is None
    assert _selected_dims([torch.tensor(1, dtype=torch.int32), Ellipsis, torch.tensor(0)], 4) == [(0, 0), (2, 3)]


@pytest.mark.parametrize("op", ["<", "<=", ">", ">="])
def test_random_branch_outcomes_hold_for_every_draw(op):
    """What `_every_draw` decides is what 100,000 draws (and the edge values 0 and just below 1) give."""
    from orttrainer.trainer.gradient.torch_private.tracing import _every_draw

    draws = torch.cat([torch.rand(100_000), torch.tensor([0.0, 1.0 - 2.0**-24])])
    compare = {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge}[op]
    for bound in [-1.0, -1e-9, 0.0, 1e-9, 0.5, 1.0 - 1e-9, 1.0, 1.5, float("nan")]:
        decided, given = _every_draw(op, bound), compare(draws, bound)
        assert decided is None or bool(given.all() if decided else not given.any()), (op, bound)
    assert _every_draw(op, 0.5) is None


def _at_first_jump(function, rule):
    """`rule(frame)` for a frame of `function` standing at its first conditional jump, where Python asks for a truth
    value (evaluated there, under a tracer that stops at each opcode)."""
    import dis
    import sys

    jump = next(i.offset for i in dis.get_instructions(function) if i.opname.startswith("POP_JUMP"))
    results = []

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode" and frame.f_code is function.__code__ and frame.f_lasti == jump and not results:
            results.append(rule(frame))
        return trace

    sys.settrace(trace)
    try:
        with contextlib.suppress(ValueError):  # a check that raises on True (`_raises_if`): asked at its jump first
            function(True)
    finally:
        sys.settrace(None)
    return results[0]


def _plain_if(flag):
    if not flag:
        raise AssertionError("an if, not an assert statement")


def _raises_if(flag):
    if flag:
        raise ValueError("var has negative entry/entries")


def _raises_if_not_with_a_formatted_message(flag):
    if not flag:
        raise ValueError(f"expected a true flag, got {flag!r} of {type(flag).__name__}")


def _logs_then_raises(flag):
    if flag:
        print("about to stop")
        raise ValueError("stopped")


def _chooses(flag):
    value = 1.0
    if flag:
        value = 2.0
    return value


def _returns_early(flag):
    if flag:
        return None
    raise ValueError("unreachable from the true way only")


def _raises_to_its_own_except(flag):
    try:
        if flag:
            raise ValueError("not this way")
    except ValueError:
        return 1.0  # the raise chooses a value here: no check
    return 0.0


def _raises_inside_a_with_block(flag):
    with torch.no_grad():
        if not flag:
            raise ValueError("a check all the same: the with block raises it again")
    return 0.0


def _raises_conditionally_formatted(flag):
    if flag:
        raise ValueError("a" if flag else "b")  # the message has a jump of its own: not straight


@pytest.mark.parametrize(
    ("function", "passing"),
    [
        (assert_plain, True),
        (assert_with_message, True),
        (assert_all, True),  # the first operand of `and` in an assert holds when the assert does
        (_plain_if, True),  # `if not flag: raise`
        (_raises_if, False),
        (_raises_if_not_with_a_formatted_message, True),
        (_logs_then_raises, False),
        (_returns_early, True),  # the false way raises at once
        (assert_any, None),  # an operand of `or` need not hold
        (_chooses, None),
        (_raises_conditionally_formatted, None),
        (_raises_to_its_own_except, None),
        (_raises_inside_a_with_block, True),
    ],
)
def test_passing_way_is_the_truth_value_that_avoids_a_raise_at_once(function, passing):
    """At the first jump: an assert, or an `if` one of whose ways runs straight into `raise` (building the error
    and its message) is a check, which the truth value `passing` passes; an `if` that chooses a value, and an
    operand of `or` in an assert, are no check (None)."""
    from orttrainer.trainer.gradient.torch_private.tracing import _passing_way

    assert _at_first_jump(function, _passing_way) is passing


class _Loss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        return (F.cross_entropy(self.model(x, labels), labels),)


def test_traces_assume_an_assert_on_a_value_holds_and_leave_its_check_out():
    model, x, labels = _Loss(CheckedInputs()), torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    joint, _, _, _ = torch_private.aot_export_joint_dynamic(model, [x, labels], [[], []], for_torch_onnx=False)
    forward, _, _ = torch_private.aot_export_forward(model, [x, labels])
    for graph in (joint, forward):
        targets = {n.target for n in graph.graph.nodes}
        assert torch.ops.aten._assert_scalar.default not in targets and torch.ops.aten.addmm.default in targets
    torch.testing.assert_close(forward(*model.parameters(), x, labels)[0], model(x, labels)[0])


def test_a_branch_on_a_value_that_is_no_check_still_fails_the_trace():
    class Branches(nn.Module):
        def forward(self, labels):
            if labels.max().item() >= 2:
                labels = labels - 1
            return (labels * 2,)

    with pytest.raises(Exception, match="data-dependent|_local_scalar_dense"):
        torch_private.aot_export_forward(Branches(), [torch.tensor([0, 1, 1, 0])])


class _Padded(nn.Module):
    """`(loss,)` of a branch on the input's values, as transformers' FSMT takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, ids):
        out = self.fc(x)
        padding = ids.eq(0)
        if padding.any():
            out = out.masked_fill(padding.unsqueeze(-1), 0.0) * 3
        return (out.sum(),)


def test_a_trace_with_real_values_takes_the_batchs_branch_and_guards_it():
    model, x = _Padded(), torch.randn(2, 3)
    padded, unpadded = torch.tensor([0, 4]), torch.tensor([5, 4])
    for ids, other in ((padded, unpadded), (unpadded, padded)):
        joint, _, _, values = torch_private.aot_export_joint_dynamic(
            model, [x, ids], [[], []], for_torch_onnx=False, real_values=True
        )
        forward, _, eval_values = torch_private.aot_export_forward(model, [x, ids], real_values=True)
        for guards in (values, eval_values):
            assert guards is not None and guards.inputs == (1,)  # the program reads `ids` only
            assert guards.hold([x, ids]) and guards.hold([torch.randn(2, 3), ids.clone()])
            assert not guards.hold([x, other])
        for graph in (joint, forward):  # the reads steered Python only: not in the graph
            assert aten._local_scalar_dense.default not in {n.target for n in graph.graph.nodes}
        torch.testing.assert_close(forward(*model.parameters(), x, ids)[0], model(x, ids)[0])
        torch.testing.assert_close(joint(*model.parameters(), x, ids)[0], model(x, ids)[0])


def test_a_trace_with_real_values_and_no_branch_has_no_value_guards():
    model = nn.Sequential(nn.Linear(3, 2))
    _, _, _, values = torch_private.aot_export_joint_dynamic(
        _Loss(_Ignoring(model)), [torch.randn(2, 3), torch.tensor([0, 1])], [[], []], real_values=True
    )
    assert values is None


class _Ignoring(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        return self.model(x)


def test_a_branch_on_a_parameter_or_a_random_draw_cannot_be_guarded_by_the_batch():
    class OnWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return (self.fc(x).sum() * 2 if self.fc.weight.sum() > 0 else self.fc(x).sum(),)

    class OnDraw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return (self.fc(x).sum() if torch.rand([]) < 0.3 else x.sum() + self.fc.bias.sum(),)

    x = torch.randn(2, 3)
    with pytest.raises(torch_private.ValueBranchError, match="fc.weight") as refused:
        torch_private.aot_export_joint_dynamic(OnWeight(), [x], [[]], real_values=True)
    assert refused.value.state == "fc.weight"
    with pytest.raises(torch_private.RandomBranchError, match=r"torch.rand\(...\) < 0.3"):
        torch_private.aot_export_joint_dynamic(OnDraw(), [x], [[]], real_values=True)


class _PredictedVariance(nn.Module):
    """Gaussian NLL with a predicted variance: torch.nn's loss checks `if torch.any(var < 0): raise`, a check on
    an activation; `ids` also steers a branch (as `_Padded`'s) when `branch_on_ids`."""

    def __init__(self, branch_on_ids: bool = False) -> None:
        super().__init__()
        self.fc, self.var = nn.Linear(3, 2), nn.Linear(3, 2)
        self.branch_on_ids = branch_on_ids

    def forward(self, x, ids, target):
        mean = self.fc(x)
        if self.branch_on_ids and ids.eq(0).any():
            mean = mean * 3
        return (F.gaussian_nll_loss(mean, target, F.softplus(self.var(x))),)


class _ChecksLabels(nn.Module):
    def forward(self, labels):
        if labels.max() >= 2:  # as transformers' CTC heads check `labels.max() >= vocab_size`
            raise ValueError("a label out of range")
        if not labels.min().item() >= 0:  # a number read with .item(): the ShapeEnv is asked through a SymBool
            raise ValueError(f"a negative label, {labels.min().item()}")
        return (labels * 2,)


def test_a_check_is_assumed_to_pass_on_the_state_and_on_the_batch_and_a_branch_beside_it_is_guarded():
    """A check that reads an activation (torch.nn's Gaussian NLL on a predicted variance) or the batch traces
    without values, as the way that passes, and leaves nothing in the graph; with real values, a branch on the
    batch beside the check is guarded, and only it."""
    x, target = torch.randn(2, 3), torch.randn(2, 2)
    padded, unpadded = torch.tensor([0, 4]), torch.tensor([5, 4])
    checked = _PredictedVariance()
    joint, _, _, values = torch_private.aot_export_joint_dynamic(checked, [x, padded, target], [[], [], []])
    forward, _, eval_values = torch_private.aot_export_forward(checked, [x, padded, target])
    assert values is None and eval_values is None
    for graph in (joint, forward):
        assert not {aten._local_scalar_dense.default, aten._assert_scalar.default} & {
            n.target for n in graph.graph.nodes
        }
    torch.testing.assert_close(forward(*checked.parameters(), x, unpadded, target)[0], checked(x, unpadded, target)[0])

    both = _PredictedVariance(branch_on_ids=True)
    _, _, _, values = torch_private.aot_export_joint_dynamic(
        both, [x, padded, target], [[], [], []], for_torch_onnx=False, real_values=True
    )
    assert values is not None and values.inputs == (1,) and len(values.conditions) == 1  # `ids` only
    assert values.hold([x, padded, target]) and not values.hold([x, unpadded, target])

    for real_values in (False, True):  # a label out of range: the dry run's eager forward raises, not the trace
        labels, _, label_values = torch_private.aot_export_forward(
            _ChecksLabels(), [torch.tensor([0, 3])], real_values=real_values
        )
        assert label_values is None
        torch.testing.assert_close(labels(torch.tensor([0, 1]))[0], torch.tensor([0, 2]))


def test_raised_by_model_tells_a_models_own_raise_from_the_tracers_errors():
    class SmallBatches(nn.Module):
        def forward(self, labels):
            if labels.shape[0] > 8:
                raise ValueError("batches of up to 8 labels")
            return (labels * 2,)

    class Branches(nn.Module):
        def forward(self, labels):
            return (labels * 2 if labels.max() >= 2 else labels,)

    with pytest.raises(ValueError) as own:
        torch_private.aot_export_forward(SmallBatches(), [torch.zeros(9, dtype=torch.int64)])
    with pytest.raises(Exception) as traced:  # no values: PyTorch's data-dependent error
        torch_private.aot_export_forward(Branches(), [torch.tensor([0, 3])])
    with pytest.raises(RuntimeError, match="same reduction dim") as kernel:  # raised by PyTorch for an op
        torch_private.aot_export_forward(nn.Sequential(nn.Linear(3, 2)), [torch.randn(4, 5)])
    from orttrainer.trainer.gradient.aten_onnx import UntranslatableGraph

    class RaisesOrttrainers(nn.Module):  # as a stand-in for the builder would, in a test
        def forward(self, labels):
            raise UntranslatableGraph("no direct translation of aten.some_op")

    with pytest.raises(UntranslatableGraph) as ours:
        torch_private.aot_export_forward(RaisesOrttrainers(), [torch.tensor([0, 3])])
    assert torch_private.raised_by_model(own.value)
    assert not torch_private.raised_by_model(traced.value) and not torch_private.raised_by_model(kernel.value)
    assert not torch_private.raised_by_model(ours.value)  # orttrainer's own error type, wherever it was raised


def test_a_trace_with_real_values_sees_the_parameters_values():
    """PyTorch's converter left a fake parameter's real values uninitialised (it copies plain tensors only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from orttrainer.trainer.gradient.torch_private.tracing import _real_values_propagated

    layer = nn.Linear(4, 2)
    with _real_values_propagated():
        fake = FakeTensorMode(allow_non_fake_inputs=True).from_tensor(layer.weight)
    torch.testing.assert_close(fake.real_tensor, layer.weight.detach())


def test_a_forward_writing_into_its_input_is_a_mutation_output_of_the_joint_graph():
    class Relabels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, x, labels):
            labels.masked_fill_(labels < 0, 0)
            return (F.cross_entropy(self.fc(x), labels),)

    labels = torch.tensor([-100, 2])
    graph, sig, _, _ = torch_private.aot_export_joint_dynamic(Relabels(), [torch.randn(2, 3), labels], [[], []])
    user = [name for kind, name in sig.inputs if kind == "user"]
    assert ("mutation", user[1]) in sig.outputs and labels.tolist() == [-100, 2]  # the sample is not written


def test_unsupported_at_opset_reads_the_torchscript_exporters_refusal():
    class Unflatten(nn.Module):
        def forward(self, x):
            return x.unflatten(0, (2, 3))

    with pytest.raises(Exception) as refused:  # noqa: PT011  (the exporter's own error type is the subject)
        import io
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(Unflatten(), (torch.randn(6, 4),), io.BytesIO(), opset_version=12, dynamo=False)
    assert torch_private.unsupported_at_opset(refused.value) == ("aten::unflatten", 12, 13)
    assert torch_private.unsupported_at_opset(ValueError("something else")) is None


def _digest(forward, model: nn.Module, x: torch.Tensor, hooks: bool = False) -> str:
    params = list(model.parameters())
    return torch_private.dataflow_digest(
        lambda: forward(model, x), [x], dict(model.named_parameters()), params, python_backward=hooks
    )


def _plain(model, x):
    return model(x).sum()


def _no_grad_scale(model, x):  # the same forward ops as `_scaled`, one of them without a gradient
    h = model(x)
    with torch.no_grad():
        scale = h.abs().mean()
    return (h * scale).sum()


def _scaled(model, x):
    h = model(x)
    scale = h.abs().mean()
    return (h * scale).sum()


def _through_function(model, x):
    return DoubledGradient.apply(model(x)).sum()


def _through_clone(model, x):
    return model(x).clone().sum()


def _hooked(model, x):
    h = model(x)
    h.register_hook(lambda g: g * 3)
    return h.sum()


def test_dataflow_digest_sees_the_backward_without_running_it():
    torch.manual_seed(0)
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    plain = _digest(_plain, model, x)
    assert plain == _digest(_plain, model, torch.randn(4, 3)) == _digest(_plain, nn.Linear(3, 2), x)  # values
    assert plain != _digest(_plain, model, torch.randn(5, 3))  # shapes
    # no_grad and detach change the backward only: the autograd graph tells them apart
    assert _digest(_no_grad_scale, model, x) != _digest(_scaled, model, x)
    # the same forward ops; the custom Function's Python backward is run and recorded
    assert _digest(_through_function, model, x) != _digest(_through_clone, model, x)


def test_dataflow_digest_runs_the_backward_when_python_can_run_in_it():
    torch.manual_seed(0)
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    ran = []

    def counted(grad):
        ran.append(grad)
        return grad

    def hooked_weight(model, x):
        return model(x).sum()

    assert _digest(_hooked, model, x) != _digest(_plain, model, x)  # a tensor hook on an activation
    model.weight.register_hook(counted)  # a hook outside the graph: the caller says so
    assert torch_private.backward_hooks_outside(model)
    _digest(hooked_weight, model, x, hooks=torch_private.backward_hooks_outside(model))
    assert len(ran) == 1  # the backward ran
    other = nn.Linear(3, 2)
    assert not torch_private.backward_hooks_outside(other)
    walked = _digest(_plain, other, x)
    with torch.autograd.graph.save_on_cpu():  # saved-tensor hooks: the backward runs them, so it is recorded
        assert _digest(_plain, other, x) != walked


def test_dataflow_digest_runs_the_backward_only_when_python_can_run_in_it(monkeypatch):
    calls = []
    grad = torch.autograd.grad

    def counted(*args, **kwargs):
        calls.append(args)
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counted)
    torch.manual_seed(0)
    model, x = nn.Linear(3, 2), torch.randn(4, 3, requires_grad=True)
    _digest(_plain, model, x)
    _digest(_no_grad_scale, model, x)
    assert calls == []  # C++ derivatives only: read from the autograd graph

    def checkpointed(model, x):  # the reentrant checkpoint is a custom Function
        return torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True).sum()

    _digest(_through_function, model, x)
    _digest(checkpointed, model, x)
    hooked = nn.Linear(3, 2)
    hooked.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    _digest(_plain, hooked, x, hooks=torch_private.backward_hooks_outside(hooked))
    assert len(calls) == 3


def test_saved_tensors_dropped_builds_the_graph_but_keeps_no_activation():
    import weakref

    x = torch.randn(64, 64, requires_grad=True)

    def forward():
        h = x * 2
        kept = weakref.ref(h)
        return (h * h).sum(), kept  # the product saves its inputs for its backward

    loss, kept = forward()
    assert kept() is not None  # autograd holds the activation until the backward
    with torch_private.saved_tensors_dropped():
        loss, kept = forward()
    assert kept() is None
    assert loss.grad_fn is not None and loss.grad_fn.next_functions[0][0].name() == "MulBackward0"
    with pytest.raises(torch_private.SavedTensorDroppedError):
        loss.backward()
    with torch.autograd.graph.save_on_cpu(), torch_private.saved_tensors_dropped():  # hooks in force stay in charge
        loss, _ = forward()
    loss.backward()
    assert x.grad is not None


def test_dataflow_digest_keeps_the_saved_tensors_a_backward_inside_the_forward_needs():
    torch.manual_seed(0)
    model, x = nn.Linear(3, 2), torch.randn(4, 3, requires_grad=True)

    def penalised(model, x):  # a gradient penalty: the forward runs a backward of its own
        y = model(x)
        (slope,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y.sum() + slope.pow(2).sum()

    digest = _digest(penalised, model, x)
    assert digest == _digest(penalised, model, torch.randn(4, 3, requires_grad=True))
    assert digest != _digest(_plain, model, x)


def test_gradient_edits_follow_a_stopped_or_hooked_value_to_what_it_computes():
    w = torch.randn(3, requires_grad=True)
    buffer = torch.randn(3)
    with torch_private.gradient_edits() as reaching:
        h = w * 2
        detached = h + (3 * h).detach()  # line A
        with torch.no_grad():
            quiet = h.exp()  # line B
        quieted = h + quiet
        shaped = h + torch.zeros_like(h) + h.new_ones(3)  # reads no value: no stop
        typed = h + buffer.detach().type_as(h) + buffer.expand_as(h)  # h's metadata only (VideoMAE's positions)
        masked = h * (h.detach() > 0)  # a boolean carries nothing
        data = h * h.data  # line C
        frozen = buffer.detach() * 2  # nothing required grad: no stop
        plain = (h * 2).sum()
        hooked = h * 3
        hooked.register_hook(lambda grad: grad * 0.5)
        after_hook = hooked.sum()
    edits = ((detached, "(3 * h).detach()"), (quieted, "quiet = h.exp()"), (data, "h * h.data"))
    for value, source in (*edits, (after_hook, "hooked.register_hook")):
        [place] = reaching(value)
        assert place.startswith(f"{__file__}:") and source in place
    for value in (shaped, typed, masked, frozen, plain):
        assert reaching(value) == []
    assert len(reaching([detached, quieted, detached.sum()])) == 2  # nested outputs, each place once


def test_parameter_hooks_act_once_on_a_tied_parameter_s_summed_gradient():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
            self.second.weight = self.first.weight

        def forward(self, x):
            return self.second(self.first(x)).sum()

    model, calls = Tied(), []
    model.first.weight.register_hook(lambda grad: calls.append(1) or grad.clamp(-0.1, 0.1))
    hooks = torch_private.parameter_hooks(model)
    assert list(hooks) == [("first.weight", "second.weight")]
    x = torch.randn(2, 3)
    model(x).backward()
    expected = model.first.weight.grad.clone()
    # what a tracer does: the parameters swapped for plain tensors, which carry no hook
    placeholder = model.first.weight.detach().clone().requires_grad_()
    swapped = {"first.weight": placeholder, "second.weight": placeholder}
    with torch.nn.utils.stateless._reparametrize_module(model, swapped):
        with torch_private.parameter_hooks_applied(model, hooks):
            model(x).backward()
    torch.testing.assert_close(placeholder.grad, expected)
    assert len(calls) == 2  # once per backward, on the sum over both uses
