"""The pass lists of the compile pipeline, for `passes.run_passes`.

The compiler runs, in order: `forward_passes` (fix-ups the gradient builder needs, then under mixed precision
`mixed_precision_passes`) -> the gradient builder -> `gradient_model_passes` (and recompute,
`recompute.recompute_pass`) -> the training graph (`training.build_training_graph`, or with data parallelism
`data_parallel.build_gradient_step_graph` and `build_optimizer_graph`). The `debug.graph_save_paths` stages end
after the last pass of each list: the caller maps that pass's name to the path in `run_passes(save=...)`, and
saves the training graph with `passes.record_stage`.
"""

from __future__ import annotations

from .class_labels import GUARD_CLASS_LABELS
from .cross_entropy import CROSS_ENTROPY_AS_PLAIN_OPS
from .fixups import (
    BATCHNORM_TO_INFERENCE,
    DROPOUT_TO_IDENTITY,
    INFERENCE_BATCHNORM_TO_AFFINE,
    INFERENCE_DROPOUT_TO_IDENTITY,
    NAME_OPTIONAL_OUTPUTS,
)
from .mixed_precision import CAST_FP32_ONLY_KERNELS, append_loss_scale_pass, to_float16_pass
from .outputs import without_outputs_pass
from .passes import GraphPass
from .scatter_grad import GATHER_GRAD_TO_SCATTER_ADD
from .state_inputs import move_initializers_to_inputs_pass
from .switches import rewrite_enabled

__all__ = ["forward_passes", "gradient_model_passes", "mixed_precision_passes"]


def forward_passes(dropout_off: bool) -> list[GraphPass]:
    """Before the gradient graph: optional outputs named; an eval-mode module (`dropout_off`) trains without dropout
    and with BatchNorm on its running statistics, otherwise a Dropout without training mode is the identity it
    computes; inference-mode BatchNorm becomes its affine map (ONNX Runtime's gradient of it is wrong)."""
    dropout = [DROPOUT_TO_IDENTITY, BATCHNORM_TO_INFERENCE] if dropout_off else [INFERENCE_DROPOUT_TO_IDENTITY]
    return [NAME_OPTIONAL_OUTPUTS, *dropout, INFERENCE_BATCHNORM_TO_AFFINE]


def mixed_precision_passes(state: list[str], keep_float32: list[str], loss: str) -> list[GraphPass]:
    """Mixed precision before the gradient graph: the state becomes graph inputs (so it stays float32), the rest
    float16, then the scaled loss is appended (`mixed_precision.loss_scale_names` reads its names back)."""
    return [move_initializers_to_inputs_pass(state), to_float16_pass(keep_float32), append_loss_scale_pass(loss)]


def gradient_model_passes(*, mixed_precision: bool, cpu: bool, scaled_loss: str) -> list[GraphPass]:
    """On the gradient model (forward outputs + `<p>_grad`), the same for both builders and every input-shape
    signature: under mixed precision the scaled loss stops being an output and (CPU) float32-only kernels get
    casts; embedding gradients become scatter-adds; on the CPU in float32, softmax cross-entropy becomes plain ops
    (graph/cross_entropy.py, switchable: graph/switches.py); class labels are range-checked (graph/class_labels.py)."""
    passes: list[GraphPass] = []
    if mixed_precision:
        passes.append(without_outputs_pass([scaled_loss]))
        if cpu:
            passes.append(CAST_FP32_ONLY_KERNELS)
    passes.append(GATHER_GRAD_TO_SCATTER_ADD)
    if cpu and not mixed_precision and rewrite_enabled("cross_entropy_as_plain_ops"):
        passes.append(CROSS_ENTROPY_AS_PLAIN_OPS)
    passes.append(GUARD_CLASS_LABELS)  # labels range-checked as PyTorch does (graph/class_labels.py)
    return passes
