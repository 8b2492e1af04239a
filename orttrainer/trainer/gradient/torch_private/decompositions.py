"""The decompositions the torch builder traces with: one table, with where each entry comes from and why.

Two stages (`Entry.stage`):
- "trace": replaces an op in the traced joint graph, after autograd has chosen the backward ops (the
  `decompositions=` table of AOTAutograd). Used for backward ops and for forward ops whose derivative is fine.
- "autograd": replaces an op before autograd sees it (a Python kernel for the op's Autograd dispatch key, as
  PyTorch itself registers for `aten.lstm`), so autograd differentiates the decomposition's ops. Used for forward
  ops whose own backward op has no ONNX translation while a differentiable decomposition of the forward exists.
  An own entry for an op that PyTorch itself decomposes so (`aten.lstm.input`, `aten.gru.input`, the RNNs') replaces
  PyTorch's kernel while tracing and calls it (`pytorch_decomposition`) where it declines.

Order of preference (issue 23): PyTorch's decompositions (`torch._decomp`) and torch.onnx's translations (onnxscript
torchlib); `orttrainer.trainer.gradient.torch_decompositions` only where neither exists. Each own entry is checked
eagerly against the op and `torch.autograd` (tests/test_torch_decompositions.py; the recurrent layers',
tests/test_recurrent_layers.py) and through the builder and ONNX Runtime (tests/test_torch_builder_layers.py).

Part of `torch_private` (see its docstring for the rule); verified on torch 2.13.0 with onnxscript 0.7.2.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from .. import recurrent_layers
from .. import torch_decompositions as own
from .exporting import onnx_decompositions

aten = torch.ops.aten


@dataclass(frozen=True)
class Entry:
    """Ops decomposed at one `stage` by one `source`, for one `reason`. `ops` are overload names ("aten.x.default");
    `source` is "torch._decomp" (PyTorch's own decomposition of each op), "torch.onnx" (the exporter's table) or
    "orttrainer" (`decomposition`, from gradient/torch_decompositions.py); `float16`: only when the module is traced
    computing in float16 (mixed precision)."""

    ops: tuple[str, ...]
    stage: Literal["trace", "autograd"]
    source: Literal["torch._decomp", "torch.onnx", "orttrainer"]
    reason: str
    decomposition: Callable | None = None
    float16: bool = False


CORE_ATEN = "core_aten"  # the whole `core_aten_decompositions()` table
ONNX_TABLE = "onnx_table"  # the whole `onnx_decompositions()` table, less its prims-level entries

TABLE: tuple[Entry, ...] = (
    Entry(
        (CORE_ATEN,),
        "trace",
        "torch._decomp",
        "lowers composite ops and PyTorch's backward ops (gelu_backward, native_layer_norm_backward, ...) to the "
        "core aten set, which torch.onnx translates",
    ),
    Entry(
        (
            "aten._native_batch_norm_legit_functional.default",
            "aten._native_batch_norm_legit.default",
            "aten._native_batch_norm_legit_no_training.default",
            "aten.native_batch_norm.default",
        ),
        "trace",
        "torch._decomp",
        "onnxscript's translation of _native_batch_norm_legit_functional forces training=False (its fix for old "
        "ONNX Runtime): a training-mode BatchNorm would be exported on running statistics, a silently wrong loss "
        "and gradient (onnxscript 0.7.2); lowered, it is mean/var arithmetic",
    ),
    Entry(
        ("aten.native_layer_norm.default",),
        "trace",
        "torch._decomp",
        "traced in float16, ONNX LayerNormalization types its statistics float32 and the decomposed backward "
        "divides them by a float16 constant, which ONNX Runtime refuses (docs/engine.md §15)",
        float16=True,
    ),
    Entry(
        (ONNX_TABLE,),
        "trace",
        "torch.onnx",
        "the ops torch.onnx has no translation for (aten.squeeze.dims, ...), decomposed while tracing so that the "
        "export skips its own decomposition pass; without lift/lift_fresh, which the tracer needs to make "
        "constants; the entries of this table below replace some of its entries",
    ),
    Entry(
        ("aten.convolution_backward.default",),
        "trace",
        "orttrainer",
        "every convolution's backward: torch._decomp has no decomposition and torchlib's raises "
        "NotImplementedError; written as Conv/ConvTranspose (groups, depthwise, dilation, transposed)",
        own.convolution_backward,
    ),
    Entry(
        ("aten.threshold_backward.default",),
        "trace",
        "orttrainer",
        "ReLU's backward, for speed: PyTorch's decomposition is a Where, which ONNX Runtime's CPU kernel runs at a "
        "tenth of an elementwise op's speed; written as the gradient times its mask (the same values for finite "
        "gradients; switch: threshold_backward_as_product)",
        own.threshold_backward,
    ),
    Entry(
        ("aten._safe_softmax.default",),
        "trace",
        "orttrainer",
        "the attention's softmax, for speed: PyTorch's decomposition tests every score for -inf and selects with a "
        "Where over the scores; written as a row maximum, a Max and a product (the same values; switch: "
        "safe_softmax_as_product)",
        own.safe_softmax,
    ),
    Entry(
        ("aten.avg_pool2d_backward.default",),
        "trace",
        "orttrainer",
        "AvgPool1d/2d, LPPool1d/2d, LocalResponseNorm: no decomposition, no translation",
        own.avg_pool2d_backward,
    ),
    Entry(
        ("aten.avg_pool3d_backward.default",),
        "trace",
        "orttrainer",
        "AvgPool3d, LPPool3d, LocalResponseNorm on 4-d input: no decomposition, no translation",
        own.avg_pool3d_backward,
    ),
    Entry(
        ("aten.max_pool2d_with_indices_backward.default",),
        "trace",
        "torch._decomp",
        "MaxPool1d/2d's backward: PyTorch's decomposition, a scatter_add of each plane's gradient at the indices; "
        "torch.onnx's table has it too, but the direct translation traces without that table",
    ),
    Entry(
        ("aten.max_pool3d_with_indices_backward.default",),
        "trace",
        "orttrainer",
        "MaxPool3d: no decomposition (max_pool2d's is PyTorch's), no translation",
        own.max_pool3d_with_indices_backward,
    ),
    Entry(
        ("aten.avg_pool2d.default",),
        "trace",
        "orttrainer",
        "torchlib's AveragePool translation ignores divisor_override (a silently wrong loss): with one, the "
        "window sums divided by it; without, torchlib's translation (the decomposition declines)",
        own.avg_pool2d,
    ),
    Entry(
        ("aten.avg_pool3d.default",),
        "trace",
        "orttrainer",
        "as avg_pool2d: divisor_override",
        own.avg_pool3d,
    ),
    Entry(
        ("aten.adaptive_max_pool2d.default",),
        "trace",
        "orttrainer",
        "AdaptiveMaxPool1d/2d: no translation; PyTorch's decomposition covers only windows that divide the input "
        "evenly (NotImplemented otherwise); gathers and a max for every size",
        own.adaptive_max_pool2d,
    ),
    Entry(
        ("aten.adaptive_max_pool3d.default",),
        "trace",
        "orttrainer",
        "AdaptiveMaxPool3d: as adaptive_max_pool2d",
        own.adaptive_max_pool3d,
    ),
    Entry(
        ("aten.adaptive_max_pool2d_backward.default",),
        "trace",
        "orttrainer",
        "AdaptiveMaxPool1d/2d's backward: no decomposition, no translation; a scatter-add to the indices",
        own.adaptive_max_pool2d_backward,
    ),
    Entry(
        ("aten.adaptive_max_pool3d_backward.default",),
        "trace",
        "orttrainer",
        "AdaptiveMaxPool3d's backward: as adaptive_max_pool2d_backward",
        own.adaptive_max_pool3d_backward,
    ),
    Entry(
        ("aten.empty_permuted.default",),
        "trace",
        "orttrainer",
        "emitted by PyTorch's decompositions of empty_like (cosine and hinge embedding losses, addcdiv's "
        "backward, quantile); torchlib has no translation; an ONNX tensor has no memory layout",
        own.empty_permuted,
    ),
    Entry(
        ("aten.copy.default",),
        "trace",
        "orttrainer",
        "in-place writes (`t[..., 0] = 0`, `t.copy_(src)`) become aten.copy, whose torchlib translation does not "
        "broadcast src to the destination: transformers' T5 then failed in ONNX Runtime's shape inference",
        own.copy,
    ),
    Entry(
        ("aten.as_strided_scatter.default",),
        "trace",
        "orttrainer",
        "in-place writes through as_strided views (ConvNeXt-style model code) leave it in the functional graph; "
        "PyTorch's reference lowers to prims.as_strided_scatter, which has no translation",
        own.as_strided_scatter,
    ),
    Entry(
        ("aten.diagonal_scatter.default",),
        "trace",
        "orttrainer",
        "the backward of diagonal(); PyTorch's reference writes with copy_, which AOTAutograd refuses in a "
        "functional graph",
        own.diagonal_scatter,
    ),
    Entry(
        ("aten.amax.default",),
        "trace",
        "orttrainer",
        "torchlib's ReduceMax translation takes neither dim=[] (all dims) nor a 0-d input; declines otherwise",
        own.amax,
    ),
    Entry(("aten.amin.default",), "trace", "orttrainer", "as amax", own.amin),
    Entry(
        ("aten.logsumexp.default",),
        "trace",
        "orttrainer",
        "a 0-d input: torchlib's translation emits a ReduceMax that ONNX Runtime refuses for rank 0",
        own.logsumexp,
    ),
    Entry(
        ("prims.prod.default",),
        "trace",
        "orttrainer",
        "PyTorch's references of prod/cumprod (torch.onnx's table) lower to prims.prod, which has no translation",
        own.prims_prod,
    ),
    Entry(
        ("aten.prod.default", "aten.prod.dim_int"),
        "trace",
        "orttrainer",
        "a 0-d input: ONNX Runtime refuses torchlib's ReduceProd on rank 0; declines otherwise",
        own.prod,
    ),
    Entry(
        ("aten.value_selecting_reduction_backward.default",),
        "trace",
        "orttrainer",
        "the backward of kthvalue/median/mode on a 0-d input: a scatter with no axis; declines otherwise",
        own.selection_backward,
    ),
    Entry(
        ("aten.scatter_add.default",),
        "trace",
        "orttrainer",
        "on a 0-d tensor (selection backward ops of 0-d inputs): ScatterElements has no axis on rank 0; declines "
        "otherwise",
        own.scatter_add,
    ),
    Entry(("aten.scatter.src",), "trace", "orttrainer", "as scatter_add", own.scatter_src),
    Entry(("aten.scatter.value",), "trace", "orttrainer", "as scatter_add", own.scatter_value),
    Entry(
        ("aten.max.dim",),
        "trace",
        "orttrainer",
        "on bool (cumprod's backward): ONNX ArgMax takes no bool; declines otherwise",
        own.boolean_max,
    ),
    Entry(("aten.argmax.default",), "trace", "orttrainer", "as max.dim", own.boolean_argmax),
    Entry(
        ("prims.view_of.default", "aten.alias.default"),
        "trace",
        "orttrainer",
        "squeeze() of nothing and other no-op views end as these; neither has a translation",
        own.view_of,
    ),
    Entry(
        ("aten.kthvalue.default",),
        "trace",
        "orttrainer",
        "no translation; a sort (TopK) and a select",
        own.kthvalue,
    ),
    Entry(("aten.median.default",), "trace", "orttrainer", "no translation; a sort and a select", own.median),
    Entry(("aten.median.dim",), "trace", "orttrainer", "as median", own.median_dim),
    Entry(("aten.nanmedian.default",), "trace", "orttrainer", "as median, NaN excluded", own.nanmedian),
    Entry(("aten.nanmedian.dim",), "trace", "orttrainer", "as median, NaN excluded", own.nanmedian_dim),
    Entry(
        ("aten.cummax.default",),
        "trace",
        "orttrainer",
        "no translation or decomposition; a masked max over a triangle",
        own.cummax,
    ),
    Entry(("aten.cummin.default",), "trace", "orttrainer", "as cummax", own.cummin),
    Entry(
        ("aten.copysign.Tensor", "aten.copysign.Scalar"),
        "trace",
        "orttrainer",
        "PyTorch's reference lowers to prims.signbit (no translation); where(signbit(b), -|a|, |a|)",
        own.copysign,
    ),
    Entry(("aten.fmax.default",), "trace", "orttrainer", "reference lowers to prims.fmax (no translation)", own.fmax),
    Entry(("aten.fmin.default",), "trace", "orttrainer", "reference lowers to prims.fmin (no translation)", own.fmin),
    Entry(("aten.hypot.default",), "trace", "orttrainer", "reference: prims.hypot (no translation)", own.hypot),
    Entry(
        ("aten.index_reduce.default",),
        "trace",
        "orttrainer",
        "no translation; scatter_reduce with the index spread over the source",
        own.index_reduce,
    ),
    Entry(
        ("aten.put.default",),
        "trace",
        "orttrainer",
        "no translation (torch.put, and the backward of torch.take); a flat index_put",
        own.put,
    ),
    Entry(
        ("aten._efficientzerotensor.default",),
        "trace",
        "orttrainer",
        "autograd's zero gradient (sgn, ...) has no translation; zeros",
        own.zeros_like_size,
    ),
    Entry(
        ("aten.lgamma.default", "prims.lgamma.default"),
        "trace",
        "orttrainer",
        "no ONNX op (PyTorch's reference lowers to prims.lgamma); Stirling's series with recurrence and reflection",
        own.lgamma,
    ),
    Entry(
        ("aten.digamma.default", "prims.digamma.default"),
        "trace",
        "orttrainer",
        "lgamma's derivative; no ONNX op; asymptotic series with recurrence and reflection",
        own.digamma,
    ),
    Entry(
        ("aten.polygamma.default",),
        "trace",
        "orttrainer",
        "digamma's derivatives; no ONNX op; asymptotic series with recurrence",
        own.polygamma,
    ),
    Entry(("aten.special_polygamma.default",), "trace", "orttrainer", "as polygamma", own.special_polygamma),
    Entry(
        ("aten.erfinv.default", "prims.erf_inv.default"),
        "trace",
        "orttrainer",
        "no ONNX op; Giles' approximation refined by Newton steps on Erf",
        own.erfinv,
    ),
    Entry(("aten.special_ndtri.default", "prims.ndtri.default"), "trace", "orttrainer", "through erfinv", own.ndtri),
    Entry(
        ("aten.grid_sampler_2d.default",),
        "autograd",
        "torch._decomp",
        "F.grid_sample: grid_sampler_2d_backward has no translation; PyTorch's decomposition of the forward is "
        "differentiable",
    ),
    Entry(
        ("aten._adaptive_avg_pool2d.default",),
        "autograd",
        "torch._decomp",
        "AdaptiveAvgPool1d/2d, interpolate(mode='area'): _adaptive_avg_pool2d_backward has no translation",
    ),
    Entry(
        ("aten.replication_pad1d.default", "aten.replication_pad2d.default", "aten.replication_pad3d.default"),
        "autograd",
        "torch._decomp",
        "ReplicationPad*, F.pad(mode='replicate'): replication_pad*_backward has no translation",
    ),
    Entry(
        ("aten.upsample_linear1d.default", "aten.upsample_trilinear3d.default"),
        "autograd",
        "torch._decomp",
        "interpolate(mode='linear'/'trilinear') called with an output size: their backward ops have no "
        "translation (PyTorch already decomposes the other upsample overloads before autograd)",
    ),
    Entry(
        ("aten._weight_norm_interface.default",),
        "autograd",
        "torch._decomp",
        "torch.nn.utils.weight_norm / parametrizations.weight_norm (wav2vec2's positional convolution): "
        "_weight_norm_interface_backward has no translation",
    ),
    Entry(
        ("aten._adaptive_avg_pool3d.default",),
        "autograd",
        "orttrainer",
        "AdaptiveAvgPool3d: neither the forward nor its backward op has a translation or a decomposition",
        own.adaptive_avg_pool3d,
    ),
    Entry(
        ("aten._trilinear.default",),
        "autograd",
        "orttrainer",
        "nn.Bilinear: no translation, no decomposition; an einsum, whose derivative is einsums",
        own.trilinear,
    ),
    *(
        Entry(
            (f"aten.{name}.input",),
            "autograd",
            "orttrainer",
            "nn.LSTM, nn.GRU: PyTorch's decomposition (its own kernel at this stage) loops over the time steps, so "
            "the trace grew with the sequence (9,000 nodes for the benchmark LSTM), and it never applies the dropout "
            "between layers; layer by layer with that dropout, each layer's recurrence one op that the direct ONNX "
            "translation unrolls (gradient/recurrent_layers.py; switch: recurrences_as_one_op)",
            decomposition,
        )
        for name, decomposition in (
            ("lstm", recurrent_layers.lstm),
            ("gru", recurrent_layers.single_state_rnn(aten.gru.input)),
        )
    ),
    *(
        Entry(
            (f"aten.{name}.input",),
            "autograd",
            "orttrainer",
            "nn.RNN: PyTorch's decomposition (its own kernel at this stage) never applies the dropout between layers; "
            "its layers one by one with that dropout (gradient/recurrent_layers.py)",
            recurrent_layers.single_state_rnn(getattr(aten, name).input),
        )
        for name in ("rnn_tanh", "rnn_relu")
    ),
    Entry(
        ("aten._ctc_loss.Tensor", "aten._ctc_loss.default"),
        "autograd",
        "orttrainer",
        "nn.CTCLoss, F.ctc_loss: the shape of _ctc_loss's second output depends on the target lengths' values, "
        "which no fake tensor has (DynamicOutputShapeException), and _ctc_loss_backward has no translation; the "
        "forward recursion in the batch's padded shapes is differentiable",
        own.ctc_loss,
    ),
    Entry(
        ("aten.ctc_loss.IntList",),
        "autograd",
        "orttrainer",
        "F.ctc_loss with lengths as Python ints: PyTorch's composite fills a tensor with them, which a fake tensor "
        "cannot hold; the same call with the lengths as tensors",
        own.ctc_loss_int_lengths,
    ),
    Entry(
        ("aten.masked_select.default",),
        "trace",
        "orttrainer",
        "torch.onnx has no translation (its graph ran the op eagerly, which needs a static output shape); "
        "boolean indexing with the broadcast mask, which torch.onnx writes as NonZero and GatherND",
        own.masked_select,
    ),
    Entry(
        ("aten._embedding_bag.default", "aten._embedding_bag_forward_only.default"),
        "autograd",
        "orttrainer",
        "nn.EmbeddingBag: the forward and _embedding_bag_backward / _embedding_bag_per_sample_weights_backward "
        "have no translation",
        own.embedding_bag,
    ),
)


def _op(name: str) -> torch._ops.OpOverload:
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def core_aten_decompositions() -> dict:
    """The decomposition table that lowers composite aten ops (and their backward ops) to the core aten set,
    which the ONNX translation table covers."""
    from torch._decomp import core_aten_decompositions as table

    return table()


def training_decompositions() -> dict:
    """`core_aten_decompositions()` plus the batch-norm entry of `TABLE`."""
    from torch._decomp import get_decompositions

    table = core_aten_decompositions()
    table.update(get_decompositions([_op(name) for name in TABLE[1].ops]))
    return table


def trace_decompositions(float16: bool = False, for_torch_onnx: bool = True) -> dict:
    """The "trace" stage of `TABLE`: what AOTAutograd traces with (`float16`: the module computes in float16).
    Without `for_torch_onnx`, the entry for torch.onnx's missing translations is left out: building it needs
    torch.onnx's translation table (~2.5 s), which the direct translation (gradient/aten_onnx.py) does without."""
    from torch._decomp import get_decompositions

    table = training_decompositions()
    tracer_ops = {aten.lift.default, aten.lift_fresh.default, aten.lift.out}
    for entry in TABLE:
        if entry.stage != "trace" or (entry.float16 and not float16) or entry.ops in ((CORE_ATEN,), TABLE[1].ops):
            continue
        if entry.ops == (ONNX_TABLE,):
            if not for_torch_onnx:
                continue
            for op, decomposition in onnx_decompositions().items():
                if op in table or op in tracer_ops:
                    continue
                table[op] = decomposition  # not setdefault: CustomDecompTable ignores it (torch 2.13)
        elif entry.source == "orttrainer":
            for name in entry.ops:
                table[_op(name)] = entry.decomposition
        else:
            table.update(get_decompositions([_op(name) for name in entry.ops]))
    return table


