"""`utils.memory_efficient_gradient` on the torch builder: gradient and activation buffers freed as early as the
graph allows.

Three rules, each with the effect the legacy option had on ONNX Runtime's gradient graph — a lower peak of the
memory a step holds:

- **Layer norm's gradient from its output** (`invertible_layer_norm`): while the training graph is traced, every
  `torch.nn.functional.layer_norm` call runs as `InvertibleLayerNorm`, whose backward computes
  x̂ = (y - bias) / weight from the output y instead of reading the input x, as ONNX Runtime's
  `InvertibleLayerNormalizationGrad` does (the 'ort' builder's form of the option): the input is freed after the
  forward reads it, and the output is kept, which the next layer keeps anyway as its matmul's input. The gradients
  are PyTorch's to float32 rounding; a weight element that is exactly zero makes x̂ undefined there, and the
  gradient NaN, as with ONNX Runtime's kernel.
- **Each output where autograd computes it** (`pin_outputs`): ONNX Runtime orders a graph by a depth-first walk
  back from its outputs (docs/engine.md §16), which leaves outputs that nothing else reads — bias and layer-norm
  gradients, and the loss's own last op — to the end of the step, so the tensors they read (the logits' gradient,
  each layer's hidden gradient, the log-probabilities) stay allocated through the whole backward. Each output's
  node is pinned before the node that follows it in the traced order by an `after` gate
  (`torch_private.custom_ops`): one small gate per output, no copy.
- **No buffer reuse plan** (trainer/model.py, `SessionConfig.memory_reuse`): ONNX Runtime's allocation planner
  gives a tensor the buffer of an earlier one that has died, and keeps that buffer allocated from the first
  tensor's birth to the last one's death, over the gap between them (docs/engine.md §16); without the plan each
  buffer is freed when its tensor dies. On the CPU every session already runs without it (docs/engine.md §24).

Recompute needs the last two as well (its copies would otherwise wait for the deferred outputs, and reuse the
forward's buffers), so the trainer applies them with either option. The graph computes the same values either way,
in another order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch.overrides import TorchFunctionMode

from .torch_private import custom_ops


class InvertibleLayerNorm(torch.autograd.Function):
    """`torch.nn.functional.layer_norm` whose backward reads its output, not its input (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: list[int], weight: Any, bias: Any, eps: float) -> torch.Tensor:
        y, _, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(y, rstd, weight, bias)
        ctx.dims = len(shape)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        y, rstd, weight, bias = ctx.saved_tensors
        axes = list(range(y.dim() - ctx.dims, y.dim()))
        lead = list(range(y.dim() - ctx.dims))
        dtype = torch.promote_types(y.dtype, torch.float32)  # float16 activations: the arithmetic in float32
        y32, g32, rstd32 = y.to(dtype), grad.to(dtype), rstd.to(dtype)
        xhat = y32 - bias.to(dtype) if bias is not None else y32
        if weight is not None:
            xhat = xhat / weight.to(dtype)
        gw = g32 * weight.to(dtype) if weight is not None else g32
        dx = rstd32 * (gw - gw.mean(dim=axes, keepdim=True) - xhat * (gw * xhat).mean(dim=axes, keepdim=True))
        dweight = (
            (g32 * xhat).sum(dim=lead).to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        )
        dbias = g32.sum(dim=lead).to(bias.dtype) if bias is not None and ctx.needs_input_grad[3] else None
        return dx.to(grad.dtype), None, dweight, dbias, None


class _InvertibleLayerNormMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.layer_norm or func is torch.layer_norm:
            x, shape, weight, bias, eps = _layer_norm_arguments(*args, **kwargs)
            return InvertibleLayerNorm.apply(x, list(shape), weight, bias, eps)
        return func(*args, **kwargs)


def _layer_norm_arguments(input, normalized_shape, weight=None, bias=None, eps=1e-5, *rest, **_):
    return input, normalized_shape, weight, bias, eps


@contextlib.contextmanager
def invertible_layer_norm() -> Iterator[None]:
    """Within the block, layer norms run as `InvertibleLayerNorm` (module docstring)."""
    with _InvertibleLayerNormMode():
        yield


def pin_outputs(joint: fx.GraphModule) -> int:
    """Pin the node of each graph output (the loss, the other forward outputs, the gradients) before the node that
    follows it in the graph: that node's first computed tensor input passes through `after(x, output)`. Returns
    the number of pins. `joint`'s graph is modified (its Python code is regenerated where it runs)."""
    graph = joint.graph
    live = _live(graph)  # a pin on a dead node would be removed with it by the exporter
    nodes = [node for node in graph.nodes if node in live]
    position = {node: i for i, node in enumerate(nodes)}
    outputs = list(dict.fromkeys(graph.output_node().args[0]))  # type: ignore[arg-type]
    pins = 0
    for output in outputs:
        if not isinstance(output, fx.Node) or output.op != "call_function":
            continue
        for follower in nodes[position[output] + 1 :]:
            source = next((s for s in follower.all_input_nodes if _computed_tensor(s)), None)
            if follower.op == "call_function" and source is not None:
                break
        else:
            continue
        with graph.inserting_before(follower):
            gate = graph.call_function(custom_ops.AFTER, (source, output))
        gate.meta.update(val=source.meta["val"], partitioner_tag="is_backward")
        follower.replace_input_with(source, gate)
        pins += 1
    graph.lint()
    return pins


def _live(graph: fx.Graph) -> set[fx.Node]:
    """The nodes the graph's outputs depend on."""
    seen: set[fx.Node] = set()
    todo = [graph.output_node()]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return seen


def _computed_tensor(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)
