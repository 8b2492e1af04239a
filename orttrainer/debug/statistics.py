"""Tensor statistics: computation, the legacy six-line text format, and its parser.

This module is the shared core of both collection paths: the PyTorch hooks (``StatisticsSubscriber``) compute a
:class:`TensorStatistics` with :func:`compute_statistics`; the in-graph (ONNX Runtime) path computes the same
reductions inside the graph and builds one with :func:`statistics_from_reductions`. Both are turned into text by
:func:`format_statistics`, so the files of the two paths are comparable line by line.

Rules (legacy ORT ``_summarize_tensor`` format, ``docs/debugging.md`` §2.4; decisions marked *):

* ``size`` is the flattened element count; ``shape``/``size`` print as ``torch.Size([...])``.
* min/max are element values (NaN propagates), printed as Python reprs of the value widened to a Python scalar
  (``-0.6517250537872314``, ints as ints, *bool tensors as ``False``/``True``).
* mean is ``float(sum) / size`` with the sum accumulated in float32 for 16/32-bit floats (as the legacy code did
  for float32; *float32 instead of the tensor's dtype for float16/bfloat16, so a float16 sum cannot overflow),
  float64 for float64 and int64 for integer and bool tensors; printed as a Python float.
* *std is the true unbiased standard deviation (correction 1, as ``torch.std``), combined across buckets with the
  exact parallel formula (sum of within-bucket squared deviations plus ``n_b * (mean_b - mean)**2``). The legacy
  default path put each bucket's *sum* where its mean belongs, which inflated std (an all-ones tensor reported
  3.46 instead of 0), so this field differs from legacy dumps on purpose; legacy ``run_on_cpu=True`` dumps agree.
  std is ``nan`` for fewer than two elements, and is rounded to float32 for 16/32-bit float inputs (matching
  ``torch.std`` of a float32 tensor) and kept as float64 otherwise.
* nan/inf counts use ``isnan``/``isinf``; neg/pos/zero count ``< 0``, ``> 0``, ``== 0`` (NaN is in none of them).
* samples: ``repr`` of the first 128 flattened elements under ``precision=6, linewidth=128`` (other print options
  at torch's defaults). *The samples are always a CPU copy, so GPU dumps print no ``device=`` suffix and compare
  equal to CPU dumps; *print options are restored afterwards (the legacy code changed them globally).
* *Empty tensors give min/max/mean/std ``nan`` and zero counts (legacy raised inside the forward pass); complex
  tensors are summarised over their real and imaginary parts (``torch.view_as_real``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..dtypes import ELEMENT_TYPES

NUM_SAMPLES = 128
DEFAULT_BUCKET_SIZE = 1024 * 1024 * 1024 // 2  # the legacy default: one bucket for any realistic activation
DIRECTIONS = ("forward", "backward")

# ONNX element type -> torch dtype, so the in-graph path can hand over the graph's dtype as is. The element-type
# table minus its complex types: this mapping never accepted them (to_torch_dtype raises for them, as before).
_ONNX_DTYPES = {t.onnx: t.torch for t in ELEMENT_TYPES if not t.torch.is_complex}


@dataclasses.dataclass(frozen=True)
class TensorStatistics:
    """Everything one statistics file shows. ``samples`` is a 1-D CPU tensor of at most 128 elements."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    size: int
    min: float | int | bool
    max: float | int | bool
    mean: float
    std: float
    nan: int
    inf: int
    neg: int
    pos: int
    zero: int
    samples: torch.Tensor

    def as_dict(self) -> dict[str, Any]:
        """Plain Python values (samples as a list), e.g. for JSON or for comparing two runs in a test."""
        values = dataclasses.asdict(self)
        values["dtype"] = str(self.dtype)
        values["samples"] = self.samples.tolist()
        return values


def compute_statistics(
    tensor: torch.Tensor, *, bucket_size: int | None = None, run_on_cpu: bool = False
) -> TensorStatistics:
    """Statistics of ``tensor`` (any shape, dtype and device), computed bucket by bucket.

    ``bucket_size`` bounds the elements reduced at once (peak extra memory), ``None`` means the legacy default.
    With ``run_on_cpu`` the tensor is copied to CPU first; otherwise only scalars leave the device (two
    synchronisations per bucket). The result does not depend on ``bucket_size`` beyond float rounding.
    """
    bucket_size = DEFAULT_BUCKET_SIZE if bucket_size is None else int(bucket_size)
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive int, got {bucket_size}")
    flat = tensor.detach().reshape(-1)
    if run_on_cpu:
        flat = flat.cpu()
    samples = flat[:NUM_SAMPLES].to("cpu", copy=True)
    values = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
    buckets = [_bucket_moments(values[i : i + bucket_size]) for i in range(0, values.numel(), bucket_size)]
    return _combine(tuple(tensor.shape), tensor.dtype, flat.numel(), buckets, samples)


