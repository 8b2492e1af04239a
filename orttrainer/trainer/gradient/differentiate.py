"""Run the chosen gradient builder on a forward model: 'auto''s fallback, and parameters that do not reach the loss.

Rules:
- 'ort' runs ONNX Runtime's builder on the forward model; 'torch' traces the PyTorch module; 'auto' means 'ort'
  here. When ONNX Runtime has no gradient for an op, the `GradientBuildError` names it (`op_type`): for a PyTorch
  model, 'auto' then builds again on the torch route (`build.build_from_torch`), whose state and eval graph come
  from the module rather than from the TorchScript export.
- A parameter without a differentiable path to the loss is frozen, with a warning naming it, and the builder runs
  again without it — PyTorch leaves its `.grad` None and its optimizers skip it.
- A buffer the forward updates in place becomes frozen state when it was not (the torch builder finds them in its
  trace: BatchNorm's `num_batches_tracked`); the result carries its value (`added_state`).
Nothing passed in is modified: the result carries the final trainable and frozen lists.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch

from ..graph.passes import rewrite_enabled
from .choice import BuilderChoice
from .errors import GradientBuildError
from .ort_builder import build_ort_gradient_graph
from .ort_options import GradientOptions
from .torch_graphs import Accepts, TorchGradientModel, TorchSource, torch_gradient_model


@dataclass(frozen=True)
class GradientRequest:
    """What a gradient builder needs: the forward model ('ort'), or the module and a first batch ('torch')."""

    forward: onnx.ModelProto
    loss_name: str  # the loss 'ort' differentiates (under mixed precision: the scaled loss)
    outputs: list[str]  # model_desc outputs, loss first
    trainable: list[str]
    frozen: list[str]
    choice: BuilderChoice
    gradient_options: GradientOptions | None = None
    torch_source: TorchSource | None = None
    sample_inputs: Sequence[torch.Tensor] | None = None


@dataclass(frozen=True)
class Differentiated:
    """The gradient model, the builder that made it (and why), and the final parameter lists."""

    model: onnx.ModelProto
    builder: BuilderChoice
    trainable: list[str]
    frozen: list[str]
    accepts: Accepts | None = None  # torch builder: which inputs the model is valid for (None: any)
    added_state: dict[str, np.ndarray] = field(default_factory=dict)  # frozen buffers the builder added
    branches_on_values: bool = False  # torch builder: `accepts` checks values too (TorchGradientModel)


def differentiate(request: GradientRequest) -> Differentiated:
    """The gradient model of `request` by the rules above."""
    if request.choice.builder == "torch":
        return _freezing_unreachable(request, _torch_builder, request.choice)
    return _freezing_unreachable(request, _ort_builder, _ort_choice(request.choice))


def _ort_choice(choice: BuilderChoice) -> BuilderChoice:
    if choice.builder == "auto":
        return BuilderChoice("ort", "auto: no custom torch.autograd.Function, and ONNX Runtime differentiates every op")
    return choice


def _ort_builder(request: GradientRequest, trainable: list[str], frozen: list[str]) -> onnx.ModelProto:
    return build_ort_gradient_graph(
        request.forward, request.loss_name, trainable, trainable + frozen, request.gradient_options
    )


def _torch_builder(request: GradientRequest, trainable: list[str], frozen: list[str]) -> Built:
    if request.torch_source is None or request.sample_inputs is None:
        raise ValueError("the torch gradient builder needs the PyTorch module and a first batch")
    # the first graph is traced for the first batch's shapes (faster to trace and to run); the compiler traces
    # the graphs of other shapes, the dynamic-dims one among them (compile/compiler.TorchShapeGraphs)
    dynamic = not rewrite_enabled("static_shapes")
    return torch_gradient_model(
        request.torch_source, request.sample_inputs, request.outputs, trainable, trainable + frozen, dynamic=dynamic
    )


Built = onnx.ModelProto | TorchGradientModel
Builder = Callable[[GradientRequest, list[str], list[str]], Built]


def _freezing_unreachable(request: GradientRequest, build: Builder, choice: BuilderChoice) -> Differentiated:
    trainable, frozen = list(request.trainable), list(request.frozen)
    while True:
        try:
            built = build(request, trainable, frozen)
            if isinstance(built, onnx.ModelProto):
                return Differentiated(built, choice, trainable, frozen)
            added = {name: value.numpy() for name, value in built.added_state.items()}
            return Differentiated(
                built.model, choice, trainable, frozen + list(added), built.accepts, added, built.branches_on_values
            )
        except GradientBuildError as err:
            if not err.unreachable or not set(err.unreachable) <= set(trainable):
                raise
            warnings.warn(
                f"parameters {err.unreachable} do not influence the loss; they are not trained "
                "(as PyTorch leaves their gradient None)",
                stacklevel=2,
            )
            trainable = [p for p in trainable if p not in err.unreachable]
            frozen = frozen + err.unreachable