def forward_decompositions(float16: bool = False, for_torch_onnx: bool = False) -> dict:
    """What a forward traced without a backward is traced with (an eval graph, `tracing.aot_export_forward`):
    `trace_decompositions(float16, for_torch_onnx)` less BatchNorm on its running statistics
    (`_native_batch_norm_legit_no_training`), which the direct translation writes as ONNX BatchNormalization in
    inference mode, as torch.onnx does; ONNX Runtime folds that into the Conv before it, where the lowered form
    (a reshape, subtraction, square root, reciprocal and two products per BatchNorm) stays elementwise ops.
    TABLE's reason for lowering it, onnxscript's translation in training mode, concerns neither this op nor the
    direct translation."""
    table = trace_decompositions(float16, for_torch_onnx)
    table.pop(aten._native_batch_norm_legit_no_training.default, None)
    return table


def pytorch_decomposition(op: torch._ops.OpOverload) -> Callable:
    """PyTorch's own decomposition of `op` (`torch._decomp`), for an own entry that declines."""
    from torch._decomp import decomposition_table

    return decomposition_table[op]


def autograd_table() -> dict:
    """The "autograd" stage of `TABLE`: op -> the function autograd differentiates instead of the op."""
    from torch._decomp import decomposition_table

    table: dict = {}
    for entry in TABLE:
        if entry.stage != "autograd":
            continue
        for name in entry.ops:
            op = _op(name)
            table[op] = entry.decomposition if entry.source == "orttrainer" else decomposition_table[op]
    return table


