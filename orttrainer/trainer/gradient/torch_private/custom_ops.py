"""orttrainer's own torch operators, for the torch builder's traces, and their ONNX translations.

Part of `torch_private` (see its docstring for the rule); verified on torch 2.13.0 with onnxscript 0.7.2 and onnx
1.17.0. Each operator is an identity in eager PyTorch (a copy: a custom operator may not return an alias of its
input) and survives AOTAutograd's trace as one graph node, so a graph rewrite can find it:

- `activation_mark(x, name, backward)`: an activation `orttrainer.debug` dumps. Its gradient is
  `activation_mark(g, name, True)`, so the traced backward marks the activation's gradient (the sum over its
  readers, as autograd forms it). ONNX: `orttrainer.debug::ActivationMark(x)` with string attributes `activation`
  and `direction` ('forward' | 'backward'), the marker op `graph/statistics.py` turns into an Identity.
- `layer_boundary(x, tag)`: the input or output of a transformer layer (`tag` 'in:<k>' / 'out:<k>'); its gradient
  is `g` itself. The recompute rewrite reads the tags and removes the nodes before export (no ONNX translation).
- `after(x, dep)`: `x`, available only once `dep` is computed. ONNX: `Squeeze(Unsqueeze(x, [0]), [0] + z)` where
  `z` is an int64 zero computed from one element of `dep` (`ReduceSum(Cast(Greater(d, d)))`, false for every
  value, NaN included): ONNX Runtime's Unsqueeze and Squeeze outputs share their input's buffer, so the gate copies
  nothing, and no optimiser folds it (its axes depend on a computed tensor) or merges two gated reads of `x` with
  different `dep`s. (A `Reshape(x, Shape(x) + z)` gate was folded away by torch.onnx's optimiser when a Reshape read
  it: two Reshapes in a row become one, docs/engine.md §16.)
"""

from __future__ import annotations

import functools
from typing import Any

import onnx
import torch
from onnx import TensorProto

NAMESPACE = "orttrainer"
MARK_DOMAIN = "orttrainer.debug"  # graph/statistics.py reads these markers
MARK_OP = "ActivationMark"


@torch.library.custom_op(f"{NAMESPACE}::activation_mark", mutates_args=())
def activation_mark(x: torch.Tensor, name: str, backward: bool) -> torch.Tensor:
    """`x` (a copy), marked as the activation `name` (its gradient when `backward`)."""
    return x.clone()


@activation_mark.register_fake
def _activation_mark_fake(x: torch.Tensor, name: str, backward: bool) -> torch.Tensor:
    return torch.empty_like(x)


def _activation_mark_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.name = inputs[1]


def _activation_mark_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return activation_mark(grad, ctx.name, True), None, None


activation_mark.register_autograd(_activation_mark_backward, setup_context=_activation_mark_setup)


@torch.library.custom_op(f"{NAMESPACE}::layer_boundary", mutates_args=())
def layer_boundary(x: torch.Tensor, tag: str) -> torch.Tensor:
    """`x` (a copy), marked as a layer's input or output (`tag`)."""
    return x.clone()


@layer_boundary.register_fake
def _layer_boundary_fake(x: torch.Tensor, tag: str) -> torch.Tensor:
    return torch.empty_like(x)


def _layer_boundary_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


layer_boundary.register_autograd(_layer_boundary_backward)


@torch.library.custom_op(f"{NAMESPACE}::after", mutates_args=())
def after(x: torch.Tensor, dep: torch.Tensor) -> torch.Tensor:
    """`x` (a copy), ordered after `dep`."""
    return x.clone()


@after.register_fake
def _after_fake(x: torch.Tensor, dep: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


ACTIVATION_MARK = torch.ops.orttrainer.activation_mark.default
LAYER_BOUNDARY = torch.ops.orttrainer.layer_boundary.default
AFTER = torch.ops.orttrainer.after.default


@functools.lru_cache(maxsize=1)
def _mark_schema() -> None:
    """Register the marker op's ONNX schema (onnxscript builds a node only for an op with a schema)."""
    from onnx.defs import OpSchema

    if onnx.defs.has(MARK_OP, MARK_DOMAIN):
        return
    types = [f"tensor({t})" for t in ("float", "float16", "bfloat16", "double", "int64", "int32", "int8", "bool")]
    schema = OpSchema(
        MARK_OP,
        MARK_DOMAIN,
        1,
        inputs=[OpSchema.FormalParameter("x", "T")],
        outputs=[OpSchema.FormalParameter("y", "T")],
        type_constraints=[("T", types, "any tensor")],
        attributes=[
            OpSchema.Attribute("activation", OpSchema.AttrType.STRING, "the activation's name", required=True),
            OpSchema.Attribute("direction", OpSchema.AttrType.STRING, "'forward' or 'backward'", required=False),
        ],
    )
    onnx.defs.register_schema(schema)


def translations() -> dict[Any, Any]:
    """operator -> its ONNX translation (an onnxscript function), for torch.onnx's registry."""
    import onnxscript
    from onnxscript import opset18

    op: Any = opset18  # untyped here: onnxscript's stubs type every op's inputs narrowly

    _mark_schema()
    debug = onnxscript.values.Opset(MARK_DOMAIN, 1)

    def mark_onnx(x: Any, name: str, backward: bool) -> Any:
        return debug.ActivationMark(x, activation=name, direction="backward" if backward else "forward")

    def after_onnx(x: Any, dep: Any) -> Any:
        flat = op.Reshape(dep, op.Constant(value_ints=[-1]))
        first = op.Slice(flat, op.Constant(value_ints=[0]), op.Constant(value_ints=[1]))
        number = op.Cast(first, to=TensorProto.FLOAT)  # Greater takes numbers only (dep may be bool)
        zero = op.ReduceSum(op.Cast(op.Greater(number, number), to=TensorProto.INT64), keepdims=0)
        axis = op.Constant(value_ints=[0])
        return op.Squeeze(op.Unsqueeze(x, axis), op.Add(axis, zero))

    return {ACTIVATION_MARK: mark_onnx, AFTER: after_onnx}


def register_translations(registry: Any) -> None:
    """Add `translations()` to one of torch.onnx's registries (`exporting._registry`)."""
    for target, function in translations().items():
        registry.register_op(target, function)
