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
`CHECKS[(domain, op_type)](node)` says, at construction, why OnnxModule refuses a node (an attribute value it does
not implement), or None. Domains: "" (ai.onnx) and "com.microsoft".

Element types: every ONNX tensor type but STRING has a torch value. INT4/UINT4 are held one value per int8/uint8
element (ONNX's own unpacked form); numpy has no bfloat16 or float8, so static values of those types are tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from ....dtypes import ELEMENT_TYPES
from ..errors import GradientBuildError

Value = torch.Tensor | np.ndarray
OpResult = Value | Sequence[Value | None]
TorchOp = Callable[..., OpResult]
StaticOp = Callable[..., OpResult]  # numpy in, numpy out (typed like TorchOp: some ops serve both tables)
Check = Callable[["NodeSpec"], "str | None"]

Op = TypeVar("Op", bound=Callable[..., Any])

TORCH_OPS: dict[tuple[str, str], TorchOp] = {}
STATIC_OPS: dict[tuple[str, str], StaticOp] = {}
CHECKS: dict[tuple[str, str], Check] = {}
MICROSOFT = "com.microsoft"


def torch_op(*op_types: str, domain: str = "", check: Check | None = None) -> Callable[[Op], Op]:
    """Register the decorated function as the torch implementation of `op_types` in `domain`; `check` (optional)
    refuses nodes at construction (see the module docstring)."""

    def register(fn: Op) -> Op:
        for op_type in op_types:
            TORCH_OPS[(domain, op_type)] = fn
            if check is not None:
                CHECKS[(domain, op_type)] = check
        return fn

    return register


def static_op(*op_types: str) -> Callable[[Op], Op]:
    """Register the decorated function as the numpy implementation of ai.onnx `op_types` (static inputs only)."""

    def register(fn: Op) -> Op:
        for op_type in op_types:
            STATIC_OPS[("", op_type)] = fn
        return fn

    return register


class OnnxNodeError(GradientBuildError):
    """An ONNX node that OnnxModule cannot run; the message names the node, its op and its opset."""


@dataclass(frozen=True)
class NodeSpec:
    """One node as the op table needs it: attributes decoded to Python values (tensors to values, strings to str,
    graphs compiled by the module), the opset of its domain, and which outputs the graph uses (an unnamed output
    is not computed)."""

    name: str
    op_type: str
    domain: str
    opset: int
    attrs: Mapping[str, Any]
    outputs: tuple[str, ...]
    inputs: tuple[str, ...] = ()
    input_types: tuple[int | None, ...] = ()  # ONNX element types the graph declares for the inputs

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    @property
    def label(self) -> str:
        op = f"{self.domain}.{self.op_type}" if self.domain else self.op_type
        where = f"node {self.name!r}" if self.name else f"the node computing {self.outputs[0]!r}"
        return f"{where} ({op}, opset {self.opset})" if self.outputs else f"a {op} node"


@dataclass(frozen=True)
class Call:
    """One run of a node: its spec, the device its constants go to, the values the model gave small state
    tensors (by `id` of the tensor this run sees; see `numbers`), the graph's values (`scope`, which the
    subgraphs of If, Loop and Scan read) and the run's state (`run`: buffers an op may update)."""

    node: NodeSpec
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    given: Mapping[int, np.ndarray] = field(default_factory=dict)
    scope: Mapping[str, Value] = field(default_factory=dict)
    run: RunState | None = None

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
        return as_tensor(value).to(self.device)

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
        values: list | None = None
        error: Exception | None = None
        try:
            values = value.detach().reshape(-1).cpu().to(_readable(value.dtype)).tolist()
        except Exception as err:  # a traced placeholder has no values
            error = err
        # a traced placeholder's tolist() raises, or (newer torch) gives symbols (SymInt) that stand for no number
        if values is not None and all(isinstance(v, int | float) for v in values):
            return values
        if id(value) in self.given:
            return self.given[id(value)].reshape(-1).tolist()
        raise self.fail(
            f"input {what} must be known when the graph is traced (a constant, an initializer that is not "
            "trained, or computed from shapes), but it is computed from data or weights"
        ) from error

    def scalar(self, value: Value | None, what: str, default: float) -> float:
        """The single number in `value`, or `default` when the optional input is missing."""
        return default if value is None else float(self.numbers(value, what)[0])

    def update(self, buffer: Value, value: torch.Tensor) -> None:
        """Write `value` into `buffer` after the forward, when `buffer` is one of the module's buffers (a
        BatchNormalization's running statistics); otherwise nothing (a value of the graph stays as it is)."""
        if self.run is not None and isinstance(buffer, torch.Tensor) and id(buffer) in self.run.buffers:
            self.run.updates.append((buffer, value.detach()))

    def array(self, value: Value, what: str) -> np.ndarray:
        """`value` as a numpy array of its values (static, or a tensor run eagerly), e.g. a RoiAlign box list."""
        if isinstance(value, np.ndarray):
            return value
        return np.asarray(self.numbers(value, what), dtype=np.float64).reshape(tuple(value.shape))


@dataclass
class RunState:
    """What one forward of the module shares between its nodes: the ids of the buffers ops may update, and the
    updates, applied when the forward ends (so every node reads the values the graph started with)."""

    buffers: frozenset[int] = frozenset()
    updates: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _readable(dtype: torch.dtype) -> torch.dtype:
    """A dtype whose `tolist` gives Python numbers (bfloat16 and float8 do not convert directly everywhere)."""
    return torch.float64 if dtype.is_floating_point else dtype


# ONNX element type -> torch dtype, beyond the trainer's table (orttrainer/dtypes.py): the unsigned and float8
# types, and INT4/UINT4 held in int8/uint8 elements.
_EXTRA_TORCH: dict[int, torch.dtype] = {
    TensorProto.UINT16: torch.uint16,
    TensorProto.UINT32: torch.uint32,
    TensorProto.UINT64: torch.uint64,
    TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    TensorProto.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    TensorProto.FLOAT8E5M2: torch.float8_e5m2,
    TensorProto.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
    TensorProto.INT4: torch.int8,
    TensorProto.UINT4: torch.uint8,
}
_TORCH_BY_ONNX: dict[int, torch.dtype] = {**{t.onnx: t.torch for t in ELEMENT_TYPES}, **_EXTRA_TORCH}
_NUMPY_BY_ONNX: dict[int, Any] = {
    **{t.onnx: t.numpy for t in ELEMENT_TYPES if t.numpy is not None},
    TensorProto.UINT16: np.uint16,
    TensorProto.UINT32: np.uint32,
    TensorProto.UINT64: np.uint64,
    TensorProto.INT4: np.int8,
    TensorProto.UINT4: np.uint8,
}
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
# the sub-byte integer types: (low, high) of their values
SUBBYTE: dict[int, tuple[int, int]] = {TensorProto.INT4: (-8, 7), TensorProto.UINT4: (0, 15)}


def element_name(elem_type: int) -> str:
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return str(elem_type)


def torch_dtype(elem_type: int) -> torch.dtype:
    """The torch dtype of ONNX element type `elem_type`; ValueError naming the type when there is none."""
    if elem_type not in _TORCH_BY_ONNX:
        raise ValueError(f"ONNX element type {element_name(elem_type)} has no torch equivalent")
    return _TORCH_BY_ONNX[elem_type]


def numpy_dtype(elem_type: int) -> Any:
    if elem_type not in _NUMPY_BY_ONNX:
        raise ValueError(f"ONNX element type {element_name(elem_type)} has no numpy equivalent")
    return _NUMPY_BY_ONNX[elem_type]


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A numpy array as a new CPU tensor (numpy bools, ints, unsigned ints and floats)."""
    return torch.from_numpy(np.array(array, copy=True))


def tensor_value(proto: onnx.TensorProto) -> Value:
    """An initializer's or a Constant's value: a numpy array, or a tensor for the types numpy lacks (bfloat16,
    float8: numpy_helper gives their bits); INT4/UINT4 as int8/uint8 values. STRING: ValueError."""
    if proto.data_type == TensorProto.STRING:
        raise ValueError("string tensors have no torch equivalent")
    array = numpy_helper.to_array(proto)
    dtype = torch_dtype(proto.data_type)
    if proto.data_type == TensorProto.BFLOAT16:
        return as_tensor(np.asarray(array).view(np.int16)).view(torch.bfloat16)
    if dtype in FLOAT8:
        return as_tensor(np.asarray(array).view(np.uint8)).view(dtype)
    if proto.data_type in SUBBYTE:
        return np.asarray(array).astype(numpy_dtype(proto.data_type))
    return np.asarray(array)


def axis_of(axis: int, rank: int) -> int:
    """A non-negative axis (ONNX axes may count from the end)."""
    return axis + rank if axis < 0 else axis


def axes_of(axes: Sequence[int], rank: int) -> list[int]:
    return [axis_of(a, rank) for a in axes]


def refuse_unless(condition: Callable[[NodeSpec], bool], reason: str) -> Check:
    """A check refusing every node for which `condition` is false, with `reason`."""

    def check(node: NodeSpec) -> str | None:
        return None if condition(node) else reason

    return check
