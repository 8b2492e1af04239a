"""conv_grad_in_safe_form on hand-built graphs (a grouped ConvGrad of one spatial axis in 2-D form, of three
spatial axes one per group; everything else unchanged), and a model of grouped Conv1d layers trained by the 'ort'
builder like torch.optim (before the pass, ONNX Runtime's kernel wrote past its input gradient and it did not)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import make_trainer, needs_training_build, run_onnx
from onnx import TensorProto, helper

from orttrainer import optim
from orttrainer.trainer.graph.conv_grad import conv_grad_in_safe_form

N, C, M = 3, 8, 6


def _conv_grad_model(rank: int, group: int, opset: int = 17, outputs=("dx", "dw", "db"), kernel: int = 3):
    spatial = [5, 4, 3][:rank]
    pads = [1] * rank + [0] * rank  # asymmetric: the output is one longer than the input less the kernel
    out_spatial = [s + 1 - kernel + 1 for s in spatial]
    node = helper.make_node(
        "ConvGrad",
        ["dy", "x", "w"],
        list(outputs),
        domain="com.microsoft",
        name="conv_grad",
        group=group,
        kernel_shape=[kernel] * rank,
        pads=pads,
        strides=[1] * rank,
        dilations=[1] * rank,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("dy", TensorProto.FLOAT, [N, M, *out_spatial]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, C, *spatial]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [M, C // group, *[kernel] * rank]),
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs if o],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    return model


def _autograd(model, rank: int, group: int):
    """Feeds for `model` and PyTorch's gradients of the same convolution (padding 1 before, 0 after each axis)."""
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    x = torch.tensor(feeds["x"], requires_grad=True)
    w = torch.tensor(feeds["w"], requires_grad=True)
    padded = torch.nn.functional.pad(x, [1, 0] * rank)
    conv = {1: torch.nn.functional.conv1d, 3: torch.nn.functional.conv3d, 2: torch.nn.functional.conv2d}[rank]
    b = torch.zeros(M, requires_grad=True)
    conv(padded, w, b, groups=group).backward(torch.tensor(feeds["dy"]))
    return feeds, {"dx": x.grad.numpy(), "dw": w.grad.numpy(), "db": b.grad.numpy()}


def _conv_grads(model):
    return [n for n in model.graph.node if n.op_type == "ConvGrad"]


def _attribute(node, name):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


@pytest.mark.parametrize("opset", [12, 17])
def test_a_grouped_conv_grad_of_one_spatial_axis_computes_in_two_dimensions(opset):
    model = _conv_grad_model(rank=1, group=2, opset=opset)
    rewritten = conv_grad_in_safe_form(model)
    (node,) = _conv_grads(rewritten)
    assert _attribute(node, "kernel_shape") == [1, 3] and _attribute(node, "pads") == [0, 1, 0, 0]
    assert _attribute(node, "strides") == [1, 1] and _attribute(node, "group") == 2
    unsqueezes = [n for n in rewritten.graph.node if n.op_type == "Unsqueeze"]
    assert len(unsqueezes) == 3 and sum(n.op_type == "Squeeze" for n in rewritten.graph.node) == 2
    if opset < 13:  # the axes as an attribute before opset 13, as an input from it
        assert all(_attribute(n, "axes") == [2] for n in unsqueezes)
    else:
        assert all(len(n.input) == 2 for n in unsqueezes)
    assert node.output[2] == "db"  # the bias gradient comes straight out


def test_a_grouped_conv_grad_of_three_spatial_axes_runs_one_per_group():
    rewritten = conv_grad_in_safe_form(_conv_grad_model(rank=3, group=2))
    nodes = _conv_grads(rewritten)
    assert len(nodes) == 2 and all(_attribute(n, "group") == 1 for n in nodes)
    assert (
        sorted(n.op_type for n in rewritten.graph.node if n.op_type in ("Split", "Concat"))
        == ["Concat"] * 3 + ["Split"] * 3
    )


@pytest.mark.parametrize(
    "rank, group, outputs",
    [(2, 2, ("dx", "dw", "db")), (1, 1, ("dx", "dw", "db")), (3, 1, ("dx", "dw")), (1, 2, ("", "dw", "db"))],
    ids=["two spatial axes", "one group", "one group, three axes", "no input gradient read"],
)
def test_other_conv_grads_are_left_unchanged(rank, group, outputs):
    model = _conv_grad_model(rank=rank, group=group, outputs=outputs)
    assert conv_grad_in_safe_form(model) is model


@needs_training_build
@pytest.mark.parametrize("rank, opset", [(1, 12), (1, 17), (3, 17)])
def test_the_rewritten_gradients_equal_pytorchs(rank, opset):
    model = _conv_grad_model(rank=rank, group=2, opset=opset)
    feeds, expected = _autograd(model, rank, 2)
    found = run_onnx(conv_grad_in_safe_form(model), feeds, ["dx", "dw", "db"])
    for name, value in zip(["dx", "dw", "db"], found, strict=True):
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-5)


