"""Mixed precision on the torch route: the PyTorch module computes in float16 on the float32 master state.

`export._ModelWithLoss(..., float16=True)` (what the torch builder traces and the torch route's eval graphs export)
applies these rules (docs/engine.md §15):
- every float32 parameter and buffer is cast to float16 where the module reads it (`float16_state`, through
  `torch.func.functional_call`): the graph's state inputs stay the float32 master copy, and each parameter's
  gradient comes back through the cast's gradient as float32;
- the float32 data inputs the module reads are cast to float16 (`float16_inputs`); a loss function's label is not;
- float16 module outputs are cast to float32 before the loss function (`float32_values`), so the loss and the
  start of its backward (where the loss scale enters) run in float32, as the 'ort' path keeps its loss subgraph
  float32 (graph/mixed_precision.py); the loss itself is float32, the other outputs keep the module's float16.
Inside the module PyTorch's own half-precision rules hold: its decompositions of softmax, log-softmax and layer norm
compute in float32 internally, as its eager kernels do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def float16_inputs(inputs: Sequence[Any], label: bool) -> list[Any]:
    """`inputs` with each float32 tensor cast to float16, except the last one when it is a loss function's
    `label`."""
    cast = [_half(v) for v in inputs]
    if label and inputs:
        cast[-1] = inputs[-1]
    return cast


def float16_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every name of `module`'s parameters and buffers (tied names too, one cast per tensor) -> a float16 cast of
    each float32 one; for `torch.func.functional_call`."""
    casts: dict[int, torch.Tensor] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    state = {}
    for name, tensor in named:
        if tensor.dtype == torch.float32:
            state[name] = casts.setdefault(id(tensor), tensor.half())
    return state


def float32_values(value: Any) -> Any:
    """`value` (a tensor, or nested tuples/lists of them) with float16 tensors cast to float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype == torch.float16 else value
    if isinstance(value, (tuple, list)):
        items = [float32_values(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple, or not
    return value


def _half(value: Any) -> Any:
    return value.half() if isinstance(value, torch.Tensor) and value.dtype == torch.float32 else value
