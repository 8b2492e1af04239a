"""The torch builder's own decompositions (`gradient/torch_decompositions.py`), run eagerly: each computes what the
aten op it replaces computes, and the forward ones have the op's gradient under `torch.autograd`. (Through the whole
builder and ONNX Runtime they are checked by tests/test_torch_builder_layers.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orttrainer.trainer.gradient import torch_decompositions as D

aten = torch.ops.aten
ATOL = 1e-5


def close(got, want, atol=ATOL, rtol=1e-5):
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def grads_of(fn, *tensors):
    """Gradients of sum(fn(*tensors) * fixed weights) with respect to each tensor."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    weight = torch.cos(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape)
    return torch.autograd.grad((out * weight).sum(), leaves)


# convolution --------------------------------------------------------------------------------------------------------
CONVS = [
    # (dims, in_ch, out_ch, kernel, stride, padding, dilation, groups, transposed, output_padding, size)
    (1, 4, 6, 3, 1, 0, 1, 1, False, 0, 9),
    (1, 4, 6, 3, 2, 1, 1, 2, False, 0, 10),
    (2, 3, 4, 3, 1, 1, 1, 1, False, 0, 7),
    (2, 4, 8, (3, 2), (2, 1), (1, 0), (1, 2), 2, False, 0, 9),
    (2, 6, 6, 3, 2, 1, 1, 6, False, 0, 8),  # depthwise
    (2, 4, 4, 5, 3, 2, 2, 1, False, 0, 12),  # stride leaves trailing input rows unused
    (3, 2, 3, 2, 1, 0, 1, 1, False, 0, 5),
    (3, 4, 4, 3, 2, 1, 1, 2, False, 0, 6),
    (1, 4, 6, 3, 2, 1, 1, 2, True, 1, 5),
    (2, 4, 6, 3, 2, 1, 1, 1, True, 1, 5),
    (2, 6, 4, (3, 2), (2, 3), (1, 0), (2, 1), 2, True, (1, 2), 4),
    (3, 2, 4, 3, 2, 1, 1, 2, True, 1, 3),
    # without groups: the weight gradient as one product per kernel position (up to PER_OFFSET_MAX of them)
    (2, 4, 6, 1, 1, 0, 1, 1, False, 0, 6),  # 1x1
    (2, 4, 6, 1, 2, 0, 1, 1, False, 0, 7),  # 1x1, stride 2
    (2, 3, 5, (3, 5), (2, 1), (1, 2), (2, 1), 1, False, 0, 11),
    (3, 2, 3, 3, (1, 2, 1), 1, 1, 1, False, 0, 6),  # 27 positions
    (2, 3, 4, 7, 2, 3, 1, 1, False, 0, 15),  # 49 positions: the one-convolution form
    (2, 4, 3, 3, 1, 1, 2, 1, True, 0, 6),  # transposed, dilated
]


