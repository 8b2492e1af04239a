"""What building learns about the model's inputs and outputs, written into model_desc as the original did
(docs/legacy_api.md §3.4): dtypes, the loss-scale input and all-finite output under mixed precision; and the
checks on what the export produced (a scalar loss; `debug.check_model_export`)."""

from __future__ import annotations

import numpy as np
import onnx
import torch

from .._require import require
from ..dtypes import onnx_to_torch
from ..schema.model_desc import _ORTTrainerModelDesc
from .compile import CompiledModel, output_elem_types
from .config import TrainerConfig
from .export import DryRun
from .graph.editor import tensor_elem_type


def record_export_types(desc: _ORTTrainerModelDesc, exported: DryRun) -> None:
    """PyTorch model: input and output dtypes from the first batch and the dry run; the loss must be a scalar."""
    for i, dtype in enumerate(exported.input_dtypes):
        desc.add_type_to_input_description(i, dtype)
    for i, dtype in enumerate(exported.output_dtypes):
        desc.add_type_to_output_description(i, dtype)
    for output, value in zip(desc.outputs, exported.sample_outputs, strict=False):
        if output.is_loss and isinstance(value, torch.Tensor) and value.dim() != 0:
            raise ValueError(
                f"the loss output {output.name!r} must be a scalar (shape []), but the model returns "
                f"shape {list(value.shape)}; reduce it (e.g. mean) in the model or loss_fn"
            )


def record_graph_types(desc: _ORTTrainerModelDesc, model: onnx.ModelProto) -> None:
    """ONNX model: input and output dtypes come from the graph; every model_desc name must be in it."""
    graph = model.graph
    known = {v.name for v in list(graph.input) + list(graph.output)}
    for i, input_desc in enumerate(desc.inputs):
        require(input_desc.name in known, f"ONNX model with unknown input type ({input_desc.name})")
        desc.add_type_to_input_description(i, onnx_to_torch(tensor_elem_type(model, input_desc.name)))
    for i, output_desc in enumerate(desc.outputs):
        require(output_desc.name in known, f"ONNX model with unknown output type ({output_desc.name})")
        desc.add_type_to_output_description(i, onnx_to_torch(tensor_elem_type(model, output_desc.name)))


def describe_mixed_precision(config: TrainerConfig, compiled: CompiledModel) -> None:
    """Record the loss-scale input, the all-finite output and the float16 outputs in model_desc."""
    opts = config.options.mixed_precision
    if not opts.enabled:
        if opts.loss_scaler is not None:
            raise ValueError("Loss Scaler cannot be specified when Mixed Precision is not enabled")
        return
    desc, graph = config.model_desc, compiled.training
    if graph.loss_scale_input is None or graph.all_finite_output is None:  # compile adds both under mixed precision
        raise RuntimeError("the mixed-precision training graph has no loss-scale input or all-finite output")
    desc.loss_scale_input = graph.loss_scale_input
    desc.all_finite = graph.all_finite_output
    opts.loss_scaler.input_name = graph.loss_scale_input
    trained = compiled.step or compiled.training  # the torch route exports its eval graphs later
    types = {**output_elem_types(trained.model), **output_elem_types(compiled.eval_model)}
    for i, output in enumerate(desc.outputs):
        dtype = getattr(output, "dtype", None)  # set only once the type is known
        if dtype == torch.float32 and types.get(output.name) == onnx.TensorProto.FLOAT16:
            desc.add_type_to_output_description(i, dtype, torch.float16)


def check_model_export(output_names: list[str], results: dict[str, torch.Tensor], expected: list[torch.Tensor]) -> None:
    """debug.check_model_export: the exported graph (eval mode) must reproduce PyTorch's outputs."""
    for name, value in zip(output_names, expected, strict=False):
        try:
            np.testing.assert_allclose(results[name].cpu().numpy(), value.cpu().numpy(), rtol=1e-2, atol=1e-6)
        except AssertionError as err:
            raise AssertionError(
                f"Mismatch between outputs of PyTorch model and exported ONNX model for output {name!r}. Note "
                "that different backends may exhibit small computational differences. If this is within "
                "acceptable margin, or if there is random generator in the model causing inevitable mismatch, "
                f"you can proceed training by setting the flag debug.check_model_export to False.\n{err}"
            ) from err