def statistics_from_reductions(
    *,
    shape: Sequence[int],
    dtype: Any,
    min: Any,
    max: Any,
    mean: Any,
    std: Any,
    nan: Any,
    inf: Any,
    neg: Any,
    pos: Any,
    zero: Any,
    samples: Any,
) -> TensorStatistics:
    """Build :class:`TensorStatistics` from reductions computed elsewhere (e.g. inside an ONNX graph).

    Scalars may be Python numbers, numpy scalars/0-d arrays or 0-d tensors; ``samples`` a numpy array, tensor or
    list holding the first elements of the flattened tensor (extra elements are cut at 128). ``dtype`` may be a
    ``torch.dtype``, a numpy dtype, a name (``"float32"``, ``"torch.float32"``) or an ONNX element type int.
    ``std`` must be the unbiased std (``nan`` below two elements); pass ``None`` for min/max/mean/std of an empty
    tensor. Values are normalised exactly as :func:`compute_statistics` does, so the text is identical.
    """
    dtype = to_torch_dtype(dtype)
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if isinstance(samples, torch.Tensor):
        sample_tensor = samples.detach().to("cpu", copy=True)
    else:
        sample_tensor = torch.as_tensor(np.asarray(samples))
    sample_tensor = sample_tensor.reshape(-1)[:NUM_SAMPLES].to(dtype)
    return TensorStatistics(
        shape=shape,
        dtype=dtype,
        size=size,
        min=_element_scalar(min, dtype),
        max=_element_scalar(max, dtype),
        mean=_float_or_nan(mean),
        std=_round_std(_float_or_nan(std), dtype),
        nan=_count(nan),
        inf=_count(inf),
        neg=_count(neg),
        pos=_count(pos),
        zero=_count(zero),
        samples=sample_tensor,
    )


def format_statistics(name: str, direction: str, stats: TensorStatistics, depth: int = -1) -> str:
    """The exact six-line text of one statistics file (``\\n`` endings, lines 1-2 end with a space).

    ``depth`` is the module depth (root 1); it prints as that many ``>``, none for ``depth <= 0``
    (``inspect_activation`` uses -1).
    """
    _check_direction(direction)
    return (
        f"{'>' * max(0, depth)}{name} {direction} run shape: {torch.Size(stats.shape)} dtype: {stats.dtype} "
        f"size: {torch.Size([stats.size])} \n"
        f"min: {stats.min} max: {stats.max}, mean: {stats.mean}, std: {stats.std} \n"
        f"nan: {stats.nan}, inf: {stats.inf}\n"
        f"samples(top {NUM_SAMPLES}): {format_samples(stats.samples)}\n"
        f"neg: {stats.neg}, pos: {stats.pos}, zero: {stats.zero},\n"
        f"{'=' * 16}\n"
    )


def format_samples(samples: torch.Tensor) -> str:
    """``repr`` of the samples under the fixed print options of the format; the caller's options are kept."""
    with _print_options(precision=6, threshold=1000, edgeitems=3, linewidth=128, sci_mode=None):
        return repr(samples.detach().cpu())


