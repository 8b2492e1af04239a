"""The direct translation of traced aten graphs to ONNX (orttrainer/trainer/gradient/aten_onnx.py): each graph runs
in ONNX Runtime and in PyTorch (the fx graph itself) on the same inputs, and the results must agree."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from models import MLP, TinyTransformer, transformer_loss
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from orttrainer.trainer.gradient import torch_private
from orttrainer.trainer.gradient.aten_onnx import FOLD_LIMIT, UntranslatableGraph, translate
from orttrainer.trainer.gradient.torch_trace import JointWrapper

aten = torch.ops.aten


def _run(model: onnx.ModelProto, inputs: list[torch.Tensor]) -> list[np.ndarray]:
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)}
    return session.run(None, feeds)


def _check(graph: torch.fx.GraphModule, inputs: list[torch.Tensor], atol: float = 1e-6) -> onnx.ModelProto:
    """Translate `graph`, run it in ONNX Runtime and compare with the graph run by PyTorch."""
    names = [f"in{i}" for i in range(len(inputs))]
    expected = graph(*inputs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    model = translate(graph, names, [f"out{i}" for i in range(len(expected))], 18)
    for got, want in zip(_run(model, inputs), expected, strict=True):
        assert got.dtype == want.numpy().dtype and got.shape == tuple(want.shape)
        np.testing.assert_allclose(got, want.numpy(), atol=atol, rtol=1e-5)
    return model


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# joint graphs of models, as the torch builder traces them ---------------------------------------------------------


def _joint(
    module: nn.Module, loss_fn, inputs: list[torch.Tensor], first: str = "x"
) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    wrapper = JointWrapper(module, loss_fn, [first, "target"])  # forward's argument, then the label
    with torch_private.math_sdpa():
        graph, sig, _, _ = torch_private.aot_export_joint_dynamic(
            wrapper, inputs, [[] for _ in inputs], for_torch_onnx=False
        )
    state = {**dict(wrapper.named_parameters()), **dict(wrapper.named_buffers())}
    user = iter(inputs)
    args = [state[name].detach() if kind != "user" else next(user) for kind, name in sig.inputs]
    return graph, args


class GeluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 5)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.fc1(x)))
        return self.fc2(torch.cat([h[:, :8], h[:, 8:].clamp(-1.0, 1.0)], dim=1))


class ConvNet(nn.Module):
    """Convolutions (strided, padded, grouped, 1x1, transposed) with training-mode BatchNorm: the joint graph has
    convolutions for the forward and the input gradients, and per-kernel-position products, pads and slices for
    the weight gradients (gradient/torch_decompositions.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.conv3 = nn.Conv2d(8, 6, 1, padding="valid")  # aten's one-element padding list (EfficientNet)
        self.up = nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv1(x)))
        h = self.up(self.conv3(torch.relu(self.conv2(h))))
        return self.head(h.mean(dim=(2, 3)))


@pytest.mark.parametrize(
    "case",
    ["mlp", "gelu_layernorm_cat_clamp", "transformer_embedding_attention_ignore_index", "conv_batchnorm"],
)
def test_joint_graphs_of_models_match_pytorch(case):
    torch.manual_seed(0)
    if case == "mlp":
        graph, args = _joint(MLP(), nn.functional.cross_entropy, [torch.randn(8, 32), torch.randint(0, 10, (8,))])
    elif case == "gelu_layernorm_cat_clamp":
        graph, args = _joint(GeluNet(), nn.functional.cross_entropy, [torch.randn(6, 12), torch.randint(0, 5, (6,))])
    elif case == "conv_batchnorm":
        inputs = [torch.randn(4, 3, 9, 9), torch.randint(0, 3, (4,))]
        graph, args = _joint(ConvNet(), nn.functional.cross_entropy, inputs)
        assert {"Conv", "ConvTranspose", "Pad"} <= set(_ops(_check(graph, args, atol=1e-5)))
        return
    else:
        tokens, target = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))
        target[0, :3] = -100  # ignored by the loss
        model = TinyTransformer(dropout=0.0)  # ONNX Runtime's masks are not PyTorch's
        graph, args = _joint(model, transformer_loss, [tokens, target], "tokens")
    model = _check(graph, args, atol=1e-5)
    assert "Dropout" not in _ops(model)  # dropout with p = 0 is not traced