class _GroupedConvolutions(torch.nn.Module):
    """Token embeddings through grouped Conv1d layers (SqueezeBERT's and LFM2's kind), each with LayerNorm."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 32)
        self.convs = torch.nn.ModuleList([torch.nn.Conv1d(32, 32, 3, groups=groups, padding=1) for _ in range(3)])
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(32) for _ in range(3)])
        self.head = torch.nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for conv, norm in zip(self.convs, self.norms, strict=True):
            h = norm(h + torch.nn.functional.gelu(conv(h.transpose(1, 2)).transpose(1, 2)))
        return self.head(h).flatten(0, 1)


@needs_training_build
@pytest.mark.parametrize("groups", [4, 32])
def test_grouped_conv1d_layers_train_like_pytorch_with_the_ort_builder(groups):
    torch.manual_seed(0)
    model = _GroupedConvolutions(groups)
    reference = copy.deepcopy(model)
    desc = {"inputs": [("ids", ["batch", 16]), ("label", ["tokens"])], "outputs": [("loss", [], True)]}
    ce = torch.nn.functional.cross_entropy
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.5), ce, {"_internal_use": {"gradient_builder": "ort"}})
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids, labels = torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (64,), generator=g)
        trainer.train_step(ids, labels)
        sgd.zero_grad()
        ce(reference(ids), labels).backward()
        sgd.step()
    assert trainer.gradient_builder == "ort"
    weights = trainer.state_dict(pytorch_format=True)
    for name, value in reference.named_parameters():
        torch.testing.assert_close(weights[name], value.detach(), rtol=1e-4, atol=1e-5, msg=name)


def _same_padded_model(auto_pad: str, kernel: int, stride: int, size: int | str = 6):
    """A 2-D ConvGrad with `auto_pad` and no pads; X of spatial size `size` (a name: unknown before a run)."""
    out = 6 if not isinstance(size, int) else -(-size // stride)
    node = helper.make_node(
        "ConvGrad",
        ["dy", "x", "w"],
        ["dx", "dw", "db"],
        domain="com.microsoft",
        name="same_grad",
        auto_pad=auto_pad,
        kernel_shape=[kernel, kernel],
        strides=[stride, stride],
        dilations=[1, 1],
        group=1,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("dy", TensorProto.FLOAT, [N, M, out, out]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, C, size, size]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [M, C, kernel, kernel]),
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("dx", "dw", "db")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    "auto_pad, kernel, stride, pads",
    [
        ("SAME_UPPER", 3, 1, [1, 1, 1, 1]),
        ("SAME_UPPER", 2, 1, [0, 0, 1, 1]),
        ("SAME_LOWER", 2, 1, [1, 1, 0, 0]),
        ("SAME_UPPER", 3, 2, [0, 0, 1, 1]),
    ],
    ids=["odd kernel", "even kernel, upper", "even kernel, lower", "stride 2 on a known size"],
)
def test_auto_pad_same_becomes_the_pads_onnx_defines(auto_pad, kernel, stride, pads):
    (node,) = _conv_grads(conv_grad_in_safe_form(_same_padded_model(auto_pad, kernel, stride)))
    assert _attribute(node, "pads") == pads
    assert all(a.name != "auto_pad" for a in node.attribute)


def test_auto_pad_same_with_a_stride_on_an_unknown_size_is_an_error_naming_the_way_out():
    with pytest.raises(RuntimeError, match=r"'same_grad' has auto_pad SAME_UPPER.*gradient_builder='torch'"):
        conv_grad_in_safe_form(_same_padded_model("SAME_UPPER", 3, 2, size="height"))


@needs_training_build
@pytest.mark.parametrize("auto_pad, kernel", [("SAME_UPPER", 3), ("SAME_LOWER", 2)])
def test_the_same_padded_gradients_equal_pytorchs(auto_pad, kernel):
    model = _same_padded_model(auto_pad, kernel, 1)
    rng = np.random.default_rng(0)
    feeds = {
        "dy": rng.standard_normal((N, M, 6, 6)).astype(np.float32),
        "x": rng.standard_normal((N, C, 6, 6)).astype(np.float32),
        "w": rng.standard_normal((M, C, kernel, kernel)).astype(np.float32),
    }
    x = torch.tensor(feeds["x"], requires_grad=True)
    w = torch.tensor(feeds["w"], requires_grad=True)
    b = torch.zeros(M, requires_grad=True)
    total = kernel - 1
    before = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
    padded = torch.nn.functional.pad(x, [before, total - before] * 2)
    torch.nn.functional.conv2d(padded, w, b).backward(torch.tensor(feeds["dy"]))
    found = run_onnx(conv_grad_in_safe_form(model), feeds, ["dx", "dw", "db"])
    for value, expected in zip(found, [x.grad, w.grad, b.grad], strict=True):
        np.testing.assert_allclose(value, expected.numpy(), rtol=1e-5, atol=1e-5)