def to_torch_dtype(dtype: Any) -> torch.dtype:
    """``torch.dtype`` for a torch/numpy dtype, a dtype name or an ONNX element type int."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype not in _ONNX_DTYPES:
            raise ValueError(f"unsupported ONNX element type {dtype}")
        return _ONNX_DTYPES[dtype]
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, str) else np.dtype(dtype).name
    result = getattr(torch, name, None)
    if not isinstance(result, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return result


# ---------------------------------------------------------------------------------------------------- computation


@dataclasses.dataclass
class _Moments:
    count: int
    counts: tuple[int, int, int, int, int]  # nan, inf, neg, pos, zero
    total: float | int  # sum, in the accumulation dtype then widened
    m2: float  # sum of squared deviations from this bucket's own mean
    min: float | int
    max: float | int


def _bucket_moments(bucket: torch.Tensor) -> _Moments:
    n = bucket.numel()
    counts = torch.stack(
        [
            torch.isnan(bucket).sum(),
            torch.isinf(bucket).sum(),
            (bucket < 0).sum(),
            (bucket > 0).sum(),
            (bucket == 0).sum(),
        ]
    ).tolist()
    if bucket.is_floating_point():
        work = bucket if bucket.dtype in (torch.float32, torch.float64) else bucket.float()
        # var(correction=0) * n is the bucket's own sum of squared deviations, computed by torch's stable kernel.
        total, var0, lo, hi = (
            torch.stack([work.sum(), work.var(correction=0), work.min(), work.max()]).double().tolist()
        )
    else:
        ints = bucket.long()
        total, lo, hi = torch.stack([ints.sum(), ints.min(), ints.max()]).tolist()
        var0 = bucket.double().var(correction=0).item()
    return _Moments(n, tuple(counts), total, var0 * n, lo, hi)


def _combine(
    shape: tuple[int, ...], dtype: torch.dtype, size: int, buckets: list[_Moments], samples: torch.Tensor
) -> TensorStatistics:
    counts = [sum(b.counts[i] for b in buckets) for i in range(5)]
    nan = float("nan")
    if not buckets:  # empty tensor
        lo = hi = mean = std = nan
    else:
        n = sum(b.count for b in buckets)
        total = sum(b.total for b in buckets)
        mean = float(total) / float(n)
        lo, hi = _nan_min([b.min for b in buckets]), _nan_max([b.max for b in buckets])
        # Exact parallel combination: within-bucket deviations plus each bucket mean's deviation from the mean.
        m2 = sum(b.m2 + b.count * (float(b.total) / b.count - mean) ** 2 for b in buckets)
        std = math.sqrt(m2 / (n - 1)) if n > 1 else nan
    return TensorStatistics(
        shape=shape,
        dtype=dtype,
        size=size,
        min=_element_scalar(lo, dtype),
        max=_element_scalar(hi, dtype),
        mean=mean,
        std=_round_std(std, dtype),
        nan=counts[0],
        inf=counts[1],
        neg=counts[2],
        pos=counts[3],
        zero=counts[4],
        samples=samples,
    )


def _nan_min(values: list) -> float | int:
    return float("nan") if any(v != v for v in values) else min(values)


def _nan_max(values: list) -> float | int:
    return float("nan") if any(v != v for v in values) else max(values)


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _element_scalar(value: Any, dtype: torch.dtype) -> float | int | bool:
    value = _scalar(value)
    if value is None:
        return float("nan")
    if dtype == torch.bool:
        return bool(value) if value == value else value
    if dtype.is_floating_point or dtype.is_complex or value != value:
        return float(value)
    return int(value)


def _float_or_nan(value: Any) -> float:
    value = _scalar(value)
    return float("nan") if value is None else float(value)


def _count(value: Any) -> int:
    return int(_scalar(value))


def _round_std(std: float, dtype: torch.dtype) -> float:
    # A float32 tensor's std prints like torch.std's float32 result; wider dtypes keep float64.
    real = dtype.to_real() if dtype.is_complex else dtype
    return float(np.float32(std)) if real.is_floating_point and real.itemsize <= 4 else std


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")


@contextlib.contextmanager
def _print_options(**options: Any) -> Iterator[None]:
    current = torch._tensor_str.PRINT_OPTS  # no public getter exists in torch
    saved = {key: getattr(current, key) for key in options}
    torch.set_printoptions(**options)
    try:
        yield
    finally:
        torch.set_printoptions(**saved)


# --------------------------------------------------------------------------------------------------------- parsing

_HEADER = re.compile(
    r"^(?P<depth>>*)(?P<name>.*) (?P<direction>forward|backward) run shape: torch\.Size\("
    r"(?P<shape>\[[^\]]*\])\) dtype: (?P<dtype>\S+) size: torch\.Size\(\[(?P<size>\d+)\]\) $"
)
_VALUES = re.compile(r"^min: (?P<min>\S+) max: (?P<max>\S+), mean: (?P<mean>\S+), std: (?P<std>\S+) $")
_NANINF = re.compile(r"^nan: (?P<nan>\d+), inf: (?P<inf>\d+)$")
_SIGNS = re.compile(r"^neg: (?P<neg>\d+), pos: (?P<pos>\d+), zero: (?P<zero>\d+),$")


def parse_statistics(text: str) -> dict[str, Any]:
    """Parse one statistics file (the inverse of :func:`format_statistics`, samples kept as raw text).

    Returns name, direction, depth, shape (list), dtype (str), size, min, max, mean, std (floats; bools as 0/1),
    nan, inf, neg, pos, zero (ints) and samples (str). Raises ``ValueError`` naming the line that does not match.
    """
    lines = text.rstrip("\n").split("\n")
    if len(lines) < 6 or lines[-1] != "=" * 16:
        raise ValueError(f"not a statistics file (expected six lines ending in {'=' * 16!r}): {text[:80]!r}")
    parsed: dict[str, Any] = {}
    for pattern, line in ((_HEADER, lines[0]), (_VALUES, lines[1]), (_NANINF, lines[2]), (_SIGNS, lines[-2])):
        match = pattern.match(line)
        if match is None:
            raise ValueError(f"unexpected statistics line: {line!r}")
        parsed.update(match.groupdict())
    result: dict[str, Any] = {
        "name": parsed["name"],
        "direction": parsed["direction"],
        "depth": len(parsed["depth"]) or -1,
        "dtype": parsed["dtype"],
        "shape": [int(d) for d in re.findall(r"\d+", parsed["shape"])],
        "samples": "\n".join(lines[3:-2]).removeprefix(f"samples(top {NUM_SAMPLES}): "),
    }
    for key in ("size", "nan", "inf", "neg", "pos", "zero"):
        result[key] = int(parsed[key])
    for key in ("min", "max", "mean", "std"):
        result[key] = _parse_number(parsed[key])
    return result


def _parse_number(text: str) -> float:
    if text in ("True", "False"):
        return float(text == "True")
    return float(text)
