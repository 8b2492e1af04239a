"""Which option values this build can honour, and small type conversions shared by the trainer.

An option is never accepted and then silently ignored: a value the trainer cannot honour raises
`NotImplementedError` naming the option and what to do instead.
"""

from __future__ import annotations

import torch
from onnx import TensorProto

# option path -> (predicate on the value that means "cannot be honoured", what to do instead)
_UNSUPPORTED = {
    "distributed.horizontal_parallel_size": (lambda v: v > 1, "use data parallelism or a single process"),
    "distributed.pipeline_parallel.pipeline_parallel_size": (lambda v: v > 1, "use a single pipeline stage"),
    "distributed.pipeline_parallel.num_pipeline_micro_batches": (lambda v: v > 1, "use gradient accumulation"),
    "distributed.pipeline_parallel.pipeline_cut_info_string": (bool, "leave it empty (no pipeline parallelism)"),
    "distributed.pipeline_parallel.sliced_schema": (bool, "leave it empty (no pipeline parallelism)"),
    "distributed.pipeline_parallel.sliced_axes": (bool, "leave it empty (no pipeline parallelism)"),
    "distributed.pipeline_parallel.sliced_tensor_names": (bool, "leave it empty (no pipeline parallelism)"),
}


def check_supported_options(options) -> None:
    """Raise NotImplementedError for the first option value this build cannot honour."""
    for path, (unsupported, instead) in _UNSUPPORTED.items():
        value = _lookup(options._validated_opts, path)
        if unsupported(value):
            raise NotImplementedError(f"options {path}={value!r} is not supported by this orttrainer build; {instead}.")
    recompute_plan(options)


def recompute_plan(options):
    """`graph_transformer`'s recompute flags as a `RecomputePlan` (graph/recompute.py)."""
    from .graph.recompute import RecomputePlan

    gt = options.graph_transformer
    if gt.number_recompute_layers > 0 and not gt.transformer_layer_recompute:
        raise ValueError(
            f"options graph_transformer.number_recompute_layers={gt.number_recompute_layers} only takes "
            "effect with graph_transformer.transformer_layer_recompute=True"
        )
    layers = gt.number_recompute_layers if gt.transformer_layer_recompute else None
    return RecomputePlan(gelu=gt.gelu_recompute, attention_dropout=gt.attn_dropout_recompute, layers=layers)


def gradient_options(options):
    """`graph_transformer.propagate_cast_ops_config` and `utils.memory_efficient_gradient` as the `ort` gradient
    builder's `GradientOptions` (graph/gradient_options.py). A strategy of None is NONE (no cast propagation)."""
    from .graph.gradient_options import GradientOptions

    cast = options.graph_transformer.propagate_cast_ops_config
    strategy = "NONE" if cast.strategy is None else type(cast.strategy)(cast.strategy).name
    return GradientOptions(strategy, cast.level, tuple(cast.allow), options.utils.memory_efficient_gradient)


def check_data_parallel_options(options, world_size: int) -> None:
    """Distributed options that only make sense together (checked once the world size is known)."""
    dist = options.distributed
    if dist.data_parallel_size not in (1, world_size):
        raise ValueError(
            f"options distributed.data_parallel_size={dist.data_parallel_size} must equal the world size "
            f"({world_size}): every rank is a data-parallel rank"
        )
    if dist.enable_adasum:
        from .distributed import check_adasum_world_size

        check_adasum_world_size(world_size)
        if not dist.allreduce_post_accumulation and options.batch.gradient_accumulation_steps > 1:
            raise NotImplementedError(
                "options distributed.enable_adasum with allreduce_post_accumulation=False and gradient accumulation: "
                "Adasum combines each rank's accumulated gradient once per optimizer step; set "
                "distributed.allreduce_post_accumulation=True"
            )


def _lookup(tree: dict, path: str):
    value = tree
    for key in path.split("."):
        value = value[key]
    return value


_ONNX_TO_TORCH = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.DOUBLE: torch.float64,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.INT8: torch.int8,
    TensorProto.UINT8: torch.uint8,
    TensorProto.INT16: torch.int16,
    TensorProto.INT32: torch.int32,
    TensorProto.INT64: torch.int64,
    TensorProto.BOOL: torch.bool,
    TensorProto.COMPLEX64: torch.complex64,
    TensorProto.COMPLEX128: torch.complex128,
}


def onnx_to_torch_dtype(elem_type: int) -> torch.dtype:
    """ONNX element type -> torch dtype (unlike the legacy helper, UINT8 maps to uint8 and BFLOAT16 works)."""
    if elem_type not in _ONNX_TO_TORCH:
        raise ValueError(f"ONNX element type {TensorProto.DataType.Name(elem_type)} has no torch equivalent")
    return _ONNX_TO_TORCH[elem_type]
