"""Statistics: the legacy six-line format (docs/debugging.md §2.4, §4.3), the corrected std, bucketing,
dtypes the legacy code crashed on, the in-graph hand-over (statistics_from_reductions) and the writer."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from orttrainer.debug import (
    compute_statistics,
    format_statistics,
    parse_statistics,
    statistics_from_reductions,
    write_statistics,
)
from orttrainer.debug.statistics import to_torch_dtype

# §4.3, verbatim: pt_out/step_1/Linear_4_0th_output_forward written by onnxruntime-training 1.19.2.
SAMPLE_43 = (
    ">>>Linear_4_0th_output forward run shape: torch.Size([2, 4]) dtype: torch.float32 size: torch.Size([8]) \n"
    "min: -0.6517250537872314 max: 0.5456756353378296, mean: 0.022884562611579895, std: 0.41052210330963135 \n"
    "nan: 0, inf: 0\n"
    "samples(top 128): tensor([ 0.084963,  0.545676, -0.051005, -0.651725, -0.066703,  0.425806,  0.114026, "
    "-0.217961])\n"
    "neg: 4, pos: 4, zero: 0,\n"
    "================\n"
)
LEGACY_STD = "0.41052210330963135"  # the bucketed path's std: each bucket's sum used where its mean belongs (§2.5)
TRUE_STD = "0.3730965554714203"  # the true unbiased std of those 8 values (legacy run_on_cpu path), float32
# The eight values: min and max are exact in the file; the others are known to the printed 6 decimals.
SAMPLE_VALUES = [0.084963, 0.5456756353378296, -0.051005, -0.6517250537872314, -0.066703, 0.425806, 0.114026, -0.217961]


def _lines(text):
    return text.split("\n")


def test_format_reproduces_the_legacy_sample_field_by_field():
    stats = statistics_from_reductions(
        shape=(2, 4),
        dtype=torch.float32,
        min=-0.6517250537872314,
        max=0.5456756353378296,
        mean=0.022884562611579895,
        std=float(TRUE_STD),
        nan=0,
        inf=0,
        neg=4,
        pos=4,
        zero=0,
        samples=np.array(SAMPLE_VALUES, dtype=np.float32),
    )
    text = format_statistics("Linear_4_0th_output", "forward", stats, depth=3)
    # Every byte equal to ORT's file except the std value, which is the true std instead of the inflated one.
    assert text == SAMPLE_43.replace(f"std: {LEGACY_STD} ", f"std: {TRUE_STD} ")
    got, want = _lines(text), _lines(SAMPLE_43)
    assert len(got) == len(want) == 7 and got[-1] == "" and got[-2] == "=" * 16
    assert got[0] == want[0] and got[0].endswith(" ")  # lines 1-2 end with a space
    assert got[1].startswith("min: -0.6517250537872314 max: 0.5456756353378296, mean: 0.022884562611579895, std: ")
    assert got[1].endswith(" ") and got[2:] == want[2:]


def test_computed_statistics_of_the_sample_values():
    tensor = torch.tensor(SAMPLE_VALUES, dtype=torch.float32).reshape(2, 4)
    stats = compute_statistics(tensor)
    assert (stats.shape, stats.dtype, stats.size) == ((2, 4), torch.float32, 8)
    assert stats.min == -0.6517250537872314 and stats.max == 0.5456756353378296  # exact element values
    assert stats.mean == pytest.approx(0.022884562611579895, abs=1e-7)  # the 6 middle values are rounded
    assert (stats.nan, stats.inf, stats.neg, stats.pos, stats.zero) == (0, 0, 4, 4, 0)
    text = format_statistics("Linear_4_0th_output", "forward", stats, depth=3)
    assert _lines(text)[3] == _lines(SAMPLE_43)[3]
    # std: the true unbiased std, float32 like torch.std; the legacy formula is reproduced to show what it did.
    true_std = tensor.double().std().item()
    assert stats.std == float(np.float32(true_std)) == pytest.approx(float(TRUE_STD), abs=1e-6)
    legacy = math.sqrt(true_std**2 + 8 * 7 * stats.mean**2)  # one bucket: sqrt(std² + n(n-1)·mean²)
    assert legacy == pytest.approx(float(LEGACY_STD), abs=1e-6)


@pytest.mark.parametrize(
    ("values", "legacy"), [([1.0, 1.0, 1.0, 1.0], 3.464101552963257), (list(range(10)), 42.7979736328125)]
)
def test_std_is_the_true_std_not_the_legacy_one(values, legacy):
    tensor = torch.tensor(values, dtype=torch.float32)
    stats = compute_statistics(tensor)
    assert stats.std == pytest.approx(tensor.double().std().item(), rel=1e-6)
    assert stats.std != pytest.approx(legacy, rel=1e-3)


@pytest.mark.parametrize("bucket_size", [1, 3, 7, 64, 1000, 4096])
def test_bucketing_changes_nothing_but_rounding(bucket_size):
    torch.manual_seed(0)
    tensor = torch.randn(1000) * 3 + 5
    tensor[17] = 0.0
    reference = compute_statistics(tensor)
    stats = compute_statistics(tensor, bucket_size=bucket_size)
    assert (stats.min, stats.max, stats.nan, stats.inf, stats.neg, stats.pos, stats.zero) == (
        reference.min,
        reference.max,
        reference.nan,
        reference.inf,
        reference.neg,
        reference.pos,
        reference.zero,
    )
    assert stats.mean == pytest.approx(tensor.double().mean().item(), rel=1e-6)
    assert stats.std == pytest.approx(tensor.double().std().item(), rel=1e-6)  # no NaN for 1-element buckets
    assert torch.equal(stats.samples, tensor[:128])


def test_run_on_cpu_gives_the_same_statistics():
    tensor = torch.randn(3, 50)
    assert compute_statistics(tensor, run_on_cpu=True).as_dict() == compute_statistics(tensor).as_dict()


def test_bool_tensor():
    stats = compute_statistics(torch.tensor([[True, False], [True, True]]))
    assert (stats.min, stats.max, stats.mean) == (False, True, 0.75)
    assert stats.std == pytest.approx(0.5)
    assert (stats.neg, stats.pos, stats.zero, stats.nan, stats.inf) == (0, 3, 1, 0, 0)
    lines = _lines(format_statistics("mask", "forward", stats))
    assert lines[0] == "mask forward run shape: torch.Size([2, 2]) dtype: torch.bool size: torch.Size([4]) "
    assert lines[1] == "min: False max: True, mean: 0.75, std: 0.5 "
    assert lines[3] == "samples(top 128): tensor([ True, False,  True,  True])"


@pytest.mark.parametrize(
    ("shape", "dtype", "sample_repr"),
    [((0,), torch.float32, "tensor([])"), ((3, 0), torch.int64, "tensor([], dtype=torch.int64)")],
)
def test_empty_tensor(shape, dtype, sample_repr):
    text = format_statistics("empty", "backward", compute_statistics(torch.empty(shape, dtype=dtype)), depth=2)
    assert text == (
        f">>empty backward run shape: {torch.Size(shape)} dtype: {dtype} size: torch.Size([0]) \n"
        "min: nan max: nan, mean: nan, std: nan \n"
        "nan: 0, inf: 0\n"
        f"samples(top 128): {sample_repr}\n"
        "neg: 0, pos: 0, zero: 0,\n"
        "================\n"
    )


def test_scalar_integer_and_half_tensors():
    scalar = compute_statistics(torch.tensor(3.0))
    assert (scalar.shape, scalar.size) == ((), 1) and math.isnan(scalar.std)  # unbiased std of one value
    assert _lines(format_statistics("s", "forward", scalar))[0].endswith(
        "shape: torch.Size([]) dtype: torch.float32 size: torch.Size([1]) "
    )
    ints = compute_statistics(torch.tensor([1, 2, 3, 3]))
    assert (ints.min, ints.max, ints.mean) == (1, 3, 2.25) and type(ints.min) is int
    assert ints.std == pytest.approx(math.sqrt(0.9166666666666666))
    half = compute_statistics(torch.tensor([0.1, 0.2, 65504.0], dtype=torch.float16))  # legacy: std inf (overflow)
    assert half.max == 65504.0 and math.isfinite(half.mean) and math.isfinite(half.std)
    assert half.std == pytest.approx(torch.tensor([0.1, 0.2, 65504.0], dtype=torch.float64).std().item(), rel=1e-3)


def test_nan_and_inf_counts_and_signs():
    stats = compute_statistics(torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -2.0, 1.0]))
    assert (stats.nan, stats.inf, stats.neg, stats.pos, stats.zero) == (1, 2, 2, 2, 1)  # NaN is in no sign count
    assert math.isnan(stats.min) and math.isnan(stats.max) and math.isnan(stats.mean)
    assert _lines(format_statistics("n", "forward", stats))[1] == "min: nan max: nan, mean: nan, std: nan "


def test_samples_are_128_elements_wrapped_at_128_columns_and_print_options_are_restored():
    torch.set_printoptions(precision=2, linewidth=40)
    try:
        text = format_statistics("big", "forward", compute_statistics(torch.arange(1000, dtype=torch.float32) / 7))
        assert repr(torch.tensor([1.23456])) == "tensor([1.23])"  # the caller's options are untouched
    finally:
        torch.set_printoptions(profile="default")
    sample_lines = text.split("\n")[3:-3]
    assert sample_lines[0].startswith("samples(top 128): tensor([ 0.000000,  0.142857,")
    assert all(len(line) <= 128 for line in sample_lines[1:])
    assert all(line.startswith(" " * 8) for line in sample_lines[1:])
    assert sample_lines[-1].endswith("18.142857])")  # element 127 = 127/7


def test_statistics_from_reductions_matches_compute_statistics():
    torch.manual_seed(1)
    tensor = torch.randn(4, 40)
    flat = tensor.reshape(-1).numpy()
    from_graph = statistics_from_reductions(
        shape=np.array([4, 40], dtype=np.int64),
        dtype=1,  # ONNX TensorProto.FLOAT, as the graph reports it
        min=np.float32(flat.min()),
        max=torch.tensor(flat.max()),
        mean=float(tensor.sum()) / 160,
        std=np.float64(tensor.double().std().item()),
        nan=np.int64(0),
        inf=0,
        neg=int((flat < 0).sum()),
        pos=int((flat > 0).sum()),
        zero=0,
        samples=flat[:200],
    )
    computed = compute_statistics(tensor)
    assert from_graph.samples.shape == (128,)
    assert format_statistics("a", "forward", from_graph, 2) == format_statistics("a", "forward", computed, 2)


def test_to_torch_dtype():
    assert to_torch_dtype("float16") is torch.float16 and to_torch_dtype("torch.bool") is torch.bool
    assert to_torch_dtype(np.dtype("int64")) is torch.int64 and to_torch_dtype(16) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        to_torch_dtype("float128x")
    assert to_torch_dtype(1) is torch.float32 and to_torch_dtype(2) is torch.uint8  # ONNX element types
    with pytest.raises(ValueError, match="unsupported ONNX element type 14"):  # complex64: never accepted here
        to_torch_dtype(14)


def test_debug_imports_without_onnxruntime():
    # sys.modules[name] = None makes any `import onnxruntime` raise ImportError in that process.
    code = "import sys\nsys.modules['onnxruntime'] = None\nimport orttrainer.debug, orttrainer.debug.statistics\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_parse_statistics_round_trip():
    stats = compute_statistics(torch.arange(300, dtype=torch.float32).reshape(3, 100) - 100)
    parsed = parse_statistics(format_statistics("Block_3_0th_output", "backward", stats, depth=2))
    assert parsed["name"] == "Block_3_0th_output" and parsed["direction"] == "backward" and parsed["depth"] == 2
    assert parsed["shape"] == [3, 100] and parsed["dtype"] == "torch.float32" and parsed["size"] == 300
    assert (parsed["min"], parsed["max"], parsed["mean"], parsed["std"]) == (
        stats.min,
        stats.max,
        stats.mean,
        stats.std,
    )
    assert (parsed["neg"], parsed["pos"], parsed["zero"]) == (100, 199, 1)
    assert parsed["samples"].startswith("tensor([-100.,  -99.,") and "\n" in parsed["samples"]  # wrapped
    with pytest.raises(ValueError, match="unexpected statistics line"):
        parse_statistics(SAMPLE_43.replace("nan: 0", "nan 0"))


def test_write_statistics_layout(tmp_path):
    stats = compute_statistics(torch.ones(2))
    first = write_statistics(tmp_path / "out", 3, "act", "forward", stats, depth=1)
    second = write_statistics(tmp_path / "out", 3, "act", "backward", stats)
    assert first == tmp_path / "out" / "step_3" / "act_forward" and second.name == "act_backward"
    assert first.read_text(encoding="utf-8") == format_statistics("act", "forward", stats, 1)
    assert second.read_text(encoding="utf-8").startswith("act backward run shape")
    assert (tmp_path / "out" / "step_3" / "order.txt").read_text(encoding="utf-8") == "act_forward\nact_backward\n"
    with pytest.raises(ValueError, match="direction must be"):
        write_statistics(tmp_path / "out", 3, "act", "sideways", stats)
