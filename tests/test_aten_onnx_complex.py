"""Complex values in the direct translation, as pairs of reals (orttrainer/trainer/gradient/aten_onnx_complex.py):
each graph runs in ONNX Runtime and in PyTorch (the fx graph itself) on the same inputs, and the results must agree;
the ONNX graph holds no complex tensor."""

from __future__ import annotations

import onnx
import pytest
import torch
from test_aten_onnx import _check, _joint
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from orttrainer.trainer.gradient.aten_onnx import UntranslatableGraph, translate


def _no_complex_types(model: onnx.ModelProto) -> None:
    inferred = onnx.shape_inference.infer_shapes(model)
    complex_types = {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128}
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    assert not [v.name for v in values if v.type.tensor_type.elem_type in complex_types]
    assert not [t.name for t in inferred.graph.initializer if t.data_type in complex_types]


class ComplexOps(nn.Module):
    """A rotation by learned angles and magnitudes (polar's backward), then most of what complex values meet:
    products and quotients of complex values and numbers, sums with reals, conjugates, `complex`, views,
    transposes, slices, concatenation, reductions, `abs`, `real` and `imag`."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.theta = nn.Parameter(torch.randn(6, 4))
        self.magnitude = nn.Parameter(torch.rand(6, 4) + 0.5)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        cis = torch.polar(self.magnitude, self.theta)
        q = self.q(x)
        rotated = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2)) * cis[None, :, :]
        mixed = rotated / (cis + 2.0) - 0.5 * rotated.conj() + torch.complex(q[..., :4], q[..., 4:])
        both = torch.cat([mixed, rotated.transpose(1, 2).transpose(1, 2) * 1j], dim=-1)
        pooled = both.sum(dim=1, keepdim=True) + both.mean(dim=1, keepdim=True)
        pairs = torch.view_as_real(both[:, 1:3, :2]).flatten(2).mean(1, keepdim=True)
        features = torch.cat([pooled.real, pooled.imag.abs(), pooled.abs(), pairs], -1)
        return self.head(features[:, 0, :16])


def test_a_joint_graph_with_complex_values_matches_pytorch_and_holds_no_complex_tensor():
    torch.manual_seed(0)
    graph, args = _joint(ComplexOps(), nn.functional.cross_entropy, [torch.randn(2, 6, 8), torch.randint(0, 3, (2,))])
    complex_nodes = [n for n in graph.graph.nodes if getattr(n.meta.get("val"), "dtype", torch.float32).is_complex]
    assert len(complex_nodes) > 20  # the forward's and the backward's
    _no_complex_types(_check(graph, args, atol=1e-5))


@pytest.mark.parametrize(
    "case",
    ["numbers", "real_tensors", "constant", "fills_and_where", "strided_slice_scatter", "copies_to_and_from_real"],
)
def test_complex_arithmetic_with_numbers_reals_and_constants(case):
    torch.manual_seed(0)
    x, r = torch.randn(3, 4, 2), torch.randn(3, 4)
    table = torch.polar(torch.rand(4) + 0.5, torch.randn(4))  # a complex constant of the graph

    def f(x, r):
        z = torch.view_as_complex(x)
        if case == "numbers":
            out = (z * 1j + (2 - 1j)) / (1.5 + 0.5j) - 3.0 / (z + 1) + 2 * z
        elif case == "real_tensors":
            out = (z + r) * r - r / (z - 2.0) + (r - z) / r.abs().add(1)
        elif case == "constant":
            out = z * table - table.conj() + z[1] * z[:, -1:]  # a select and a slice of complex values
        elif case == "fills_and_where":
            out = torch.where(r > 0, z, torch.full((3, 4), 1 - 2j)) + torch.zeros(3, 4, dtype=torch.complex64)
        elif case == "strided_slice_scatter":
            out = torch.ops.aten.slice_scatter(z, z[:, ::2] * 2j, 1, 0, None, 2)
        else:
            out = z.to(torch.complex128).to(torch.complex64) + r.to(torch.complex64)
            return torch.view_as_real(out), torch.view_as_real(z * 2).sum(-1)
        return (torch.view_as_real(out),)

    _no_complex_types(_check(make_fx(f)(x, r), [x, r], atol=1e-5))


def test_complex_graph_inputs_and_outputs_are_refused():
    z = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(UntranslatableGraph, match="graph input .* is complex"):
        translate(make_fx(lambda z: (torch.view_as_real(z * 2),))(z), ["z"], ["y"], 18)
    with pytest.raises(UntranslatableGraph, match="graph output .* is complex"):
        translate(make_fx(lambda x: (torch.view_as_complex(x) * 2,))(torch.randn(3, 2)), ["x"], ["y"], 18)


def test_an_op_without_a_complex_translation_is_named():
    def f(x):
        return (torch.view_as_real(torch.exp(torch.view_as_complex(x))),)

    with pytest.raises(UntranslatableGraph, match="exp.* on complex values"):
        translate(make_fx(f)(torch.randn(3, 2)), ["x"], ["y"], 18)
