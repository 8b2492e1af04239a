"""The compile pipeline, declared once: every list of graph passes, in the order `compile/compiler.compile_model`
runs them (its stages carry the same numbers).

1. `forward_passes`: the fix-ups the gradient builder needs (optional outputs named; BatchNorm's running statistics
   updated by the graph, for the 'ort' builder, whose own update writes into the state; an eval-mode module trains
   without dropout and with BatchNorm on its running statistics; a Dropout without training mode is the identity it
   computes; inference-mode BatchNorm becomes its affine map), then under mixed precision for the 'ort' builder
   `mixed_precision_passes` (state as graph inputs, float16, the scaled loss appended). The torch builder traces
   the module in float16 with the loss scale itself (build/torch_route.py), so its forward gets no such passes.
2. The gradient builder (gradient/differentiate.py): not a pass over the forward model, since the torch builder
   traces the PyTorch module (or an OnnxModule of the forward model) itself.
3. `gradient_passes`: on the gradient model (forward outputs + `<p>_grad`), the same for both builders and every
   input-shape signature: under mixed precision the scaled loss stops being an output and (CPU) float32-only kernels
   get casts; (CPU) the 'ort' builder's convolution gradients take forms ONNX Runtime's kernel computes right
   (explicit pads for auto_pad SAME; grouped ones of one or three spatial axes inside their output:
   graph/conv_grad.py); the 'ort' builder's lookups of an embedding's padding row add nothing to its gradient
   (graph/embedding_padding.py); embedding gradients become scatter-adds; slice gradients placed by one-hot `Where`s
   become a `Concat`; a gradient summed over a weight's uses, one matrix product per use, becomes one product; a
   reduction over axes of size 1 becomes its input; on the CPU in float32, softmax cross-entropy becomes plain ops;
   then recompute (the 'ort' builder's; the torch builder recomputes in its trace, gradient/torch_recompute.py) and
   the activation statistics.
4. `training_tail`: accumulation, clipping and the optimizer update as one pass whose result carries its state
   contract (graph/training.py, compile/contract.py); with data parallelism, the gradient-step pass (the optimizer
   graph is a model of its own, graph/data_parallel.build_optimizer_graph).
5. `eval_passes`: the eval graph (state as graph inputs, dropout off, BatchNorm on running statistics, the
   model_desc outputs), under mixed precision from the float16 forward, then its statistics.

The `debug.graph_save_paths` stages end after the last pass of stages 1, 3 and 4 (`run_passes(save=...)`).

Not a compile stage: on the CPU, each session's graph gets its convolutions in ONNX Runtime's blocked channel layout
when the session is created (graph/nchwc.py, from runtime/ort.create_session), since the layout depends on the CPU
that runs it and the compiled graphs are cached for any CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import onnx

from .batch_norm_statistics import BatchNormStatistics, batch_norm_statistics_pass
from .cast_propagation import CastPropagation, cast_propagation_pass
from .class_labels import GUARD_CLASS_LABELS
from .conv_grad import CONV_GRAD_IN_SAFE_FORM
from .cross_entropy import CROSS_ENTROPY_AS_PLAIN_OPS
from .data_parallel import gradient_step_pass
from .embedding_padding import padding_rows_pass
from .fixups import (
    BATCHNORM_TO_INFERENCE,
    DROPOUT_TO_IDENTITY,
    INFERENCE_BATCHNORM_TO_AFFINE,
    INFERENCE_DROPOUT_TO_IDENTITY,
    NAME_OPTIONAL_OUTPUTS,
)
from .mixed_precision import CAST_FP32_ONLY_KERNELS, append_loss_scale_pass, to_float16_pass
from .outputs import keep_outputs_pass, without_outputs_pass
from .passes import FunctionPass, GraphPass, rewrite_enabled, run_passes
from .recompute import RecomputePlan, recompute_pass
from .scatter_grad import GATHER_GRAD_TO_SCATTER_ADD
from .state_inputs import move_initializers_to_inputs_pass
from .static_shapes import DROP_NOOP_REDUCTIONS, WHERE_SUM_TO_CONCAT
from .summed_uses import SUMMED_USES_TO_ONE
from .training import training_tail_pass

__all__ = [
    "StatisticsInstrument",
    "build_eval_model",
    "eval_passes",
    "forward_passes",
    "gradient_model_passes",
    "gradient_passes",
    "mixed_precision_passes",
    "training_tail",
]


class StatisticsInstrument(Protocol):
    """Appends activation-statistics outputs to a gradient model ('train') or an eval model ('eval')
    (trainer/activations.py)."""

    def instrument(self, model: onnx.ModelProto, kind: str) -> onnx.ModelProto: ...


def forward_passes(dropout_off: bool, batch_norms: list[BatchNormStatistics] | None = None) -> list[GraphPass]:
    """Before the gradient graph: optional outputs named; the running statistics of `batch_norms` updated by the
    graph itself (graph/batch_norm_statistics.py); an eval-mode module (`dropout_off`) trains without dropout
    and with BatchNorm on its running statistics, otherwise a Dropout without training mode is the identity it
    computes; inference-mode BatchNorm becomes its affine map (ONNX Runtime's gradient of it is wrong)."""
    dropout = [DROPOUT_TO_IDENTITY, BATCHNORM_TO_INFERENCE] if dropout_off else [INFERENCE_DROPOUT_TO_IDENTITY]
    statistics = [batch_norm_statistics_pass(batch_norms)] if batch_norms and not dropout_off else []
    return [NAME_OPTIONAL_OUTPUTS, *statistics, *dropout, INFERENCE_BATCHNORM_TO_AFFINE]


def mixed_precision_passes(state: list[str], keep_float32: list[str], loss: str) -> list[GraphPass]:
    """Mixed precision before the gradient graph: the state becomes graph inputs (so it stays float32), the rest
    float16, then the scaled loss is appended (`mixed_precision.loss_scale_names` reads its names back)."""
    return [move_initializers_to_inputs_pass(state), to_float16_pass(keep_float32), append_loss_scale_pass(loss)]


def gradient_model_passes(
    *,
    mixed_precision: bool,
    cpu: bool,
    scaled_loss: str,
    cast_propagation: CastPropagation | None = None,
    embedding_padding: Mapping[str, int] | None = None,
) -> list[GraphPass]:
    """On the gradient model (forward outputs + `<p>_grad`), the same for both builders and every input-shape
    signature: under mixed precision the scaled loss stops being an output; with `cast_propagation` (the torch
    builder: ONNX Runtime's builder propagates casts itself) the casts move by its rules (graph/cast_propagation.py;
    a float32 graph is unchanged); under mixed precision (CPU) float32-only kernels get casts; on the CPU the 'ort'
    builder's `ConvGrad` gets explicit pads for auto_pad SAME and, grouped with one or three spatial axes, a form
    whose kernel writes only its output (graph/conv_grad.py: ONNX Runtime's kernel is wrong otherwise); with
    `embedding_padding` (the 'ort' builder's nn.Embedding weights with a padding_idx) the lookups of the padding row
    add nothing to its gradient (graph/embedding_padding.py); embedding gradients
    become scatter-adds; the gradient of slices x[0], ..., x[n-1] placed by one-hot `Where`s and added (the torch
    builder's q/k/v projection) becomes a `Concat` (graph/static_shapes.py); a sum of matrix products over the
    same shape (a weight's gradient over its uses: an RNN's recurrent weight) becomes one product
    (graph/summed_uses.py); a reduction over axes of size 1 becomes its input (graph/static_shapes.py); on the
    CPU in float32, softmax cross-entropy becomes plain ops
    (graph/cross_entropy.py; each switchable: graph/passes.rewrite_enabled); class labels are range-checked
    (graph/class_labels.py)."""
    passes: list[GraphPass] = []
    if mixed_precision:
        passes.append(without_outputs_pass([scaled_loss]))
    if cast_propagation is not None and not cast_propagation.off:
        passes.append(cast_propagation_pass(cast_propagation))
    if mixed_precision:
        if cpu:
            passes.append(CAST_FP32_ONLY_KERNELS)
    if cpu:
        passes.append(CONV_GRAD_IN_SAFE_FORM)
    if embedding_padding:
        passes.append(padding_rows_pass(embedding_padding))
    passes.append(GATHER_GRAD_TO_SCATTER_ADD)
    if rewrite_enabled("where_sum_to_concat"):
        passes.append(WHERE_SUM_TO_CONCAT)
    if rewrite_enabled("summed_uses_to_one"):
        passes.append(SUMMED_USES_TO_ONE)
    if rewrite_enabled("noop_reductions"):
        passes.append(DROP_NOOP_REDUCTIONS)
    if cpu and not mixed_precision and rewrite_enabled("cross_entropy_as_plain_ops"):
        passes.append(CROSS_ENTROPY_AS_PLAIN_OPS)
    passes.append(GUARD_CLASS_LABELS)  # labels range-checked as PyTorch does (graph/class_labels.py)
    return passes


def gradient_passes(
    *,
    mixed_precision: bool,
    cpu: bool,
    scaled_loss: str,
    outputs: list[str],
    recompute: RecomputePlan,
    statistics: StatisticsInstrument | None,
    cast_propagation: CastPropagation | None = None,
    embedding_padding: Mapping[str, int] | None = None,
) -> list[GraphPass]:
    """`gradient_model_passes`, then recompute (an empty plan for the torch builder, which recomputes in its trace)
    and statistics."""
    passes = gradient_model_passes(
        mixed_precision=mixed_precision,
        cpu=cpu,
        scaled_loss=scaled_loss,
        cast_propagation=cast_propagation,
        embedding_padding=embedding_padding,
    )
    if recompute:
        passes.append(recompute_pass(outputs, recompute))
    if statistics is not None:
        passes.append(_statistics_pass("statistics", statistics.instrument, "train"))
    return passes


def training_tail(*, data_parallel: bool, accumulate: bool, **arguments: Any) -> GraphPass:
    """The pass that ends a training graph: the training tail (`training.training_tail_pass`, with `arguments` of
    `build_training_graph`), or with data parallelism the gradient step (`data_parallel.gradient_step_pass`;
    `accumulate`: the gradients are summed over the window in the graph)."""
    if not data_parallel:
        return training_tail_pass(**arguments)
    step = {k: arguments[k] for k in ("data_inputs", "outputs", "trainable", "loss_scale_input")}
    return gradient_step_pass(accumulate=accumulate, **step)


def eval_passes(
    state: list[str], outputs: list[str], statistics: StatisticsInstrument | None = None
) -> list[GraphPass]:
    """The eval graph: the `state` initializers become graph inputs (fed per step, like the training graph's), every
    Dropout an Identity, BatchNormalization runs on its running statistics, only the graph outputs in `outputs`
    (the model_desc outputs) remain, in the graph's order, and the class labels of its losses are range-checked
    (graph/class_labels.py); then its statistics."""
    passes: list[GraphPass] = [
        move_initializers_to_inputs_pass(state),
        DROPOUT_TO_IDENTITY,
        BATCHNORM_TO_INFERENCE,
        keep_outputs_pass(outputs),
        GUARD_CLASS_LABELS,
    ]
    if statistics is not None:
        passes.append(_statistics_pass("statistics_eval", statistics.instrument, "eval"))
    return passes


def eval_forward_passes(state: list[str], keep_float32: list[str]) -> list[GraphPass]:
    """Under mixed precision, the forward model the eval graph starts from is converted to float16 like
    training's."""
    return [move_initializers_to_inputs_pass(state), to_float16_pass(keep_float32)]


def build_eval_model(forward: onnx.ModelProto, state: list[str], outputs: list[str]) -> onnx.ModelProto:
    """Rule: the forward graph for `eval_step` (`eval_passes` without statistics). `forward` is not modified.

    Precondition: those of the passes: in particular, every name in `outputs` is a graph output and no Dropout mask
    or BatchNormalization running statistic is read."""
    return run_passes(forward, eval_passes(state, outputs))


def _statistics_pass(name: str, instrument: Callable[[onnx.ModelProto, str], onnx.ModelProto], kind: str) -> GraphPass:
    return FunctionPass(name, lambda model: instrument(model, kind))
