"""What every op of `OnnxModule`'s op table sees: the node (`Call`), the values it computes with, and the tables.

Values: a node input is a `torch.Tensor` (it depends on data or on a trained tensor) or a numpy array, a *static*
value known when the graph is traced: initializers that are not trainer state, `Constant` outputs, `Shape`
outputs and whatever shape arithmetic computes from them. Ops that need numbers to build their result (Reshape's
shape, Slice's starts, a reduction's axes) read static values with `Call.ints`; the torch builder traces with
placeholder tensors that have shapes but no values (docs/engine.md §8), so such a number computed from data cannot
be read and is an error naming the node. Shapes are concrete while tracing (one graph per input-shape signature),
so `Shape` is static.

Tables: `TORCH_OPS[(domain, op_type)](call, *inputs)` computes with torch (differentiable; static inputs are turned
into constants by `Call.tensor`); `STATIC_OPS` holds numpy versions of the shape-arithmetic ops, used when every
input is static, so that shapes computed in the graph stay readable numbers. A missing optional input is None.
Domains: "" (ai.onnx) and "com.microsoft".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ....dtypes import ELEMENT_TYPES, onnx_to_torch
from ..errors import GradientBuildError

Value = torch.Tensor | np.ndarray
OpResult = Value | Sequence[Value | None]
TorchOp = Callable[..., OpResult]
StaticOp = Callable[..., OpResult]  # numpy in, numpy out (typed like TorchOp: some ops serve both tables)

TORCH_OPS: dict[tuple[str, str], TorchOp] = {}
STATIC_OPS: dict[tuple[str, str], StaticOp] = {}
MICROSOFT = "com.microsoft"

_NUMPY_BY_ONNX = {t.onnx: t.numpy for t in ELEMENT_TYPES if t.numpy is not None}


def torch_op(*op_types: str, domain: str = "") -> Callable[[TorchOp], TorchOp]:
    """Register the decorated function as the torch implementation of `op_types` in `domain`."""

    def register(fn: TorchOp) -> TorchOp:
        for op_type in op_types:
            TORCH_OPS[(domain, op_type)] = fn
        return fn

    return register


def static_op(*op_types: str) -> Callable[[StaticOp], StaticOp]:
    """Register the decorated function as the numpy implementation of ai.onnx `op_types` (static inputs only)."""

    def register(fn: StaticOp) -> StaticOp:
        for op_type in op_types:
            STATIC_OPS[("", op_type)] = fn
        return fn

    return register


class OnnxNodeError(GradientBuildError):
    """An ONNX node that OnnxModule cannot run; the message names the node and its op."""


@dataclass(frozen=True)
class NodeSpec:
    """One node as the op table needs it: attributes decoded to Python values (tensors to numpy arrays, strings
    to str), the opset of its domain, and which outputs the graph uses (an unnamed output is not computed)."""

    name: str
    op_type: str
    domain: str
    opset: int
    attrs: Mapping[str, Any]
    outputs: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"node {self.name!r} ({self.op_type})" if self.name else f"a {self.op_type} node"


@dataclass(frozen=True)
class Call:
    """One run of a node: its spec, the device its constants go to, and the values the model gave small state
    tensors (by `id` of the tensor this run sees; see `numbers`)."""

    node: NodeSpec
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    given: Mapping[int, np.ndarray] = field(default_factory=dict)

    @property
    def opset(self) -> int:
        return self.node.opset

    def attr(self, key: str, default: Any = None) -> Any:
        return self.node.attrs.get(key, default)

    def wants(self, index: int) -> bool:
        """Whether output `index` exists and is named (optional outputs are computed only when wanted)."""
        return index < len(self.node.outputs) and bool(self.node.outputs[index])

    def fail(self, message: str) -> OnnxNodeError:
        return OnnxNodeError(f"OnnxModule cannot run {self.node.label}: {message}")

    def tensor(self, value: Value) -> torch.Tensor:
        """`value` as a tensor; a static value becomes a constant on the call's device."""
        if isinstance(value, torch.Tensor):
            return value
        return torch.from_numpy(np.array(value, copy=True)).to(self.device)

    def tensors(self, *values: Value) -> list[torch.Tensor]:
        return [self.tensor(v) for v in values]

    def ints(self, value: Value | None, what: str) -> list[int]:
        """The integers in `value` (flattened), which must be static — or a real tensor when run eagerly."""
        return [int(v) for v in self.numbers(value, what)]

    def numbers(self, value: Value | None, what: str) -> list[float]:
        """The numbers in `value`: a static value's; a tensor's when it has values (run eagerly); while tracing,
        for a small trained or frozen initializer (a Dropout ratio, a Pad value), the value the model gave it:
        read as a number it gets no gradient, so the trainer freezes it (a checkpoint cannot change it)."""
        if value is None:
            raise self.fail(f"input {what} is missing")
        if isinstance(value, np.ndarray):
            return value.reshape(-1).tolist()
        try:
            return value.detach().reshape(-1).cpu().tolist()
        except Exception as err:  # a traced placeholder has no values
            if id(value) in self.given:
                return self.given[id(value)].reshape(-1).tolist()
            raise self.fail(
                f"input {what} must be known when the graph is traced (a constant, an initializer that is not "
                "trained, or computed from shapes), but it is computed from data or weights"
            ) from err

    def scalar(self, value: Value | None, what: str, default: float) -> float:
        """The single number in `value`, or `default` when the optional input is missing."""
        return default if value is None else float(self.numbers(value, what)[0])


def torch_dtype(elem_type: int) -> torch.dtype:
    return onnx_to_torch(elem_type)


def numpy_dtype(elem_type: int) -> Any:
    if elem_type not in _NUMPY_BY_ONNX:
        raise ValueError(f"ONNX element type {elem_type} has no numpy equivalent")
    return _NUMPY_BY_ONNX[elem_type]


def axis_of(axis: int, rank: int) -> int:
    """A non-negative axis (ONNX axes may count from the end)."""
    return axis + rank if axis < 0 else axis


def axes_of(axes: Sequence[int], rank: int) -> list[int]:
    return [axis_of(a, rank) for a in axes]