@pytest.mark.parametrize("per_offset", [True, False], ids=["per-offset", "convolution"])
@pytest.mark.parametrize("case", CONVS, ids=[f"conv{i}" for i in range(len(CONVS))])
def test_convolution_backward_is_the_ops(case, per_offset, monkeypatch):
    """Both forms of the weight gradient (`ORTTRAINER_DISABLE_REWRITES=conv_weight_gradient_per_offset` keeps
    the one convolution) compute the op's gradients."""
    if not per_offset:
        monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "conv_weight_gradient_per_offset")
    dims, cin, cout, kernel, stride, padding, dilation, groups, transposed, output_padding, size = case
    n = lambda v: [v] * dims if isinstance(v, int) else list(v)  # noqa: E731
    torch.manual_seed(0)
    x = torch.randn(2, cin, *[size + i for i in range(dims)])
    w_shape = [cin, cout // groups] if transposed else [cout, cin // groups]
    w = torch.randn(*w_shape, *n(kernel))
    out = aten.convolution(x, w, None, n(stride), n(padding), n(dilation), transposed, n(output_padding), groups)
    g = torch.randn_like(out)
    args = (g, x, w, [cout], n(stride), n(padding), n(dilation), transposed, n(output_padding), groups, [True] * 3)
    want = aten.convolution_backward(*args)
    got = D.convolution_backward(*args)
    for a, b in zip(got, want, strict=True):
        close(a, b, atol=1e-4)
    only_weight = D.convolution_backward(*args[:-1], [False, True, False])
    assert only_weight[0] is None and only_weight[2] is None
    close(only_weight[1], want[1], atol=1e-4)


def test_the_per_position_weight_gradient_is_batched_over_the_samples():
    """Each kernel position's product is one `bmm` over the samples, [N, C_in, output positions] by [N, output
    positions, C_out] (summed over N after it), not one product over (sample, position): ONNX Runtime shares a
    product's output among threads, and [C_in, C_out] alone gave them little (docs/engine.md §20)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def weight_gradient(g, x, w):
        mask = [False, True, False]
        return D.convolution_backward(g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask)[1]

    g, x, w = torch.randn(5, 6, 8, 8), torch.randn(5, 4, 8, 8), torch.randn(6, 4, 3, 3)
    graph = make_fx(weight_gradient)(g, x, w).graph
    products = [node for node in graph.nodes if node.op == "call_function" and "mm" in str(node.target)]
    assert [node.target for node in products] == [aten.bmm.default] * 9
    shapes = {(tuple(p.args[0].meta["val"].shape), tuple(p.args[1].meta["val"].shape)) for p in products}
    assert shapes == {((5, 4, 64), (5, 64, 6))}
    close(
        weight_gradient(g, x, w),
        aten.convolution_backward(g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])[1],
        atol=1e-4,
    )


# activations --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("product", [True, False], ids=["product", "where"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_threshold_backward_is_the_op(product, dtype, threshold, monkeypatch):
    """The gradient times its mask (`threshold_backward_as_product`) and the kept select both give the op's values,
    at exact zeros, at the threshold and at NaN inputs too; a masked negative gradient may be -0.0, equal to 0."""
    if not product:
        monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "threshold_backward_as_product")
    torch.manual_seed(0)
    x = torch.randn(4, 5, 6).to(dtype)
    x[0, 0, :3] = torch.tensor([0.0, threshold, float("nan")], dtype=dtype)
    for self in (x, torch.relu(x)):  # nn.Threshold reads the input, ReLU its output
        grad = torch.randn(4, 5, 6).to(dtype)
        got = D.threshold_backward(grad, self, threshold)
        want = aten.threshold_backward(grad, self, threshold)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


def test_threshold_backward_as_product_differs_only_for_a_non_finite_gradient_at_a_masked_position(monkeypatch):
    """The documented difference: a gradient that is infinite or NaN where the input is at or below the threshold
    gives NaN there (0 times it), where the op gives 0; unmasked, it passes as it is, as the op's does."""
    self = torch.tensor([-1.0, -1.0, 2.0, 2.0])
    grad = torch.tensor([float("inf"), float("nan"), float("inf"), float("nan")])
    got = D.threshold_backward(grad, self, 0.0)
    assert torch.isnan(got[:2]).all() and got[2] == float("inf") and torch.isnan(got[3])
    monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "threshold_backward_as_product")
    kept = D.threshold_backward(grad, self, 0.0)
    assert torch.equal(kept[:3], aten.threshold_backward(grad, self, 0.0)[:3]) and torch.isnan(kept[3])


@pytest.mark.parametrize("product", [True, False], ids=["product", "where"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [-1, 1])
def test_safe_softmax_is_the_op(product, dtype, dim, monkeypatch):
    """The softmax times its rows' mask (`safe_softmax_as_product`) and the kept select both give the op's values
    bit for bit: rows of -inf only (zeros), partly masked rows, a +inf score, NaN with finite scores and NaN among
    -inf only (NaN rows either way); with a `dtype` to compute in, and over an empty dim."""
    if not product:
        monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "safe_softmax_as_product")
    torch.manual_seed(0)
    inf, nan = float("inf"), float("nan")
    x = torch.randn(4, 5, 6)
    x[0, 0], x[0, 1, :3], x[1, 2, 4], x[2, 3, 1] = -inf, -inf, inf, nan
    x[:, 4] = torch.tensor([-inf, -inf, nan, -inf, -inf, -inf])
    x = x.to(dtype)
    for args in ((x, dim), (x, dim, torch.float32), (x[:, :, :0], dim)):
        got, want = D.safe_softmax(*args), aten._safe_softmax(*args)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert (D.safe_softmax(x, -1)[0, 0] == 0).all()