def test_dropout_is_onnx_dropout_in_training_mode():
    """Dropout's mask is random: the graph must contain ONNX Dropout (the trainer seeds it), with p as its ratio."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.25), nn.Linear(4, 2))
    graph, _ = _joint(net, nn.functional.cross_entropy, [torch.randn(3, 4), torch.randint(0, 2, (3,))], "input")
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    outputs = len(graph.graph.output_node().args[0])
    model = translate(graph, [f"in{i}" for i in range(len(placeholders))], [f"o{i}" for i in range(outputs)], 18)
    dropout = [n for n in model.graph.node if n.op_type == "Dropout"]
    assert len(dropout) == 1 and len(dropout[0].output) == 2
    ratio = next(i for i in model.graph.initializer if i.name == dropout[0].input[1])
    assert onnx.numpy_helper.to_array(ratio) == np.float32(0.25)


# single rules, on hand-made graphs --------------------------------------------------------------------------------


def test_type_promotion_follows_pytorch():
    def f(i, x, h):
        return i + 1.5, i * 2, x / i, (i > 2.5) & (x < 0), h * x, x + h, i / 2

    i = torch.arange(6).reshape(2, 3)
    graph = make_fx(f)(i, torch.randn(2, 3), torch.randn(2, 3).half())
    _check(graph, [i, torch.randn(2, 3), torch.randn(2, 3).half()], atol=1e-3)


def test_slices_selects_and_scatters():
    def f(x, index):
        a = x[:, -3:-1]
        b = x[1:, ::2]
        c = torch.ops.aten.slice_scatter(torch.zeros(4, 6), x[:, 1:3], 1, 1, 3)
        d = torch.ops.aten.slice_scatter(torch.zeros(4, 6), x, 0)
        e = torch.zeros(5, 6).index_put([index], x, accumulate=True)  # repeated and negative indices
        s = torch.zeros(4, 6).scatter(1, index.abs().view(4, 1).expand(4, 2), x)  # the source is larger
        return a, b, c, d, e, s, x.select(0, -1), x.any(dim=1), torch.split(x, [2, 4], dim=1)[1]

    index = torch.tensor([1, -1, 1, 3])
    x = torch.randn(4, 6)
    graph = make_fx(f)(x, index)
    _check(graph, [x, index])


def test_the_ops_of_common_losses_and_activations():
    """mean of every element (MSE, L1, Huber), log1p (BCE, softplus, mish), isnan (KL divergence), ELU, leaky ReLU,
    tanh-approximated GELU, vector norms (cosine similarity) and a clamp with tensor bounds."""

    def f(x, y, i):
        low = torch.full((1, 4), -0.5)
        return (
            x.mean(),
            torch.mean(x, dtype=torch.float64),
            torch.log1p(x.abs()),
            torch.isnan(y),
            torch.isnan(i),
            nn.functional.elu(x, alpha=0.5),
            nn.functional.leaky_relu(x, 0.2),
            nn.functional.gelu(x, approximate="tanh"),
            torch.linalg.vector_norm(x, 2, dim=1, keepdim=True),
            torch.linalg.vector_norm(x, 1, dim=(0, 1)),
            torch.linalg.vector_norm(x),
            torch.clamp(x, low, low + 1.0),
            torch.clamp(x, min=low),
        )

    inputs = [torch.randn(3, 4), torch.tensor([0.0, float("nan"), 1.0]), torch.arange(3)]
    _check(make_fx(f)(*inputs), inputs)


def test_arithmetic_and_order_comparisons_of_bools():
    """ONNX's Mul, Max, Min, Add and order comparisons take no bools; PyTorch's mul, maximum, minimum and add of two
    bools are logic (and, or, and, or), and False < True."""

    def f(a, b):
        return a * b, torch.maximum(a, b), torch.minimum(a, b), a + b, a < b, a >= b, a * True, a == b

    inputs = [torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False])]
    model = _check(make_fx(f)(*inputs), inputs)
    assert {"And", "Or"} <= set(_ops(model)) and not {"Mul", "Max", "Min", "Add"} & set(_ops(model))


def test_logical_ops_of_numbers_read_nonzero_as_true():
    def f(a, b, c):
        return torch.logical_and(a, b), torch.logical_or(a, c), torch.logical_xor(b, c), torch.logical_not(b)

    inputs = [
        torch.tensor([0, 1, 2, 0, 3]),
        torch.tensor([0.0, float("nan"), 0.5, -1.0, 0.0]),
        torch.tensor([True, False, False, True, False]),
    ]
    model = _check(make_fx(f)(*inputs), inputs)
    assert {"And", "Or", "Xor", "Not", "Cast"} <= set(_ops(model))


def test_bitwise_ops_of_integers_combine_bits_and_of_bools_truth_values():
    """On integers `&`, `|`, `^` and `~` work on the bits in the promoted dtype (they were read as truth values,
    and gave bools: `5 & 2` was True where PyTorch gives 0; CpmAnt's int32 masks then failed to open); on bools
    they stay logic."""

    def f(a, b, c, d, e):
        return a & b, a | c, b ^ c, ~a, (a & 6).float(), d & e, d | e, ~d, d ^ e, a | d

    inputs = [
        torch.tensor([5, 12, -3, 0, 7], dtype=torch.int32),
        torch.tensor([2, 10, 6, 1, -1], dtype=torch.int32),
        torch.tensor([1, 3, 255, 0, 64]),  # int64: the promoted dtype
        torch.tensor([True, False, True, False, True]),
        torch.tensor([True, True, False, False, True]),
    ]
    model = _check(make_fx(f)(*inputs), inputs)
    assert {"BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "And", "Or", "Xor", "Not"} <= set(_ops(model))


def test_where_and_masked_fill_of_masks_choose_bools():
    """ONNX Runtime has no Where kernel for bools: `torch.where` of two masks failed to open."""

    def f(cond, a, b):
        return torch.where(cond, a, b), b.masked_fill(cond, True), torch.where(cond, a.to(torch.int16), 3)

    inputs = [
        torch.tensor([True, False, True, False]),
        torch.tensor([True, True, False, False]),
        torch.tensor([False, True, False, True]),
    ]
    _check(make_fx(f)(*inputs), inputs)


def test_reductions_of_a_0_dim_tensor_over_its_dim_are_the_tensor():
    """aten reduces a 0-d tensor over dim 0 or -1 to itself; ONNX's reductions take no axis of a rank-0 tensor
    (the graph failed to open), and ONNX Runtime's CumSum takes no 0-d tensor."""

    def f(x, flags):
        return (
            x.sum(0),
            x.sum(-1, keepdim=True),
            x.amax(0),
            *x.max(0),
            x.cumsum(0),
            flags.any(0),
            torch.count_nonzero(x, 0),
        )

    inputs = [torch.tensor(7), torch.tensor(3, dtype=torch.uint8)]
    _check(make_fx(f, decomposition_table=torch_private.trace_decompositions(for_torch_onnx=False))(*inputs), inputs)


def test_integer_ops_that_onnx_runtime_lacks_for_narrow_types_compute_in_int32():
    """ONNX Runtime has no Neg, Relu, Sign, Max, Min or Where for some of bool, uint8, int8 and int16: they are
    computed in int32 and cast back (uint8's negation wraps, as aten's); a uint8 CumSum sums in int64; `any` of
    uint8 is uint8 (aten's rule)."""

    def f(u, b, s):
        return (
            -u,
            torch.relu(u),
            torch.sign(b),
            u.clamp(3, 200),
            torch.maximum(s, s.flip(0)),
            u.cumsum(0, dtype=torch.uint8),
            u.any(),
        )

    inputs = [
        torch.tensor([0, 1, 200, 255], dtype=torch.uint8),
        torch.tensor([True, False, True, False]),
        torch.tensor([-300, 7, 2, 1000], dtype=torch.int16),
    ]
    _check(make_fx(f)(*inputs), inputs)


def test_a_number_out_of_an_unsigned_type_s_range_wraps_into_it():
    """aten casts the number of `x * -1` to x's uint8 (255); numpy refused the constant (OverflowError). The graph
    runs where ONNX Runtime has a uint8 Mul kernel (onnxruntime-training 1.19 has none)."""
    inputs = [torch.tensor([0, 1, 200, 255], dtype=torch.uint8)]
    graph = make_fx(lambda u: (u * -1,))(*inputs)
    model = translate(graph, ["in0"], ["out0"], 18)
    assert [
        int(onnx.numpy_helper.to_array(i)) for i in model.graph.initializer if i.data_type == onnx.TensorProto.UINT8
    ] == [255]
    if not ort.__version__.startswith("1.19"):
        _check(graph, inputs)


def test_max_over_a_dim_of_int64_names_the_first_maximum():
    """onnxruntime 1.19 has no ArgMax for int64: `max(dim)`'s indices are the first position equal to the maximum,
    as `argmax`'s are (a float would not hold every int64 exactly)."""
    inputs = [torch.tensor([[3, 9, 9, -2], [2**60, 5, 2**60 + 1, 2**60 + 1]])]
    _check(make_fx(lambda x: (*x.max(1), *x.min(0, keepdim=True)))(*inputs), inputs)


def test_gather_takes_an_empty_index_of_any_integer_type():
    inputs = [torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.uint8)]
    _check(make_fx(lambda x, i: (torch.gather(x, 0, i),))(*inputs), inputs)


