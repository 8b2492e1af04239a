"""The 'ort' builder's training graph specialised to each input-shape signature (the first few), on the CPU.

Why: ONNX Runtime's gradient graph is written for any input shape, and pays for it on every step — shape
arithmetic, and a copy of the gradient wherever a broadcasting op's gradient turns out to sum over no axis
(graph/static_shapes.py). With the data inputs' dims fixed, ONNX Runtime's optimiser folds the shape arithmetic
(`runtime/ort.optimized_model`) and the passes of graph/static_shapes.py remove the copies and the q/k/v
scatter-adds. The result is a graph for exactly one signature, run by its own session; the trainer keeps up to
`MAX_STATIC_SIGNATURES` of them and runs the dynamic graph for any other signature, so variable shapes cost at most
that many extra compilations (a few tenths of a second each).

When: the graph's data inputs have dynamic dims (the 'ort' builder; the torch builder's graphs are static already),
the device is the CPU (the specialised model is optimised for the CPU provider), the graph has no Dropout (each
session seeds its Dropout nodes at its creation, runtime/session.seeded: sessions of one graph key must not run side
by side) and no float16 tensors (mixed precision), and `ORTTRAINER_DISABLE_REWRITES` does not name `static_shapes`.
The state contract (graph inputs and outputs) is unchanged, so every specialised graph reads and replaces the same
state. The measured effect is in README § Benchmarks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import onnx
import torch

from ..graph.dropout_seeds import dropout_nodes
from ..graph.editor import topologically_sorted
from ..graph.passes import rewrite_enabled, run_passes
from ..graph.static_shapes import STATIC_SHAPE_PASSES, static_inputs_pass, static_shape_problem

MAX_STATIC_SIGNATURES = 4
_logger = logging.getLogger(__name__)

G = TypeVar("G")
Optimize = Callable[[onnx.ModelProto], onnx.ModelProto]  # runtime/ort.optimized_model with the session's options


def specializable(graph: Any, device_type: str) -> bool:
    """Whether `graph` (a TrainingGraph or GradientStepGraph) is specialised per signature (module docstring)."""
    model = graph.model
    return (
        device_type == "cpu"
        and getattr(graph, "loss_scale_input", None) is None
        and not dropout_nodes(model)
        and static_shape_problem(model, graph.data_inputs) is None
        and rewrite_enabled("static_shapes")
    )


# Ops of ONNX Runtime's inference-only fusions: a specialised training graph that contains one it did not have is
# refused (runtime/ort.TRAINING_UNSAFE_FUSIONS keeps them off; this is the check that they stayed off).
_INFERENCE_ONLY_OPS = frozenset(
    {
        "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "EmbedLayerNormalization",
        "Attention",
        "MultiHeadAttention",
    }
)


def specialized(graph: G, data: dict[str, torch.Tensor], optimize: Optimize) -> G | None:
    """A copy of `graph` whose model is specialised to the shapes of `data` (its data inputs); None when ONNX
    Runtime's optimiser brought in an inference-only fused op (`_INFERENCE_ONLY_OPS`): the dynamic graph runs then."""
    names: list[str] = graph.data_inputs  # type: ignore[attr-defined]
    shapes = {name: tuple(data[name].shape) for name in names if name in data}
    _logger.info("specialising the training graph to the input shapes %s", shapes)
    before = {n.op_type for n in graph.model.graph.node}  # type: ignore[attr-defined]
    model = run_passes(graph.model, [static_inputs_pass(shapes)])  # type: ignore[attr-defined]
    model = _release_fills(optimize(_hold_fills(model)))
    unsafe = sorted(({n.op_type for n in model.graph.node} - before) & _INFERENCE_ONLY_OPS)
    if unsafe:
        _logger.info("not specialising the training graph: ONNX Runtime fused it into %s", unsafe)
        return None
    model = run_passes(model, STATIC_SHAPE_PASSES)
    return dataclasses.replace(graph, model=model)  # type: ignore[type-var]


_HOLD_INPUT = "orttrainer/static/hold"
_HOLD_NODE = "orttrainer/static/hold_node/"


def _hold_fills(model: onnx.ModelProto) -> onnx.ModelProto:
    """Keep ONNX Runtime's constant folding away from `ConstantOfShape` (in place): its shape input gets `+ h` for
    a new int64 graph input `h`, so the fill depends on a graph input and is not materialised as an initializer
    (the q/k/v scatter-adds' zeros: 36 MB on the benchmark transformer, written, read back and copied by every
    pass; docs/engine.md §14); the shape arithmetic before it is still folded. `_release_fills` undoes it."""
    fills = [n for n in model.graph.node if n.op_type == "ConstantOfShape"]
    if not fills:
        return model
    model.graph.input.append(onnx.helper.make_tensor_value_info(_HOLD_INPUT, onnx.TensorProto.INT64, []))
    for i, node in enumerate(fills):
        held = f"{_HOLD_NODE}{i}"
        model.graph.node.append(onnx.helper.make_node("Add", [node.input[0], _HOLD_INPUT], [held], name=held))
        node.input[0] = held
    return topologically_sorted(model)


def _release_fills(model: onnx.ModelProto) -> onnx.ModelProto:
    """Undo `_hold_fills` on ONNX Runtime's optimised model (in place): each `x + h` is `x` again."""
    holds = {n.output[0]: n.input[0] for n in model.graph.node if n.name.startswith(_HOLD_NODE)}
    if not holds:
        return model
    kept = [n for n in model.graph.node if not n.name.startswith(_HOLD_NODE)]
    for node in kept:
        for i, name in enumerate(node.input):
            if name in holds:
                node.input[i] = holds[name]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    inputs = [v for v in model.graph.input if v.name != _HOLD_INPUT]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    return model
