"""The torch path's forward model, without the TorchScript exporter: the module (+ loss) in eval mode, traced with
torch.export and written by torch.onnx (`dynamo=True`). It is the eval graph, what `debug.check_model_export` runs
and what `save_as_onnx` writes; the training graph comes from the torch gradient builder.

Rules:
- Graph: data inputs named as model_desc, outputs the model_desc outputs (loss first), the module's state as
  initializers named like its parameters and buffers (no `model.` prefix; tied parameters once, under their first
  name); plain tensor attributes and the loss function's state are constants. model_desc's string dims are dynamic
  where the trace allows it (torch.export's `Dim.AUTO`), within the ranges the trace found; a dim the model
  specialises is static, and `TorchEvalGraphs` exports another eval graph for inputs the first does not accept.
- Mode: traced in eval mode (dropout off, BatchNorm on running statistics), whatever mode the module trains in
  (legacy save_as_onnx wrote the training-mode graph: see README § Gradient builders).
- State, from the module itself (`export.exported_model`): the trainable parameters are its `requires_grad`
  parameters — each one an initializer even when the eval graph does not read it, so a parameter the torch
  builder differentiates is never dropped by an export (one without a gradient is frozen with a warning by
  `gradient/differentiate.py`); the frozen state is the other state_dict entries the eval graph reads; the rest
  are aliases (tied names) or unused state.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import onnx
import torch
from onnx import numpy_helper

from .compile import build_eval_model
from .export import MODEL_PREFIX, DryRun, ExportedModel, _ModelWithLoss, exported_model, set_initializers, strip_prefix
from .gradient import torch_private
from .gradient.torch_builder import MAX_ORT_OPSET
from .gradient.torch_private import DimSpec
from .gradient.torch_trace import flatten_tensors
from .session import EvalGraph
from .shapes import ShapeKeyedCache

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardSource:
    """What the eval-mode forward is traced from: `_ModelWithLoss(module, loss_fn, input_names)`, its first
    len(output_names) flattened outputs, the dims of each input that may stay dynamic, the ONNX opset."""

    module: torch.nn.Module
    loss_fn: Callable | None
    input_names: list[str]
    output_names: list[str]
    dynamic_dims: list[list[int]]
    opset_version: int


class _EvalForward(_ModelWithLoss):
    """`_ModelWithLoss` returning its first `count` output tensors, flattened."""

    def __init__(self, source: ForwardSource) -> None:
        super().__init__(source.module, source.loss_fn, source.input_names)
        self.count = len(source.output_names)

    def forward(self, *inputs):
        return tuple(flatten_tensors(super().forward(*inputs))[: self.count])


def export_forward(
    source: ForwardSource, inputs: Sequence[torch.Tensor], dynamic: bool = True
) -> tuple[onnx.ModelProto, list[list[DimSpec]]]:
    """The eval-mode forward model for `inputs` (their shapes only, unless `dynamic`), with the module's current
    state values in its initializers, and its data inputs' dims (a size, or a dynamic dim's range). Raises
    RuntimeError naming the model when torch.export cannot trace it."""
    module = source.module
    opset = min(max(source.opset_version, torch_private.MIN_DYNAMO_OPSET), MAX_ORT_OPSET)
    dims = source.dynamic_dims if dynamic else [[] for _ in inputs]
    try:
        with _eval_mode(module):
            model, specs = torch_private.export_module_to_onnx(
                _EvalForward(source),
                [t.detach() for t in inputs],
                source.input_names,
                source.output_names,
                opset,
                dims,
            )
    except Exception as err:
        raise RuntimeError(
            f"torch.export could not trace the eval-mode forward of {type(module).__name__} (the torch path's eval "
            f"graph, also used by save_as_onnx and debug.check_model_export): {type(err).__name__}: {err}"
        ) from err
    model = strip_prefix(model, MODEL_PREFIX)
    state = {n: t.detach() for n, t in [*module.named_parameters(), *module.named_buffers()]}
    return set_initializers(model, state), specs


def export_torch_forward(
    source: ForwardSource, inputs: Sequence[torch.Tensor], dry: DryRun
) -> tuple[ExportedModel, list[list[DimSpec]]]:
    """The forward model and what it and the module say about the state (module docstring), and the dims of
    its data inputs (see `export_forward`)."""
    model, specs = export_forward(source, inputs)
    present = {i.name for i in model.graph.initializer}
    for name, param in source.module.named_parameters():
        if param.requires_grad and name not in present:  # not read in eval mode: still trained
            model.graph.initializer.append(numpy_helper.from_array(param.detach().cpu().numpy(), name))
    return exported_model(model, source.module, dry), specs


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def accepts(dims: Sequence[Sequence[DimSpec]], dtypes: Sequence[torch.dtype], inputs: Sequence[torch.Tensor]) -> bool:
    """Rule: `inputs` fit a graph whose data inputs have `dims` (a size, or a dynamic dim's range) and `dtypes`."""
    if len(inputs) != len(dims):
        return False
    for shape, dtype, tensor in zip(dims, dtypes, inputs, strict=True):
        if tensor.dtype != dtype or len(shape) != tensor.dim():
            return False
        for spec, actual in zip(shape, tensor.shape, strict=True):
            low, high = (spec, spec) if isinstance(spec, int) else spec
            if actual < low or (high is not None and actual > high):
                return False
    return True


@dataclass(frozen=True)
class EvalShapes:
    """What the first eval graph accepts (its data inputs' dims and dtypes) and what exports others."""

    source: ForwardSource
    dims: list[list[DimSpec]]
    dtypes: list[torch.dtype]


class TorchEvalGraphs:
    """The torch path's eval graphs (`session.EvalGraphs`): `first` for every input its dims accept; for other
    inputs (a dim the model specialised), an eval graph exported for their shapes, logged at INFO and kept."""

    def __init__(self, shapes: EvalShapes, first: onnx.ModelProto, state: list[str]) -> None:
        self.first = EvalGraph(first, list(shapes.source.input_names))
        self._source, self._state = shapes.source, list(state)
        self._dims, self._dtypes = shapes.dims, shapes.dtypes
        self._others: ShapeKeyedCache[EvalGraph] = ShapeKeyedCache(16)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> EvalGraph:
        if accepts(self._dims, self._dtypes, inputs):
            return self.first
        return self._others.get_or_build(inputs, lambda: self._build(inputs))

    def _build(self, inputs: Sequence[torch.Tensor]) -> EvalGraph:
        _logger.info(
            "exporting an eval graph for the input shapes %s (the first one's trace specialised a dim of model_desc)",
            [list(t.shape) for t in inputs],
        )
        model, _ = export_forward(self._source, inputs, dynamic=False)
        return EvalGraph(build_eval_model(model, self._state, self._source.output_names), self.first.data_inputs)