def test_constants_are_folded_and_large_fills_are_constant_of_shape():
    def f(x):
        masks = torch.arange(3).view(3, 1) == torch.tensor([0, 1, 2])  # constant: folded into one initializer
        big = torch.full((FOLD_LIMIT + 1,), 2.0)
        return x * masks.float().sum(), big.sum() + x

    x = torch.randn(3, 3)
    model = _check(make_fx(f)(x), [x])
    assert "Equal" not in _ops(model) and "ConstantOfShape" in _ops(model)
    assert all(onnx.numpy_helper.to_array(i).size <= FOLD_LIMIT for i in model.graph.initializer)


@pytest.mark.parametrize(
    ("dims", "transposed", "groups", "stride", "padding", "dilation", "bias"),
    [
        (1, False, 1, 2, 1, 1, True),
        (2, False, 2, 1, 2, 2, False),
        (2, True, 1, 2, 1, 1, True),
        (3, False, 1, 1, 0, 1, True),
        (3, True, 2, 2, 1, 1, False),
    ],
)
def test_convolutions_are_conv_and_conv_transpose(dims, transposed, groups, stride, padding, dilation, bias):
    torch.manual_seed(0)
    x = torch.randn(2, 4, *[7 - dims + i for i in range(dims)])
    shape = [4, 6 // groups] if transposed else [6, 4 // groups]
    w, b = torch.randn(*shape, *[3] * dims), torch.randn(6)
    output_padding = [1 if transposed and stride > 1 else 0] * dims

    def f(x, w, b):  # a tuple: the translated graph's outputs are a tuple
        arguments = ([stride] * dims, [padding] * dims, [dilation] * dims, transposed, output_padding, groups)
        return (torch.ops.aten.convolution(x, w, b if bias else None, *arguments),)

    model = _check(make_fx(f)(x, w, b), [x, w, b], atol=1e-4)
    assert _ops(model) == ["ConvTranspose" if transposed else "Conv"]


def test_variances_and_constant_pads():
    """var_mean, var and std (a hand-written LayerNorm's `x.std(-1)`) with and without a correction; pads widen,
    negative pads crop (LocalResponseNorm's backward has them), alone or with widening."""

    def f(x):
        var, mean = torch.ops.aten.var_mean.correction(x, [0, 2], correction=1, keepdim=True)
        var0, mean0 = torch.ops.aten.var_mean.correction(x, [1], correction=0)
        variance, std = torch.ops.aten.var.correction(x, [0, 2], correction=1), x.std(-1, keepdim=True)
        std0, var_all = torch.std(x, 0, unbiased=False), x.var()
        padded = torch.ops.aten.constant_pad_nd(x, [1, 2, 0, 1], 0.5)
        cropped = torch.ops.aten.constant_pad_nd(x, [0, 0, -1, -2])
        both = torch.ops.aten.constant_pad_nd(x, [-1, 2, 1, -1], -3.0)
        return var, mean, var0, mean0, variance, std, std0, var_all, padded, cropped, both

    x = torch.randn(3, 4, 5)
    model = _check(make_fx(f)(x), [x], atol=1e-5)
    assert _ops(model).count("Pad") == 2 and _ops(model).count("Slice") == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_on_running_statistics_is_onnx_batch_normalization(dtype, affine):
    """The op PyTorch's eval-mode BatchNorm calls, with float16 input on float32 statistics as under mixed
    precision (PyTorch computes it in float32)."""
    x = (torch.randn(4, 3, 5, 5) * 2 + 1).to(dtype)
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    mean, var = torch.randn(3, dtype=stats), torch.rand(3, dtype=stats) + 0.5
    weight, bias = (torch.randn(3, dtype=stats), torch.randn(3, dtype=stats)) if affine else (None, None)

    def f(x, mean, var, *affine):
        w, b = affine or (None, None)
        return (aten._native_batch_norm_legit_no_training.default(x, w, b, mean, var, 0.1, 1e-5)[0],)

    inputs = [x, mean, var, *([weight, bias] if affine else [])]
    model = _check(make_fx(f)(*inputs), inputs, atol=2e-3 if dtype == torch.float16 else 1e-5)
    assert "BatchNormalization" in _ops(model)


def test_pooling_is_onnx_pooling_with_aten_indices_and_divisors():
    """Max pooling's indices count within each (batch, channel) plane as aten's do; average pooling divides as aten
    does with and without the padding counted, in ceil mode too, on both runtimes (onnxruntime 1.19's AveragePool
    counts a ceil-mode window's overhang); unbatched input gets a batch dim and loses it."""
    F = nn.functional

    def f(x, x3, unbatched):
        most, index = F.max_pool2d(x, 3, 2, 1, return_indices=True)
        dilated, dilated_index = F.max_pool2d(x, 2, 1, 0, dilation=2, return_indices=True)
        most3, index3 = F.max_pool3d(x3, 2, 2, 1, return_indices=True)
        single, single_index = F.max_pool2d(unbatched, 2, return_indices=True)
        return (
            *(most, index, dilated, dilated_index, most3, index3, single, single_index),
            F.max_pool2d(x, 3, 2, 0, ceil_mode=True),
            F.avg_pool2d(x, 3, 2, 1),
            F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
            F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
            F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
            F.avg_pool2d(x, (2, 3), (1, 2)),
            F.avg_pool3d(x3, 2, 1, 1),
            F.avg_pool2d(unbatched, 2),
        )

    torch.manual_seed(0)
    inputs = [torch.randn(2, 3, 9, 8), torch.randn(1, 2, 5, 6, 4), torch.randn(3, 6, 6)]
    ops = _ops(_check(make_fx(f)(*inputs), inputs, atol=1e-5))
    assert ops.count("MaxPool") == 5 and ops.count("AveragePool") == 7 and ops.count("Mod") == 4
    assert ops.count("Mul") == 1  # aten's divisors of the ceil-mode windows past the padding, counting the padding


def test_a_divisor_override_is_left_to_torch_onnx():
    x = torch.randn(1, 2, 4, 4)
    graph = make_fx(lambda x: nn.functional.avg_pool2d(x, 2, divisor_override=3))(x)
    with pytest.raises(UntranslatableGraph, match="avg_pool2d"):
        translate(graph, ["x"], ["y"], 18)


def test_group_norm_and_batch_statistics_norm_give_aten_statistics():
    """`native_group_norm` (nn.GroupNorm) and `_native_batch_norm_legit.no_stats` (nn.InstanceNorm): the result,
    the mean and the reciprocal standard deviation, with and without weight and bias."""

    def f(x, weight, bias, sequence):
        return (
            *aten.native_group_norm(x, weight, bias, 2, 6, 20, 3, 1e-5),
            *aten.native_group_norm(x, None, None, 2, 6, 20, 2, 1e-3),
            *aten._native_batch_norm_legit.no_stats(sequence, weight, bias, True, 0.1, 1e-5),
            *aten._native_batch_norm_legit.no_stats(sequence, None, None, True, 0.1, 1e-5),
        )

    torch.manual_seed(0)
    inputs = [torch.randn(2, 6, 4, 5) * 3 + 1, torch.randn(6), torch.randn(6), torch.randn(3, 6, 7)]
    _check(make_fx(f)(*inputs), inputs, atol=1e-5)


def test_indexing_repeats_rounded_division_and_activations():
    """index.Tensor with one index (Gather), several adjacent or apart (GatherND), negative indices; repeat with more
    repeats than dims; integer and float division rounded down and toward zero (negative operands included);
    expm1, hardtanh, ReLU6, SELU; an `empty` whose every element is overwritten."""

    def f(x, rows, columns, a, b):
        return (
            *(x[rows], x[:, rows], x[rows, columns], x[:, rows, columns], x[rows, :, columns], x[..., columns]),
            *(x.repeat(2, 1, 3), x.repeat(2, 1, 1, 2)),
            torch.div(a, b, rounding_mode="floor"),
            torch.div(a, b, rounding_mode="trunc"),
            torch.div(a.float(), b.float(), rounding_mode="floor"),
            torch.div(a.float(), b.float(), rounding_mode="trunc"),
            torch.div(a, 3, rounding_mode="floor"),
            *(torch.expm1(x), nn.functional.hardtanh(x, -0.5, 0.7), nn.functional.relu6(x * 4), nn.functional.selu(x)),
            aten.slice_scatter(torch.empty(4, 5, 6), x, 0),
        )

    inputs = [
        torch.randn(4, 5, 6),
        torch.tensor([[0, -1], [2, 3]]),
        torch.tensor([1, -2]),
        torch.tensor([7, -7, 7, -7, 0, 9]),
        torch.tensor([2, 2, -2, -2, 3, -4]),
    ]
    ops = _ops(_check(make_fx(f)(*inputs), inputs))
    assert {"Gather", "GatherND", "Tile", "Floor", "Selu"} <= set(ops)


def test_index_put_with_several_indices():
    """The backward of `x[i, j]` (adjacent or apart, with a whole dim between, negative and repeated indices):
    index_put with several index tensors, accumulating or not, values broadcast."""

    def f(x, rows, columns, values):
        return (
            aten.index_put(x, [rows, columns], values.unsqueeze(-1), True),  # [2, 3] + [6]
            aten.index_put(x, [rows, columns], values.unsqueeze(-1), False),
            aten.index_put(x, [None, rows, columns], values, True),  # [4] + [2, 3]
            aten.index_put(x, [rows, None, columns], values.unsqueeze(-1), True),  # apart: [2, 3] + [5]
            aten.index_put(x, [None, None, columns[0]], torch.ones(()), True),
        )

    torch.manual_seed(0)
    x = torch.randn(4, 5, 6)
    rows, columns = torch.tensor([[0, -1, 1], [3, 3, 0]]), torch.tensor([1, -2, 1])
    inputs = [x, rows, columns, torch.randn(2, 3)]
    ops = _ops(_check(make_fx(f)(*inputs), inputs, atol=1e-5))
    assert ops.count("ScatterND") == 5


def test_rounding_remainders_flips_and_cumulative_sums():
    """floor, ceil, round (half to even, and to decimals), trunc; remainder (the divisor's sign) and fmod (the
    dividend's) of floats and integers; flip; cumsum; the inverse and hyperbolic trigonometric functions; pow with a
    tensor exponent."""

    def f(x, a, b, small):
        return (
            *(torch.floor(x), torch.ceil(x), torch.round(x), torch.round(x, decimals=1), torch.trunc(x)),
            *(torch.floor(a), torch.remainder(x, -1.5), torch.fmod(x, -1.5), torch.remainder(a, b), torch.fmod(a, b)),
            *(torch.remainder(a, 3), x.flip(0, -1), x.flip(1), torch.cumsum(x, 1), torch.cumsum(a, 0)),
            *(torch.tan(small), torch.asin(small), torch.acos(small), torch.atan(x), torch.sinh(x), torch.cosh(x)),
            *(torch.asinh(x), torch.acosh(x.abs() + 1), torch.atanh(small), torch.pow(x.abs(), x)),
        )

    torch.manual_seed(0)
    x = torch.tensor([[-2.5, -1.5, -0.5, 0.5, 1.5, 2.5], [3.7, -3.7, 0.25, -0.26, 7.0, -0.0]])
    inputs = [x, torch.tensor([7, -7, 7, -7, 0, 9]), torch.tensor([2, 2, -2, -2, 3, -4]), torch.rand(2, 6) - 0.5]
    ops = _ops(_check(make_fx(f)(*inputs), inputs, atol=1e-5))
    assert {"Floor", "Ceil", "Round", "Mod", "CumSum", "Slice", "Pow"} <= set(ops)


def test_stepped_slice_scatters_arg_extremes_powers_of_numbers_and_strided_views():
    """slice_scatter with a step (the backward of `x[..., ::2]`, GPT-J's rotary embedding); argmax/argmin along a
    dim, over every element, kept, of floats, int32 (CLIP's pooled token), int64 beyond a double's precision and
    uint8, naming the first extreme; a number to a tensor's power (sinusoidal positions); as_strided of a
    contiguous tensor, as a reshape (adaptive pooling) and as overlapping windows."""

    def f(x, ids32, ids64, flags):
        return (
            *(
                aten.slice_scatter(torch.zeros(4, 6), x[:, ::2], 1, 0, None, 2),
                aten.slice_scatter(x, x[:, :2], 1, 1, 6, 3),
            ),
            *(x.argmax(1), x.argmin(0, keepdim=True), x.argmax(), torch.argmin(x, keepdim=True)),
            *(ids32.argmax(-1), ids64.argmax(1), ids64.argmin(), flags.argmax(1), torch.pow(10000.0, x), 2**x),
            *(aten.as_strided(x.sum(1, keepdim=True), [4, 1], [1, 4]), aten.as_strided(x.reshape(-1), [3, 4], [2, 1])),
        )

    torch.manual_seed(0)
    x = torch.randn(4, 6)
    x[2, 1] = x[2, 4] = x.max() + 1  # a tie: the first is named
    ids32 = torch.tensor([[3, 9, 9, 1], [0, 0, 0, 0]], dtype=torch.int32)
    ids64 = torch.tensor([[2**60 + 1, 2**60 + 3, 2**60 + 3, 2**60 + 2], [-5, 7, -5, 7]])
    flags = torch.tensor([[0, 1, 1], [0, 0, 0]], dtype=torch.uint8)
    model = _check(make_fx(f)(x, ids32, ids64, flags), [x, ids32, ids64, flags], atol=1e-4)
    assert {"ScatterElements", "ArgMax", "ArgMin", "Pow", "Gather"} <= set(_ops(model))


def test_top_k_values_and_indices():
    """topk (a mixture of experts' router): largest and smallest, along the last dim and another, values and indices."""

    def f(x):
        return (*torch.topk(x, 2), *torch.topk(x, 3, dim=0, largest=False), torch.topk(x.double(), 1)[0])

    x = torch.randperm(24).reshape(4, 6).float()  # no ties: PyTorch's order among equal values is unspecified
    assert "TopK" in _ops(_check(make_fx(f)(x), [x]))


def test_sorts_are_stable_in_either_direction():
    """sort and argsort (ViT-MAE's random masking): values and indices, ascending and descending, with ties, which
    a stable sort leaves in their order."""

    def f(x, n):
        return (
            *torch.sort(x, stable=True),
            *torch.sort(x, dim=0, descending=True, stable=True),
            torch.argsort(n, dim=1, stable=True),
            *torch.sort(x[0]),
        )

    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0], [0.5, 0.5, -1.0, 7.0, 0.5], [3.0, 1.0, -1.0, 2.0, 0.0]])
    n = torch.tensor([[4, 4, 1, 9, 1], [2, 2, 2, 2, 2]])
    graph = make_fx(f)(x, n)
    assert {aten.sort.default, aten.sort.stable} <= {node.target for node in graph.graph.nodes}
    assert set(_ops(_check(graph, [x, n]))) >= {"TopK"}