# pooling --------------------------------------------------------------------------------------------------------------
AVG = [
    # (dims, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, size)
    (2, 2, 2, 0, False, True, None, 6),
    (2, 3, 2, 1, False, True, None, 7),
    (2, 3, 2, 1, False, False, None, 7),
    (2, 3, 2, 1, True, True, None, 8),
    (2, 3, 2, 1, True, False, None, 8),
    (2, (3, 2), (1, 2), (1, 0), True, False, None, 7),
    (2, 2, 2, 0, False, True, 3, 6),
    (2, 3, [], 1, False, True, None, 7),
    (3, 2, 2, 0, False, True, None, 4),
    (3, 3, 2, 1, True, False, None, 5),
    (3, 3, 1, 1, False, True, 5, 4),
]


@pytest.mark.parametrize("case", AVG, ids=[f"avg{i}" for i in range(len(AVG))])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_avg_pool_backward_is_the_ops(case, batched):
    dims, kernel, stride, padding, ceil_mode, count_include_pad, divisor, size = case
    n = lambda v: [v] * dims if isinstance(v, int) else list(v)  # noqa: E731
    torch.manual_seed(0)
    x = torch.randn(*([2] if batched else []), 3, *[size + i for i in range(dims)])
    pool = aten.avg_pool2d if dims == 2 else aten.avg_pool3d
    backward = aten.avg_pool2d_backward if dims == 2 else aten.avg_pool3d_backward
    ours = D.avg_pool2d_backward if dims == 2 else D.avg_pool3d_backward
    params = (n(kernel), n(stride) if stride != [] else [], n(padding), ceil_mode, count_include_pad, divisor)
    out = pool(x, *params)
    g = torch.randn_like(out)
    close(ours(g, x, *params), backward(g, x, *params))


def test_max_pool_backward_scatters_to_the_indices():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 6, 7)
    out, idx = aten.max_pool3d_with_indices(x, [3, 2, 3], [2, 2, 1], [1, 0, 1], [1, 1, 1], True)
    g = torch.randn_like(out)
    args = (g, x, [3, 2, 3], [2, 2, 1], [1, 0, 1], [1, 1, 1], True, idx)
    close(D.max_pool3d_with_indices_backward(*args), aten.max_pool3d_with_indices_backward(*args))
    for dims, pool, backward, ours in (
        (2, aten.adaptive_max_pool2d, aten.adaptive_max_pool2d_backward, D.adaptive_max_pool2d_backward),
        (3, aten.adaptive_max_pool3d, aten.adaptive_max_pool3d_backward, D.adaptive_max_pool3d_backward),
    ):
        y = torch.randn(2, 3, *[7 + i for i in range(dims)])
        out, idx = pool(y, [3] * dims)
        g = torch.randn_like(out)
        close(ours(g, y, idx), backward(g, y, idx))


@pytest.mark.parametrize("output_size", [[1, 1, 1], [3, 2, 4], [5, 4, 3]])
def test_adaptive_avg_pool3d_and_its_gradient(output_size):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 4, 7)
    close(D.adaptive_avg_pool3d(x, output_size), aten._adaptive_avg_pool3d(x, output_size))
    for a, b in zip(
        grads_of(lambda t: D.adaptive_avg_pool3d(t, output_size), x),
        grads_of(lambda t: F.adaptive_avg_pool3d(t, output_size), x),
        strict=True,
    ):
        close(a, b)


# other forwards ---------------------------------------------------------------------------------------------------
def test_trilinear_is_bilinear():
    torch.manual_seed(0)
    x1, x2, w, b = torch.randn(5, 3), torch.randn(5, 4), torch.randn(6, 3, 4), torch.randn(6)
    ours = lambda a, c, m: D.trilinear(a, m, c, [1, 3], [0], [1, 2], [2, 3])  # noqa: E731
    close(ours(x1, x2, w), aten._trilinear(x1, w, x2, [1, 3], [0], [1, 2], [2, 3]))
    for a, c in zip(grads_of(ours, x1, x2, w), grads_of(lambda a, c, m: F.bilinear(a, c, m), x1, x2, w), strict=True):
        close(a, c)
    del b