_autograd_lock = threading.RLock()
_autograd_depth = 0


@contextlib.contextmanager
def autograd_decompositions() -> Iterator[None]:
    """Within the block, the ops of `autograd_table()` run as their decompositions below autograd's view: each
    is a Python kernel for the op's Autograd dispatch key, which PyTorch's tracers call (they run with the Python
    dispatcher on); eager code, which does not, is unaffected. Restored on exit; nested blocks share one
    registration. Where PyTorch registered such a kernel itself, an own entry replaces it (and restores it) and a
    PyTorch entry leaves it alone."""
    global _autograd_depth
    from torch._C import DispatchKey

    own_ops = {
        _op(n) for entry in TABLE if entry.stage == "autograd" and entry.source == "orttrainer" for n in entry.ops
    }
    with _autograd_lock:
        replaced: dict = {}  # (op, key) -> the kernel it had (None: none)
        if _autograd_depth == 0:
            for op, decomposition in autograd_table().items():
                if DispatchKey.Autograd in op.py_kernels and op not in own_ops:
                    continue
                keys = [DispatchKey.Autograd]
                composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
                if op in own_ops and (composite or DispatchKey.CompositeImplicitAutograd in op.py_kernels):
                    # the Python dispatcher resolves an autograd key to this kernel before the Autograd one
                    keys.append(DispatchKey.CompositeImplicitAutograd)
                for key in keys:
                    replaced[op, key] = op.py_kernels.get(key)
                    op.py_kernels[key] = decomposition
                op._dispatch_cache.clear()
        _autograd_depth += 1
        try:
            yield
        finally:
            _autograd_depth -= 1
            for (op, key), kernel in replaced.items():
                if kernel is None:
                    op.py_kernels.pop(key, None)
                else:
                    op.py_kernels[key] = kernel
                op._dispatch_cache.clear()