def test_diagonals_of_any_two_dims_and_offset():
    def f(x, m):
        return (
            torch.diagonal(m),
            torch.diagonal(m, 2),
            torch.diagonal(m, -1),
            torch.diagonal(x, 1, 2, 0),
            torch.diagonal(x, -2, -1, 1),
        )

    x, m = torch.randn(3, 4, 5), torch.randn(4, 6)
    graph = make_fx(f)(x, m)
    assert aten.diagonal.default in {node.target for node in graph.graph.nodes}
    assert "Gather" in _ops(_check(graph, [x, m]))


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
def test_scatter_reduce_combines_every_value_sent_to_a_position(reduce, include_self):
    """Index 1 gets three values, 2 one, 0 none (it keeps x's value whatever include_self is)."""

    def f(x, src, index, ints, int_src):
        out = (x.scatter_reduce(1, index, src, reduce, include_self=include_self),)
        if reduce != "mean":  # aten rounds an integer mean down: left to torch.onnx
            out += (ints.scatter_reduce(0, index[0], int_src, reduce, include_self=include_self),)
        return out

    x, src = torch.randn(2, 3), torch.randn(2, 5)
    index = torch.tensor([[1, 2, 1, 1], [2, 2, 1, 2]])
    ints, int_src = torch.tensor([4, -3, 7]), torch.tensor([2, 5, -1, 6])
    inputs = [x, src, index, ints, int_src]
    graph = make_fx(f)(*inputs)
    assert aten.scatter_reduce.two in {node.target for node in graph.graph.nodes}
    assert "ScatterElements" in _ops(_check(graph, inputs))


