"""Every OpInfo of PyTorch's `op_db` in its integer and bool dtypes (int64, int32, bool, and uint8 where the runtime
has uint8 kernels: `DTYPES`): its first samples traced with the torch builder's decompositions, translated by the
direct translation (gradient/aten_onnx.py) and run in ONNX Runtime, against the traced graph run by PyTorch. The
float32 gradients are covered by tests/test_torch_builder_op_db.py; this covers what a training graph computes in
integers and bools (masks, positions, counts), which no gradient check sees: `&` of int32 masks read as logic, and
`torch.where` of two masks failing to open, were found so (docs/engine.md §43). A sample the translation declines
(`UntranslatableGraph`: the builder then exports through torch.onnx) passes; a wrong value, dtype or shape, or a
graph ONNX Runtime refuses, fails. The default lanes run one entry in four (`torch_coverage.sampled`); `make
coverage` runs them all."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils import _pytree as pytree
from torch_coverage import op_name, sampled

from orttrainer.trainer.gradient import torch_private
from orttrainer.trainer.gradient.aten_onnx import UntranslatableGraph, translate

# onnxruntime-training 1.19 has no uint8 kernels for Add, Sub, Mul, Equal, Less, Greater, TopK and more (1.32 has):
# there a uint8 graph fails to open, and uint8 is checked on the maintained runtime only
DTYPES = (torch.int64, torch.int32, torch.bool) + (() if ort.__version__.startswith("1.19") else (torch.uint8,))
SAMPLES = 2  # per dtype
OPS = {op_name(op): op for op in op_db if any(d in op.supported_dtypes("cpu") for d in DTYPES)}

# Values PyTorch leaves unspecified: only the dtype and shape are compared
UNSPECIFIED_VALUES = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
# Which of equal elements an index names is unspecified (PyTorch's sort is not stable by default, and ONNX TopK
# names the lower index first): an index output is checked to name an element of the value it goes with
TIED_INDICES = {"sort", "argsort", "topk", "kthvalue", "msort", "mode", "median", "nanmedian"}
# ONNX Runtime has no kernel for these dtypes, and the translation has no other form yet: the graph fails to open
KNOWN = {
    "scatter_reduce.amax": "bool: ScatterElements with reduction 'max' takes no bool in ONNX Runtime's CPU kernel",
    "scatter_reduce.amin": "bool: ScatterElements with reduction 'min' takes no bool in ONNX Runtime's CPU kernel",
    "tensordot": "uint8: ReduceSum takes no uint8",
}


def check_values(op, dtype: torch.dtype, sample) -> str | None:
    """None when the sample's translated graph computes what the traced graph computes (or is declined); else
    what differs."""
    flat, spec = pytree.tree_flatten(([sample.input, *sample.args], sample.kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    tensors = [flat[i].detach().contiguous().clone() for i in positions]  # a view's storage is not its value
    if not tensors or any(t.dtype.is_complex or t.dtype in (torch.bfloat16, torch.float16) for t in tensors):
        return None  # numpy holds none of these: not values this sweep can feed

    def call(*given: torch.Tensor) -> tuple:
        values = list(flat)
        for i, t in zip(positions, given, strict=True):
            values[i] = t
        args, kwargs = pytree.tree_unflatten(values, spec)
        return tuple(o for o in pytree.tree_leaves(op.op(*args, **kwargs)) if isinstance(o, torch.Tensor))

    try:
        graph = make_fx(call, decomposition_table=torch_private.trace_decompositions(for_torch_onnx=False))(*tensors)
        expected = [t.detach() for t in graph(*[t.clone() for t in tensors])]
    except Exception:  # PyTorch itself cannot run or trace the sample in this dtype: not the translation's
        return None
    if not expected or any(t.dtype.is_complex or t.dtype in (torch.bfloat16, torch.float16) for t in expected):
        return None
    names = [f"in{i}" for i in range(len(tensors))]
    try:
        model = translate(graph, names, [f"out{i}" for i in range(len(expected))], 18)
    except UntranslatableGraph:
        return None  # declined: the builder exports such a graph through torch.onnx
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {n: t.numpy() for n, t in zip(names, tensors, strict=True)})
    except Exception as err:
        return f"ONNX Runtime: {str(err)[:200]}"
    for k, (value, want) in enumerate(zip(got, expected, strict=True)):
        wanted = want.numpy()
        if value.dtype != wanted.dtype or value.shape != wanted.shape:
            return f"output {k}: {value.dtype}{value.shape} where PyTorch gives {wanted.dtype}{wanted.shape}"
        if op.name in UNSPECIFIED_VALUES:
            continue
        if op.name in TIED_INDICES and wanted.dtype == np.int64:
            if not _same_elements(tensors[0].numpy(), value, wanted):
                return f"output {k}: indices {value.ravel()[:6]} name other values than PyTorch's {wanted.ravel()[:6]}"
            continue
        close = np.allclose(value, wanted, rtol=1e-5, atol=1e-6, equal_nan=True)
        if not (close if wanted.dtype.kind == "f" else np.array_equal(value, wanted)):
            return f"output {k}: {value.ravel()[:6]} where PyTorch gives {wanted.ravel()[:6]}"
    return None


def _same_elements(source: np.ndarray, indices: np.ndarray, expected: np.ndarray) -> bool:
    """Whether two index outputs name equal elements of `source` along some axis (the one the op indexes): ties
    may be named by either index."""
    if np.array_equal(indices, expected):
        return True
    for axis in range(source.ndim):
        got, want = indices, expected
        if got.ndim == source.ndim - 1:  # the op reduced that axis (keepdim=False)
            got, want = np.expand_dims(got, axis), np.expand_dims(want, axis)
        try:
            if np.array_equal(np.take_along_axis(source, got, axis), np.take_along_axis(source, want, axis)):
                return True
        except (IndexError, ValueError):
            continue
    return False


@pytest.mark.parametrize("name", sampled(sorted(OPS), every=4))
def test_integer_and_bool_values_like_pytorch(name):
    op = OPS[name]
    failures = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in DTYPES:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            torch.manual_seed(0)
            try:
                samples = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:SAMPLES]
            except Exception:  # an entry that cannot make samples in this dtype on this build
                continue
            for k, sample in enumerate(samples):
                problem = check_values(op, dtype, sample)
                if problem is not None:
                    failures.append(f"{dtype} sample {k}: {problem}")
    known = getattr(torch, KNOWN[name].split(":")[0]) if name in KNOWN else None
    if known in DTYPES:  # else the dtype that fails is not checked on this runtime, and every other one passes
        assert failures, f"{name} passes now: remove it from KNOWN"
        assert all(f.startswith(str(known)) for f in failures), failures
    else:
        assert not failures, failures


def test_the_known_failures_are_op_db_entries():
    assert set(KNOWN) <= set(OPS)
