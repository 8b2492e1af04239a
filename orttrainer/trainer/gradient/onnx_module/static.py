"""Numpy versions of the arithmetic ops that shape computations use (the shape ops' own numpy versions are in
`shape.py`, `indexing.py`): OnnxModule runs them when every input is static, so that a shape computed in the graph
(`Shape -> Gather -> Mul -> Concat -> Reshape`) is still a number when Reshape reads it.

Rules: the same values as the torch versions in `elementwise.py` and `reduce.py` — the element type of the inputs is
kept (numpy's promotion of equal types), integer Div truncates toward zero, Mod follows `fmod`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .base import Call, static_op
from .reduce import reduction_axes


def _keep(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """The result as an array of the first input's type for arithmetic (numpy turns some results into floats or
    scalars)."""

    def run(call: Call, *values: np.ndarray) -> np.ndarray:
        return np.asarray(fn(*values), dtype=values[0].dtype)

    return run


def _truncating_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.floating):
        return a / b
    quotient = np.floor_divide(a, b)
    return quotient + ((np.remainder(a, b) != 0) & ((a < 0) != (b < 0)))


_ARITHMETIC: dict[str, Callable[..., Any]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": _truncating_div,
    "Neg": np.negative,
    "Abs": np.abs,
    "Sqrt": np.sqrt,
    "Floor": np.floor,
    "Ceil": np.ceil,
    "Max": lambda *vs: functools.reduce(np.maximum, vs),
    "Min": lambda *vs: functools.reduce(np.minimum, vs),
    "Sum": lambda *vs: functools.reduce(np.add, vs),
}
for _name, _fn in _ARITHMETIC.items():
    static_op(_name)(_keep(_fn))


def _boolean(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def run(call: Call, *values: np.ndarray) -> np.ndarray:
        return np.asarray(fn(*values), dtype=np.bool_)

    return run


_LOGICAL: dict[str, Callable[..., Any]] = {
    "Equal": np.equal,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "Not": np.logical_not,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Xor": np.logical_xor,
}
for _name, _fn in _LOGICAL.items():
    static_op(_name)(_boolean(_fn))


@static_op("Mod")
def mod_static(call: Call, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(np.fmod(a, b) if call.attr("fmod", 0) else np.remainder(a, b), dtype=a.dtype)


@static_op("Where")
def where_static(call: Call, condition: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.where(condition, x, y).astype(x.dtype)


_REDUCE: dict[str, Callable[..., Any]] = {
    "ReduceProd": np.prod,
    "ReduceSum": np.sum,
    "ReduceMax": np.max,
    "ReduceMin": np.min,
}


def _reduce_static(call: Call, x: np.ndarray, axes: np.ndarray | None = None) -> np.ndarray:
    dims = reduction_axes(call, axes, x.ndim)
    if dims is None or x.ndim == 0:
        return x
    fn = _REDUCE[call.node.op_type]
    return np.asarray(fn(x, axis=dims, keepdims=bool(call.attr("keepdims", 1))), dtype=x.dtype)


for _name in _REDUCE:
    static_op(_name)(_reduce_static)