def test_vector_norms_of_every_order():
    def f(x):
        return (
            torch.linalg.vector_norm(x, float("inf"), dim=1),
            torch.linalg.vector_norm(x, -float("inf"), dim=(0, 2), keepdim=True),
            torch.linalg.vector_norm(x, 0, dim=2),
            torch.linalg.vector_norm(x, 3),
            torch.linalg.vector_norm(x, 0.5, dim=0),
        )

    x = torch.randn(3, 4, 5)
    x[1, 2] = 0.0  # zeros, which order 0 does not count
    graph = make_fx(f)(x)
    assert {"ReduceMax", "ReduceMin", "ReduceSum", "Pow"} <= set(_ops(_check(graph, [x], atol=1e-5)))


def test_logarithms_to_other_bases_infinities_and_extremes_of_every_element():
    def f(x, n):
        return torch.log2(x.abs()), torch.log10(x.abs()), torch.isinf(x), torch.isinf(n), x.max(), n.min()

    x = torch.tensor([[0.5, -8.0, float("inf")], [1e-3, 100.0, -float("inf")]])
    n = torch.tensor([3, -7, 2])
    graph = make_fx(f)(x, n)
    assert {aten.log2.default, aten.log10.default, aten.isinf.default, aten.max.default, aten.min.default} <= {
        node.target for node in graph.graph.nodes
    }
    assert {"IsInf", "ReduceMax", "ReduceMin"} <= set(_ops(_check(graph, [x, n])))


@pytest.mark.parametrize("dim, size, step", [(1, 3, 1), (1, 2, 3), (-1, 4, 2), (0, 2, 2)])
def test_unfold_and_its_backward_read_and_add_at_the_windows(dim, size, step):
    """Tensor.unfold (PatchTST's patches): overlapping windows (step < size), gaps (step > size), the last dim and
    another; the backward adds each window's gradient where the window read."""
    x = torch.randn(3, 7, 9)

    def f(x, grad):
        return x.unfold(dim, size, step), aten.unfold_backward(grad, list(x.shape), dim, size, step)

    grad = torch.randn(x.unfold(dim, size, step).shape)
    graph = make_fx(f)(x, grad)
    assert {aten.unfold.default, aten.unfold_backward.default} <= {node.target for node in graph.graph.nodes}
    assert "ScatterElements" in _ops(_check(graph, [x, grad], atol=1e-5))


def test_as_strided_of_a_view_in_another_order_reads_its_storage():
    """as_strided addresses the storage: of a transposed view (Longformer chunks its transposed queries so), the
    positions count in the order of the view's strides, not in the view's own order."""

    def f(x):
        chunks = x.transpose(0, 1)  # [6, 4] with strides (1, 6)
        return aten.as_strided(chunks, [2, 2], [1, 1]), aten.as_strided(chunks, [3, 8], [4, 1])  # overlapping

    x = torch.randn(4, 6)
    model = _check(make_fx(f)(x), [x])
    assert {"Transpose", "Gather"} <= set(_ops(model))
    cube = torch.randn(2, 3, 4)
    _check(make_fx(lambda t: (aten.as_strided(t.permute(2, 0, 1), [4, 6], [1, 4]),))(cube), [cube])


def test_as_strided_of_a_view_with_gaps_or_of_too_many_positions_is_left_to_torch_onnx():
    from orttrainer.trainer.gradient.aten_onnx import GATHER_LIMIT

    with_gaps = make_fx(lambda x: (aten.as_strided(x[:, ::2], [2, 2], [1, 1]),))(torch.randn(3, 4))
    broadcast = make_fx(lambda x: (aten.as_strided(x, [GATHER_LIMIT + 1], [0]),))(torch.randn(3))
    for graph in (with_gaps, broadcast):
        with pytest.raises(UntranslatableGraph, match="as_strided"):
            translate(graph, ["x"], ["y"], 18)