BAGS = [  # (mode, variant); per_sample_weights exist for mode='sum' only
    (mode, variant)
    for mode in ("sum", "mean", "max")
    for variant in ("offsets", "last_offset", "padding_idx", "per_sample", "empty_bag")
    if variant != "per_sample" or mode == "sum"
]


@pytest.mark.parametrize("mode, variant", BAGS)
def test_embedding_bag_and_its_gradient(mode, variant):
    torch.manual_seed(0)
    weight = torch.randn(10, 4)
    indices = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 2])
    offsets = torch.tensor([0, 3, 3, 7] if variant == "empty_bag" else [0, 2, 5, 7])
    kwargs: dict = {"mode": mode}
    if variant == "last_offset":
        offsets, kwargs["include_last_offset"] = torch.tensor([0, 2, 5, 10]), True
    if variant == "padding_idx":
        kwargs["padding_idx"] = 2
    per_sample = torch.rand(10) if variant == "per_sample" else None
    mode_id = {"sum": 0, "mean": 1, "max": 2}[mode]

    def ours(w, psw=None):
        return D.embedding_bag(
            w,
            indices,
            offsets,
            mode=mode_id,
            per_sample_weights=psw,
            include_last_offset=kwargs.get("include_last_offset", False),
            padding_idx=kwargs.get("padding_idx", -1),
        )[0]

    def theirs(w, psw=None):
        return F.embedding_bag(indices, w, offsets, per_sample_weights=psw, **kwargs)

    tensors = (weight,) if per_sample is None else (weight, per_sample)
    close(ours(*tensors), theirs(*tensors))
    for a, b in zip(grads_of(ours, *tensors), grads_of(theirs, *tensors), strict=True):
        close(a, b)


@pytest.mark.parametrize("blank", [0, 3])
@pytest.mark.parametrize("layout", ["padded", "concatenated"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("zero_infinity", [False, True])
@pytest.mark.parametrize("normalised", [True, False])
def test_ctc_loss_and_its_gradient(blank, layout, reduction, zero_infinity, normalised):
    """Per-sample losses equal aten._ctc_loss's (repeated labels, an empty target, a sample shorter than its input,
    one with no alignment: +inf); gradients equal F.ctc_loss's where PyTorch's are finite (with zero_infinity,
    everywhere), of log-probabilities from a log_softmax and of raw scores alike."""
    torch.manual_seed(0)
    steps, batch, classes, width = 12, 5, 6, 5
    logits = torch.randn(steps, batch, classes, dtype=torch.float64)
    targets = torch.randint(0, classes - 1, (batch, width))
    targets = targets + (targets >= blank).to(targets.dtype)  # no blank among the labels
    targets[0, :3] = targets[0, 0]  # a repeated label needs a blank between: no skip
    input_lengths = torch.tensor([12, 10, 12, 2, 7])
    target_lengths = torch.tensor([5, 3, 0, 3, 4])  # sample 3: 3 labels in 2 steps, no alignment
    if layout == "concatenated":
        targets = torch.cat([targets[b, : target_lengths[b]] for b in range(batch)])
    log_probs = logits.log_softmax(-1)
    ours = D.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank)[0]
    theirs = torch.ops.aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, False)[0]
    close(ours, theirs)
    assert torch.isinf(ours[3])

    def scores(x):
        return x.log_softmax(-1) if normalised else x

    def reference(x):
        return F.ctc_loss(scores(x), targets, input_lengths, target_lengths, blank, reduction, zero_infinity)

    def decomposed(x):
        loss = D.ctc_loss(scores(x), targets, input_lengths, target_lengths, blank)[0]
        loss = torch.where(torch.isinf(loss), torch.zeros_like(loss), loss) if zero_infinity else loss
        if reduction == "mean":
            return (loss / target_lengths.clamp(min=1)).mean()
        return loss.sum() if reduction == "sum" else loss

    (want,), (got,) = grads_of(reference, logits), grads_of(decomposed, logits)
    finite = torch.isfinite(want)
    assert finite.all() or not zero_infinity
    close(got[finite], want[finite])
    assert torch.isfinite(got).all()  # an infinite loss's gradient: finite here, NaN in PyTorch


