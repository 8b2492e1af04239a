"""The `ort` gradient builder with options: cast propagation (`graph_transformer.propagate_cast_ops_config`) and
memory-efficient gradients (`utils.memory_efficient_gradient`).

ONNX Runtime's pre-training transformers include PropagateCastOps, and its gradient builder can write
`InvertibleLayerNormalizationGrad` (the layer-norm gradient from the output Y instead of the input X, so X need not be
kept for the backward pass). The route `gradient.build_ort_gradient_graph` takes (`get_optimized_model` +
`GradientGraphBuilder`) fixes both: PropagateCastOps always runs with ONNX Runtime's default configuration
(FLOOD_FILL, level 1, no extra ops — which is also the option's default) and memory-efficient gradients are off.
The only Python route that configures them is `OrtModuleGraphBuilder` (ORTModule's graph builder): its
`TrainingGraphTransformerConfiguration.propagate_cast_ops_config` and
`OrtModuleGraphBuilderConfiguration.use_memory_efficient_gradient`. It builds a forward+backward graph whose loss
gradient comes from a `YieldOp` (ORTModule's hand-over to PyTorch); `build_configured_gradient_graph` turns that into
this project's gradient contract:

- the builder sees the forward model with the loss as its only output (other outputs would become external
  gradient inputs of the YieldOp);
- `YieldOp(loss) -> loss_grad` is removed and `loss_grad` becomes the constant 1 (what `GradientGraphBuilder`
  seeds), and the forward outputs are graph outputs again, before the gradients in `trainable` order.

A forward output the loss does not depend on is dropped by the builder; that raises `GradientBuildError`.

PropagateCastOps (ONNX Runtime's `propagate_cast_ops.cc`) only moves existing float16<->float32 `Cast` nodes:
FLOOD_FILL grows float16 regions by moving casts across the ops allowed at `level` (1: shape ops, Relu, Tanh, Gelu;
2: also Add, Mul, Sub, Gather, Dropout, LayerNormalization, BiasGelu, FastGelu) plus `allow`; INSERT_AND_REDUCE
casts around every allowed op next to a cast, then removes back-to-back pairs; NONE or a level of -1 turns the pass
off. A float32 graph has no casts, so the pass changes nothing there.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph.cast_propagation import STRATEGIES, CastPropagation
from ..graph.editor import copy_model
from ..runtime import ort_private
from .errors import GradientBuildError

if TYPE_CHECKING:
    from ...schema.options import ORTTrainerOptions


@dataclass(frozen=True)
class GradientOptions:
    """Cast propagation (strategy name, level, extra allowed op types) and memory-efficient gradients."""

    cast_strategy: str = "FLOOD_FILL"
    cast_level: int = 1
    cast_allow: tuple[str, ...] = ()
    memory_efficient: bool = False

    def __post_init__(self) -> None:
        if self.cast_strategy not in STRATEGIES:
            raise ValueError(f"unknown cast propagation strategy {self.cast_strategy!r}; expected one of {STRATEGIES}")

    @classmethod
    def from_options(cls, options: ORTTrainerOptions) -> GradientOptions:
        """`graph_transformer.propagate_cast_ops_config` and `utils.memory_efficient_gradient` of `options`. A
        strategy of None is NONE (no cast propagation)."""
        cast = options.graph_transformer.propagate_cast_ops_config
        strategy = "NONE" if cast.strategy is None else type(cast.strategy)(cast.strategy).name
        return cls(strategy, cast.level, tuple(cast.allow), options.utils.memory_efficient_gradient)

    @property
    def cast_propagation(self) -> CastPropagation:
        """The cast propagation settings, for orttrainer's own pass (the torch builder's graphs)."""
        return CastPropagation(self.cast_strategy, self.cast_level, self.cast_allow)

    def for_float32(self) -> GradientOptions:
        """These options on a model without float16 tensors: cast propagation is a no-op there, so ONNX Runtime's
        default configuration runs (its INSERT_AND_REDUCE would bring float16 into the float32 graph and fail with
        a type error at the first step; README § Mixed precision)."""
        return GradientOptions(memory_efficient=self.memory_efficient)

    @property
    def builtin_cast_propagation(self) -> bool:
        """The cast propagation `get_optimized_model` runs anyway (ONNX Runtime's default)."""
        return (self.cast_strategy, self.cast_level, self.cast_allow) == ("FLOOD_FILL", 1, ())

    @property
    def builtin(self) -> bool:
        """What `get_optimized_model` + `GradientGraphBuilder` do anyway (ONNX Runtime's defaults)."""
        return self.builtin_cast_propagation and not self.memory_efficient


def build_configured_gradient_graph(
    model: onnx.ModelProto, loss_name: str, trainable: list[str], state: list[str], options: GradientOptions
) -> onnx.ModelProto:
    """`model` (state tensors already graph inputs) -> model with the forward outputs and `<p>_grad` outputs.

    Raises whatever `OrtModuleGraphBuilder` raises (the caller explains it) or `GradientBuildError`."""
    builder = _graph_builder(model, loss_name, trainable, state, options.memory_efficient)
    builder.build(_transformer_configuration(options))
    graded = onnx.load_from_string(builder.get_gradient_model())
    _seed_loss_gradient(graded, loss_name, _elem_type(model, loss_name))
    produced = {out for node in graded.graph.node for out in node.output} | {i.name for i in graded.graph.input}
    missing = [o.name for o in model.graph.output if o.name not in produced]
    if missing:
        raise GradientBuildError(
            f"outputs {missing} do not depend on the loss; ONNX Runtime's configured gradient "
            "builder (cast propagation or memory-efficient gradient options) drops them"
        )
    forward_outputs = [o for o in model.graph.output]
    grads = list(graded.graph.output)
    del graded.graph.output[:]
    graded.graph.output.extend(forward_outputs + grads)
    return graded


def _graph_builder(
    model: onnx.ModelProto, loss_name: str, trainable: list[str], state: list[str], memory_efficient: bool
) -> Any:
    """An `OrtModuleGraphBuilder` initialised with `model` reduced to its loss output (the builder differentiates
    every graph output), `state` as initializers and `trainable` as the tensors to differentiate for."""
    loss_only = copy_model(model)
    del loss_only.graph.output[:]
    loss_only.graph.output.extend(o for o in model.graph.output if o.name == loss_name)
    return ort_private.module_graph_builder(loss_only.SerializeToString(), state, trainable, memory_efficient)


def _transformer_configuration(options: GradientOptions, pre_grad_path: str = "") -> Any:
    level = options.cast_level if options.cast_strategy != "NONE" else -1
    return ort_private.transformer_configuration(options.cast_strategy, level, options.cast_allow, pre_grad_path)


def _seed_loss_gradient(model: onnx.ModelProto, loss_name: str, elem_type: int) -> None:
    """Rule: `YieldOp(loss) -> loss_grad` is removed; `loss_grad` becomes the scalar constant 1."""
    yields = [n for n in model.graph.node if n.op_type == "YieldOp"]
    if len(yields) != 1 or list(yields[0].input) != [loss_name]:
        raise RuntimeError(f"expected one YieldOp reading {loss_name!r}, got {[list(n.input) for n in yields]}")
    seed = yields[0].output[0]
    model.graph.node.remove(yields[0])
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    model.graph.initializer.append(numpy_helper.from_array(np.array(1, dtype=dtype), seed))


def _elem_type(model: onnx.ModelProto, name: str) -> int:
    for value in model.graph.output:
        if value.name == name and value.type.tensor_type.elem_type:
            return value.type.tensor_type.elem_type
    return onnx.TensorProto.FLOAT


def pre_gradient_model(
    model: onnx.ModelProto, loss_name: str, trainable: list[str], state: list[str], options: GradientOptions
) -> onnx.ModelProto:
    """The forward model after ONNX Runtime's pre-training transformers under `options` (for tests and debugging:
    where cast propagation shows)."""
    builder = _graph_builder(model, loss_name, trainable, state, memory_efficient=False)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "pre_gradient.onnx")
        builder.build(_transformer_configuration(options, path))
        return onnx.load(path)