def test_random_tensors_are_onnx_random_ops_never_folded():
    """rand/randn and their -like forms are ONNX Runtime's random ops (its generator, as torch.onnx writes them): the
    shapes and dtypes PyTorch gives, uniform values in [0, 1), normal ones around 0, new numbers every run."""

    def f(x):
        return (
            *(torch.rand(300, 40) + 0.0, torch.randn_like(x), torch.rand_like(x, dtype=torch.float64)),
            *(torch.randn(7), torch.rand(())),
        )

    x = torch.zeros(200, 60)
    model = translate(make_fx(f)(x), ["x"], ["u", "n", "u64", "n7", "u0"], 18)
    assert {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"} <= set(_ops(model))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    uniform, normal, uniform64, normal7, scalar = session.run(None, {"x": x.numpy()})
    again = session.run(None, {"x": x.numpy()})[0]
    assert uniform.shape == (300, 40) and normal.shape == (200, 60) and normal7.shape == (7,) and scalar.shape == ()
    assert uniform64.dtype == np.float64 and normal.dtype == np.float32
    assert 0.0 <= uniform.min() and uniform.max() < 1.0 and abs(uniform.mean() - 0.5) < 0.02
    assert abs(normal.mean()) < 0.03 and abs(normal.std() - 1.0) < 0.03
    assert not np.array_equal(uniform, again)


def test_bernoulli_draws_are_ones_with_the_probability_in_the_input_s_dtype():
    """`aten.bernoulli.p` (an in-place dropout's mask): zeros and ones, a fraction p of ones, x's shape and dtype,
    new numbers every run."""
    x = torch.zeros(400, 50, dtype=torch.float64)
    model = translate(make_fx(lambda x: (torch.bernoulli(x, 0.3),))(x), ["x"], ["mask"], 18)
    assert "RandomUniformLike" in _ops(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    mask, again = (session.run(None, {"x": x.numpy()})[0] for _ in range(2))
    assert mask.dtype == np.float64 and mask.shape == (400, 50) and set(np.unique(mask)) <= {0.0, 1.0}
    assert abs(mask.mean() - 0.3) < 0.02 and not np.array_equal(mask, again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exponential_draws_have_the_rate_s_distribution_in_the_input_s_dtype(dtype):
    """`aten.exponential` (`Tensor.exponential_`, the Gumbel noise of `F.gumbel_softmax`): non-negative, finite,
    mean and standard deviation 1 / lambd, x's shape and dtype, new numbers every run."""
    x = torch.zeros(400, 50, dtype=dtype)
    draw = torch.func.functionalize(lambda x: (torch.empty_like(x).exponential_(2.0),))  # as the trainer traces it
    model = translate(make_fx(draw)(x), ["x"], ["e"], 18)
    assert "RandomUniformLike" in _ops(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    drawn, again = (session.run(None, {"x": x.numpy()})[0] for _ in range(2))
    assert drawn.dtype == x.numpy().dtype and drawn.shape == (400, 50)
    assert np.isfinite(drawn).all() and drawn.min() >= 0.0
    assert abs(drawn.mean() - 0.5) < 0.02 and abs(drawn.std() - 0.5) < 0.03 and not np.array_equal(drawn, again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform_draws_fill_the_interval_in_the_input_s_dtype(dtype):
    """`aten.uniform` (`Tensor.uniform_`, a router's jitter noise): values from `from` to `to` (as x's dtype rounds
    them), spread over the interval, x's shape and dtype, new numbers every run."""
    x = torch.zeros(400, 50, dtype=dtype)
    draw = torch.func.functionalize(lambda x: (torch.empty_like(x).uniform_(0.9, 1.1),))
    model = translate(make_fx(draw)(x), ["x"], ["u"], 18)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    drawn, again = (session.run(None, {"x": x.numpy()})[0] for _ in range(2))
    assert drawn.dtype == x.numpy().dtype and drawn.shape == (400, 50)
    low, high = np.asarray(0.9, drawn.dtype), np.asarray(1.1, drawn.dtype)  # float32 rounds into the bounds too
    assert low <= drawn.min() < low + 0.001 and high - 0.001 < drawn.max() <= high and abs(drawn.mean() - 1.0) < 0.002
    assert not np.array_equal(drawn, again)


def test_float64_uniform_draws_spread_over_bounds_that_float32_cannot_hold():
    """RandomUniformLike's bounds are float32 attributes: float32 holds 1e8 + 1 as 1e8, and every float64 draw of
    `uniform_(1e8, 1e8 + 1)` was 1e8 (and `uniform_(0.9, 1.1)` drew up to 1.10000002)."""
    x = torch.zeros(200, 50, dtype=torch.float64)
    draw = torch.func.functionalize(lambda x: (torch.empty_like(x).uniform_(1e8, 1e8 + 1),))
    model = translate(make_fx(draw)(x), ["x"], ["u"], 18)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    drawn = session.run(None, {"x": x.numpy()})[0]
    assert drawn.dtype == np.float64 and 1e8 <= drawn.min() < 1e8 + 0.01 and 1e8 + 0.99 < drawn.max() <= 1e8 + 1
    assert abs(drawn.mean() - (1e8 + 0.5)) < 0.02


@pytest.mark.parametrize(("low", "high", "dtype"), [(0, 7, torch.int64), (-3, 2, torch.int32), (5, 6, torch.int64)])
def test_randint_draws_every_integer_of_the_interval_evenly(low, high, dtype):
    """`aten.randint` (Informer's sampled keys): integers in [low, high), each about as often, the result's shape
    and dtype, new numbers every run."""
    draw = (
        (lambda: torch.randint(high, (400, 50), dtype=dtype))
        if low == 0
        else lambda: torch.randint(low, high, (400, 50), dtype=dtype)
    )
    model = translate(make_fx(lambda: (draw(),))(), [], ["r"], 18)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    drawn, again = (session.run(None, {})[0] for _ in range(2))
    assert drawn.dtype == torch.empty(0, dtype=dtype).numpy().dtype and drawn.shape == (400, 50)
    counts = np.bincount((drawn - low).ravel(), minlength=high - low)
    assert len(counts) == high - low and counts.min() > 0.9 * drawn.size / (high - low)
    assert high - low == 1 or not np.array_equal(drawn, again)


def test_a_correction_of_every_element_is_left_to_torch_onnx():
    x = torch.randn(3, 4)
    graph = make_fx(lambda x: torch.ops.aten.var_mean.correction(x, [1], correction=4))(x)
    with pytest.raises(UntranslatableGraph, match="var_mean"):
        translate(graph, ["x"], ["v", "m"], 18)


def test_logsumexp_is_stable_for_large_and_very_negative_values():
    x = torch.tensor([[1000.0, 1000.0, -1e30], [-1e30, -1e30, -1e30], [-3.0, 2.0, 0.5]])
    graph = make_fx(lambda x: (torch.logsumexp(x, [1]), torch.logsumexp(x, [0, 1], keepdim=True)))(x)
    assert _ops(_check(graph, [x])) == ["ReduceLogSumExp", "ReduceLogSumExp"]


def test_outputs_that_are_inputs_or_repeated_get_their_own_names():
    def f(x):
        y = x * 2
        return y, x, y

    x = torch.randn(2)
    model = _check(make_fx(f)(x), [x])
    assert [o.name for o in model.graph.output] == ["out0", "out1", "out2"]


def test_an_op_without_translation_is_named():
    def f(x):
        return torch.cumprod(x, 0)

    with pytest.raises(UntranslatableGraph, match="cumprod"):
        translate(make_fx(f)(torch.randn(3)), ["x"], ["y"], 18)


def test_symbolic_shapes_are_refused():
    def f(x):
        return x.sum(0)

    graph = make_fx(f, tracing_mode="symbolic")(torch.randn(3, 2))
    with pytest.raises(UntranslatableGraph, match="symbolic"):
        translate(graph, ["x"], ["y"], 18)


# in the trainer: the switch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("switch", ["on", "off"])
def test_the_trainer_trains_the_same_with_either_translation(switch, monkeypatch, caplog):
    """`ORTTRAINER_DISABLE_REWRITES=aten_translation` translates with torch.onnx instead; both train like PyTorch."""
    import logging

    from helpers import clone, make_trainer, max_difference, torch_weights, trainer_weights
    from models import transformer_desc

    from orttrainer import optim

    if switch == "off":
        monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "aten_translation")
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.0)
    reference = clone(model)
    extra = {"_internal_use": {"gradient_builder": "torch"}, "utils": {"grad_norm_clip": False}}
    trainer = make_trainer(model, transformer_desc(), optim.SGDConfig(lr=0.1), transformer_loss, extra)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    tokens = torch.randint(0, 50, (4, 16))
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        for _ in range(3):
            trainer.train_step(tokens, tokens)
            sgd.zero_grad()
            transformer_loss(reference(tokens), tokens).backward()
            sgd.step()
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5
    ops = {n.op_type for n in trainer._built.compiled.training.model.graph.node}
    assert ("Squeeze" in ops) == (switch == "off")  # torch.onnx writes squeezes; the direct translation reshapes


class PoolingNet(nn.Module):
    """A small image classifier of the usual shape: reflection padding, convolutions, GroupNorm, ReLU6, max pooling
    and adaptive average pooling; each of these once sent the whole graph to torch.onnx."""

    def __init__(self) -> None:
        super().__init__()
        self.pad = nn.ReflectionPad2d(1)
        self.conv1, self.norm = nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = nn.functional.max_pool2d(nn.functional.relu6(self.norm(self.conv1(self.pad(x)))), 2)
        h = nn.functional.adaptive_avg_pool2d(torch.relu(self.conv2(h)), 1)
        return self.head(h.flatten(1))


def test_a_pooling_cnn_trains_like_pytorch_on_the_direct_translation(caplog):
    """Three SGD steps of `PoolingNet` give PyTorch's weights, without torch.onnx, and an eval step PyTorch's
    eval-mode loss, from a traced eval graph."""
    import logging

    from helpers import clone, make_trainer, max_difference, torch_weights, trainer_weights

    from orttrainer import optim

    torch.manual_seed(0)
    model = PoolingNet()
    reference = clone(model)
    desc = {"inputs": [("x", [4, 3, 10, 10]), ("label", [4])], "outputs": [("loss", [], True)]}
    extra = {"_internal_use": {"gradient_builder": "torch"}, "utils": {"grad_norm_clip": False}}
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.1), nn.functional.cross_entropy, extra)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        for _ in range(3):
            x, label = torch.randn(4, 3, 10, 10, generator=generator), torch.randint(0, 4, (4,), generator=generator)
            trainer.train_step(x, label)
            sgd.zero_grad()
            nn.functional.cross_entropy(reference(x), label).backward()
            sgd.step()
        assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5
        loss = trainer.eval_step(x, label)
    assert "does not cover" not in caplog.text and "is exported" not in caplog.text
    with torch.no_grad():
        assert abs(float(loss) - float(nn.functional.cross_entropy(reference.eval()(x), label))) < 1e-5


# orttrainer's own ops: the ordering gate and the activation marker -----------------------------------------------


def test_the_ordering_gate_and_the_activation_marker_are_translated_directly():
    """`after(x, dep)` is x once dep is computed (NaN, bool and 0-d deps included); `activation_mark` is the marker
    node graph/statistics.py reads. Neither sends the graph to torch.onnx."""
    from orttrainer.trainer.gradient.torch_private import custom_ops
    from orttrainer.trainer.graph.statistics import MARK_DOMAIN, MARK_OP, directed_marks_to_identity

    def f(x, dep, flag, scalar):
        y = custom_ops.AFTER(x * 2, dep)
        z = custom_ops.AFTER(y + 1, flag)
        marked = custom_ops.ACTIVATION_MARK(z, "layer.out", False)
        return custom_ops.AFTER(marked, scalar), custom_ops.ACTIVATION_MARK(y, "layer.out", True)

    inputs = [torch.randn(3, 4), torch.tensor([float("nan"), 1.0]), torch.tensor([True]), torch.tensor(2.0)]
    graph = make_fx(f)(*inputs)
    model = translate(graph, ["x", "dep", "flag", "scalar"], ["out", "grad"], 18)
    assert _ops(model).count(MARK_OP) == 2 and MARK_DOMAIN in {o.domain for o in model.opset_import}
    assert _ops(model).count("Squeeze") == 3
    plain, marks = directed_marks_to_identity(model)
    assert [(activation, direction) for activation, direction, _ in marks] == [
        ("layer.out", "forward"),
        ("layer.out", "backward"),
    ]
    expected = f(*inputs)
    got = _run(plain, inputs)
    for value, want in zip(got, expected, strict=True):
        np.testing.assert_array_equal(value, want.numpy())


def test_a_marked_activation_states_its_dtype():
    """The statistics take a marked activation's dtype from the model's types (trainer/activations.py): a float16
    activation under mixed precision is reported as float16, also when nothing else states its type."""
    from orttrainer.trainer.gradient.torch_private import custom_ops
    from orttrainer.trainer.graph.editor import tensor_elem_type
    from orttrainer.trainer.graph.statistics import MARK_OP

    def f(x):
        inner = custom_ops.ACTIVATION_MARK(x.half() * 2, "inner", False).float() + 1
        return inner, custom_ops.ACTIVATION_MARK(inner.half(), "last", False)

    x = torch.randn(3, 4)
    model = translate(make_fx(f)(x), ["x"], ["out", "last"], 18)
    marked = [n.output[0] for n in model.graph.node if n.op_type == MARK_OP]
    assert [tensor_elem_type(model, name) for name in marked] == [onnx.TensorProto.FLOAT16] * 2


# a convolution's weight gradient traced as one op ---------------------------------------------------------------

WEIGHT_GRADIENT_CASES = [
    # (dims, in_ch, out_ch, kernel, stride, padding, dilation, transposed, output_padding, size)
    (2, 3, 4, 3, 1, 1, 1, False, 0, 7),
    (2, 4, 6, 1, 2, 0, 1, False, 0, 7),  # 1x1, stride 2: one position
    (2, 3, 5, (3, 5), (2, 1), (1, 2), (2, 1), False, 0, 11),
    (1, 4, 6, 3, 1, 0, 1, False, 0, 9),
    (3, 2, 3, 3, (1, 2, 1), 1, 1, False, 0, 6),  # 27 positions
    (2, 4, 3, 3, 1, 1, 2, True, 0, 6),  # transposed, dilated
]


@pytest.mark.parametrize("case", WEIGHT_GRADIENT_CASES, ids=[f"conv{i}" for i in range(len(WEIGHT_GRADIENT_CASES))])
def test_a_convolution_weight_gradient_is_one_traced_op_translated_as_its_decomposition(case):
    """For the direct translation the per-position weight gradient is one traced node,
    `orttrainer::conv_weight_gradient` (gradient/conv_ops.py), whatever the kernel's size; it translates to the nodes
    the decomposition translates to, which compute the same bits, and to aten's gradient; its eager kernel too."""
    from orttrainer.trainer.gradient import conv_ops
    from orttrainer.trainer.gradient import torch_decompositions as D
    from orttrainer.trainer.gradient.torch_trace import translated_directly

    dims, cin, cout, kernel, stride, padding, dilation, transposed, output_padding, size = case
    n = lambda v: [v] * dims if isinstance(v, int) else list(v)  # noqa: E731
    torch.manual_seed(0)
    x = torch.randn(2, cin, *[size + i for i in range(dims)])
    w = torch.randn(*([cin, cout] if transposed else [cout, cin]), *n(kernel))
    conv = (n(stride), n(padding), n(dilation), transposed, n(output_padding), 1)
    g = torch.randn_like(aten.convolution(x, w, None, *conv))
    want = aten.convolution_backward(g, x, w, None, *conv, [False, True, False])[1]

    def weight_gradient(g, x, w):
        return (D.convolution_backward(g, x, w, None, *conv, [False, True, False])[1],)

    graphs, models = {}, {}
    for one_op in (True, False):
        with translated_directly(one_op):
            table = torch_private.core_aten_decompositions()  # as the builder traces: aten.stack becomes a cat
            graphs[one_op] = make_fx(weight_gradient, table, tracing_mode="fake")(g, x, w)
        models[one_op] = translate(graphs[one_op], ["g", "x", "w"], ["grad_weight"], 18)
    ops = [str(node.target) for node in graphs[True].graph.nodes if node.op == "call_function"]
    assert ops == ["orttrainer.conv_weight_gradient.default"]
    assert sorted(_ops(models[True])) == sorted(_ops(models[False]))
    one_op, decomposed = (_run(models[k], [g, x, w])[0] for k in (True, False))
    np.testing.assert_array_equal(one_op, decomposed)
    np.testing.assert_allclose(one_op, want.numpy(), atol=1e-4, rtol=1e-5)
    a, b = (g, x) if transposed else (x, g)
    eager = conv_ops.conv_weight_gradient(a, b, n(kernel), n(stride), n(padding), n(dilation))
    torch.testing.assert_close(eager, want, atol=1e-4, rtol=1e-5)


class StdLayerNorm(nn.Module):
    """The LayerNorm of older transformer code: a learned scale and shift around `(x - mean) / (std + eps)`."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.scale, self.shift = nn.Parameter(torch.ones(features) * 1.5), nn.Parameter(torch.zeros(features) + 0.1)

    def forward(self, x):
        return self.scale * (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6) + self.shift


LOSSES = {
    "mse": (None, nn.functional.mse_loss, "regression"),
    "std_layer_norm": (StdLayerNorm(), None, "regression"),
    "l1": (None, nn.functional.l1_loss, "regression"),
    "smooth_l1": (None, nn.functional.smooth_l1_loss, "regression"),
    "bce_with_logits": (None, nn.functional.binary_cross_entropy_with_logits, "probabilities"),
    "bce_after_sigmoid": (nn.Sigmoid(), nn.functional.binary_cross_entropy, "probabilities"),
    "kl_div": (nn.LogSoftmax(-1), lambda a, b: nn.functional.kl_div(a, b.softmax(-1), reduction="batchmean"), "any"),
    "softplus_elu_leaky_relu": (nn.Sequential(nn.Softplus(), nn.ELU(), nn.LeakyReLU(0.1)), None, "regression"),
    "gelu_tanh_hardswish_mish": (nn.Sequential(nn.GELU("tanh"), nn.Hardswish(), nn.Mish()), None, "regression"),
    "cosine_similarity": (None, lambda a, b: (1 - nn.functional.cosine_similarity(a, b)).mean(), "any"),
}


@pytest.mark.parametrize("case", sorted(LOSSES))
def test_common_losses_and_activations_train_like_pytorch_on_the_direct_translation(case, caplog):
    """Models with these losses and activations went to torch.onnx (a missing translation) and now do not; three
    SGD steps give PyTorch's weights."""
    import logging

    from helpers import clone, make_trainer, max_difference, torch_weights, trainer_weights

    from orttrainer import optim

    head, loss, target_kind = LOSSES[case]
    loss = loss or nn.functional.mse_loss
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), head) if head is not None else nn.Sequential(nn.Linear(8, 4))
    reference = clone(model)
    desc = {"inputs": [("input", ["n", 8]), ("target", ["n", 4])], "outputs": [("loss", [], True)]}
    extra = {"_internal_use": {"gradient_builder": "torch"}, "utils": {"grad_norm_clip": False}}
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.1), loss, extra)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        for _ in range(3):
            x = torch.randn(6, 8, generator=generator)
            target = torch.rand(6, 4, generator=generator) if target_kind == "probabilities" else torch.randn(6, 4)
            trainer.train_step(x, target)
            sgd.zero_grad()
            loss(reference(x), target).backward()
            sgd.step()
    assert "does not cover" not in caplog.text
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5
