"""Every private or version-sensitive PyTorch API the `torch` gradient builder uses, behind small functions:
`tracing.py` (AOTAutograd, checkpoints, error texts), `decompositions.py` (the one table of decompositions the
builder traces with, and why) and `exporting.py` (torch.onnx's dynamo exporter).

Rule: nothing else in orttrainer imports from `torch._*`, reads private attributes of torch objects, or matches
torch's error texts; it calls these wrappers. A torch upgrade that moves or changes one of them then breaks this
package (and `tests/test_torch_private.py`, which pins each wrapper's behaviour), not the gradient builder.

Verified on torch 2.13.0 (CPU) with onnxscript 0.7.2 and onnx 1.17.0.
"""

from __future__ import annotations

from .decompositions import (
    TABLE,
    Entry,
    autograd_decompositions,
    core_aten_decompositions,
    pytorch_decomposition,
    trace_decompositions,
    training_decompositions,
)
from .exporting import (
    MIN_DYNAMO_OPSET,
    DimSpec,
    _quiet_exporter,
    export_graph_to_onnx,
    export_module_to_onnx,
    failed_node,
    has_translation,
    onnx_decompositions,
    record_node,
    unsupported_at_opset,
    untranslated_op,
    views_as_reshapes,
)
from .tracing import (
    JointSignature,
    MissingGradientError,
    SavedTensorDroppedError,
    ShapeGuards,
    aot_export_forward,
    aot_export_joint,
    aot_export_joint_dynamic,
    autograd_function_of_frame,
    backward_hooks_outside,
    causal_mask_detection_off,
    causal_mask_from_hint,
    dataflow_digest,
    export_tracing_flags,
    is_data_dependent_error,
    is_missing_gradient_error,
    is_real_tensor_in_trace_error,
    linalg_checks_untraced,
    math_sdpa,
    module_state_kept,
    no_mkldnn,
    output_values,
    reentrant_checkpoint_traceable,
    saved_tensors_dropped,
    storage_reads,
    traceable_cumulative_batch_norm,
    user_frame,
)

__all__ = [
    "MIN_DYNAMO_OPSET",
    "TABLE",
    "Entry",
    "autograd_decompositions",
    "DimSpec",
    "JointSignature",
    "MissingGradientError",
    "SavedTensorDroppedError",
    "ShapeGuards",
    "_quiet_exporter",
    "aot_export_forward",
    "aot_export_joint",
    "aot_export_joint_dynamic",
    "autograd_function_of_frame",
    "backward_hooks_outside",
    "causal_mask_detection_off",
    "causal_mask_from_hint",
    "core_aten_decompositions",
    "pytorch_decomposition",
    "dataflow_digest",
    "export_tracing_flags",
    "export_graph_to_onnx",
    "export_module_to_onnx",
    "failed_node",
    "has_translation",
    "is_data_dependent_error",
    "is_missing_gradient_error",
    "is_real_tensor_in_trace_error",
    "linalg_checks_untraced",
    "math_sdpa",
    "module_state_kept",
    "no_mkldnn",
    "onnx_decompositions",
    "output_values",
    "reentrant_checkpoint_traceable",
    "saved_tensors_dropped",
    "storage_reads",
    "traceable_cumulative_batch_norm",
    "trace_decompositions",
    "unsupported_at_opset",
    "training_decompositions",
    "user_frame",
    "record_node",
    "untranslated_op",
    "views_as_reshapes",
]