@pytest.mark.parametrize(
    "shape, mask_shape",
    [((3, 4), (3, 4)), ((3, 4), (4,)), ((1, 4), (3, 4)), ((2, 3, 4), (3, 1)), ((5,), (5,))],
)
def test_masked_select_is_the_op(shape, mask_shape):
    torch.manual_seed(0)
    x, mask = torch.randn(shape), torch.rand(mask_shape) < 0.5
    close(D.masked_select(x, mask), aten.masked_select(x, mask))
    close(D.masked_select(x, torch.zeros(mask_shape, dtype=torch.bool)), aten.masked_select(x, mask & False))


def test_as_strided_and_diagonal_scatter_are_the_ops():
    torch.manual_seed(0)
    x, src = torch.randn(4, 5), torch.randn(2, 3)
    close(D.as_strided_scatter(x, src, [2, 3], [5, 2], 1), aten.as_strided_scatter(x, src, [2, 3], [5, 2], 1))
    y = torch.randn(3, 4, 5)
    for offset, dim1, dim2 in [(0, 0, 1), (1, 1, 2), (-2, 2, 0), (3, 0, 2)]:
        diag = torch.diagonal(y, offset, dim1, dim2)
        src = torch.randn_like(diag)
        close(D.diagonal_scatter(y, src, offset, dim1, dim2), aten.diagonal_scatter(y, src, offset, dim1, dim2))


@pytest.mark.parametrize(
    "destination, source",
    [
        (torch.zeros(2, 3, 4), torch.randn(2, 4, 3).transpose(1, 2)),  # a transposed source
        (torch.zeros(2, 4, 5, 3).permute(0, 3, 1, 2), torch.randn(2, 3, 4, 5)),  # a channels-last destination
        (torch.zeros(2, 3, 4, dtype=torch.float64), torch.randn(4)),  # broadcast, another dtype
    ],
    ids=["transposed_source", "permuted_destination", "broadcast"],
)
def test_copy_has_the_destination_s_values_dtype_and_layout(destination, source):
    want = aten.copy(destination, source)
    got = D.copy(destination, source)
    close(got, want)
    assert got.stride() == want.stride() == destination.stride()


def test_empty_permuted_has_the_size_and_dtype():
    out = D.empty_permuted([2, 3, 4], [0, 2, 1], dtype=torch.float64)
    assert out.shape == (2, 3, 4) and out.dtype == torch.float64


def test_special_functions_match_torch():
    x = torch.cat([torch.linspace(-7.3, 30, 200), torch.tensor([0.1, 0.5, 1.0, 2.0, 1e-3, 100.0])])
    close(D.lgamma(x), torch.lgamma(x), atol=1e-4, rtol=1e-4)  # float32 series: ~1e-5 relative near the poles
    close(D.digamma(x), torch.digamma(x), atol=1e-4, rtol=1e-4)
    poles = torch.tensor([0.0, -1.0, -5.0, -30.0])  # the reflection alone gave finite values there (lgamma(-5) 10.6)
    assert torch.equal(D.lgamma(poles), torch.lgamma(poles)) and torch.isinf(D.lgamma(poles)).all()
    positive = torch.linspace(0.05, 20, 200)
    for n in range(1, 5):
        close(D.polygamma(n, positive), torch.polygamma(n, positive), atol=1e-4)
    negative = torch.tensor([-7.5, -3.3, -0.4])
    close(D.polygamma(2, negative), torch.polygamma(2, negative), atol=1e-3)
    y = torch.linspace(-0.999, 0.999, 300)
    close(D.erfinv(y), torch.erfinv(y))
    p = torch.linspace(0.01, 0.99, 100)
    close(D.ndtri(p), torch.special.ndtri(p))
    # the derivatives autograd writes for them are each other
    for a, b in zip(grads_of(D.lgamma, positive), grads_of(torch.lgamma, positive), strict=True):
        close(a, b, atol=1e-4)
