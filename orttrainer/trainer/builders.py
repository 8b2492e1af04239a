"""Which gradient builder differentiates a model, and the `torch` builder inside the compiler.

Choice (`_internal_use.gradient_builder`, see `choose_builder`): 'ort' is ONNX Runtime's C++ builder on the exported
ONNX graph; 'torch' traces PyTorch's own autograd (`graph.gradient_torch`); 'auto' (the default) takes 'torch' for a
model with a custom `torch.autograd.Function` (the exporter inlines its forward, so only the torch builder keeps the
user's backward) and otherwise tries 'ort', falling back to 'torch' when ONNX Runtime has no gradient for an op.

Torch builder rules:
- State: the traced graph takes every parameter and buffer of the module; the session feeds the trainer's state
  (the tensors the exported forward uses). Other state inputs become constants or disappear (`bind_foreign_state`).
- Shapes: a traced graph is valid only for the input shapes and dtypes it was traced with. `TorchGraphs` returns
  the training graph (data parallel: the gradient-step graph) for a batch's shape signature, tracing and compiling
  a new one the first time a signature appears. Every graph has the same state contract (weights, moments,
  accumulation buffers and their shapes; checked), so all of them run on one set of state values.
- Mode: the module is traced in the train/eval mode it had when the trainer first saw it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import onnx
import torch
from onnx import numpy_helper

from ..debug.subscriber import no_increase_global_step
from .graph.gradient_torch import build_torch_gradient_graph, shape_signature

logger = logging.getLogger(__name__)

OPTION = "_internal_use.gradient_builder"


@dataclass(frozen=True)
class BuilderChoice:
    """`builder`: 'ort', 'torch', or 'auto' before compiling (try 'ort', fall back to 'torch' on an op without an
    ORT gradient); after compiling, the builder that made the graph. `reason`: why, for the log."""

    builder: str
    reason: str


def ort_only_options(options) -> list[str]:
    """The options set in `options` (an ORTTrainerOptions) that transform the exported ONNX graph, which only the
    'ort' builder trains from; recompute, cast propagation other than ONNX Runtime's default and memory-efficient
    gradients act on ONNX Runtime's gradient graph. (The trainer adds 'orttrainer.debug statistics' when a
    StatisticsSubscriber's manager is subscribed to the model: the statistics are outputs of the exported graph's
    marked tensors.)"""
    from .support import gradient_options

    graph = options.graph_transformer
    cast_propagation = not gradient_options(options).builtin_cast_propagation
    checks = (
        ("_internal_use.extra_postprocess", options._internal_use.extra_postprocess is not None),
        ("mixed_precision.enabled", bool(options.mixed_precision.enabled)),
        ("graph_transformer.gelu_recompute", graph.gelu_recompute),
        ("graph_transformer.attn_dropout_recompute", graph.attn_dropout_recompute),
        ("graph_transformer.transformer_layer_recompute", graph.transformer_layer_recompute),
        ("graph_transformer.propagate_cast_ops_config", cast_propagation),
        ("utils.memory_efficient_gradient", options.utils.memory_efficient_gradient),
    )
    return [name for name, is_set in checks if is_set]


def choose_builder(
    option: str, *, onnx_model: bool = False, custom_functions: Sequence[str] = (), ort_only: Sequence[str] = ()
) -> BuilderChoice:
    """Rules, in order:
    - an ONNX model uses 'ort' ('torch' is a ValueError: the torch builder traces a `torch.nn.Module`);
    - `ort_only` features (see `ort_only_options`) need 'ort': with them 'torch' is a NotImplementedError (so is
      'auto' with custom Functions), and 'auto' means 'ort';
    - 'ort' with custom Functions is a NotImplementedError naming them (their backward would be ignored);
    - 'torch', and 'auto' with custom Functions, mean 'torch'; 'auto' otherwise stays 'auto'."""
    functions, ort_only = list(custom_functions), list(ort_only)
    if onnx_model:
        if option == "torch":
            raise ValueError(
                f"options {OPTION}='torch' needs a torch.nn.Module (it traces PyTorch's autograd), but "
                "the model is an ONNX model; use 'ort' or 'auto' (ONNX models always use 'ort')"
            )
        return BuilderChoice("ort", "the model is an ONNX model")
    wants_torch = option == "torch" or (option == "auto" and functions)
    if ort_only and wants_torch:
        why = f"the model uses custom torch.autograd.Function(s) {functions}, which need " if option == "auto" else ""
        raise NotImplementedError(
            f"{ort_only} transform the exported ONNX graph, which only the 'ort' gradient builder trains "
            f"from, but {why}the 'torch' gradient builder (it traces the PyTorch module and would ignore them). "
            f"Turn {ort_only} off" + ("." if functions else f", or set {OPTION}='ort'.")
        )
    if option == "ort" and functions:
        raise NotImplementedError(
            f"the model uses custom torch.autograd.Function(s) {functions}: the ONNX exporter inlines their forward "
            "and ONNX Runtime's gradient builder would ignore their backward (a silently wrong gradient). Set "
            f"options {OPTION} to 'torch' or 'auto' (the default) to train it with PyTorch's autograd."
        )
    if option == "torch":
        return BuilderChoice("torch", f"options {OPTION}='torch'")
    if option == "ort":
        return BuilderChoice("ort", f"options {OPTION}='ort'")
    if functions:
        return BuilderChoice(
            "torch",
            f"auto: the model uses custom torch.autograd.Function(s) {functions}, whose "
            "backward only the torch builder keeps",
        )
    if ort_only:
        return BuilderChoice("ort", f"auto: {ort_only} need the 'ort' builder")
    return BuilderChoice("auto", "auto: no custom torch.autograd.Function")


@dataclass(frozen=True)
class TorchSource:
    """What the torch builder traces: `_ModelWithLoss(module, loss_fn, input_names)` in mode `training`."""

    module: torch.nn.Module
    loss_fn: Callable | None
    input_names: list[str]
    opset_version: int
    training: bool


def torch_gradient_model(
    source: TorchSource, inputs: Sequence[torch.Tensor], outputs: list[str], trainable: list[str], state: list[str]
) -> onnx.ModelProto:
    """The gradient model for `inputs`' shapes: the data and the trainer's `state` tensors (trainable and frozen)
    as graph inputs; `outputs` (loss first), then `<p>_grad` for each of `trainable`, as graph outputs."""
    params = {name for name, _ in source.module.named_parameters()}
    frozen = [n for n in state if n in params and n not in set(trainable)]
    # orttrainer.debug hooks pass values through while tracing: no step counted, no file written from fake tensors
    with _mode(source.module, source.training), no_increase_global_step():
        graph = build_torch_gradient_graph(
            source.module,
            source.loss_fn,
            source.input_names,
            list(inputs),
            outputs,
            trainable,
            frozen,
            source.opset_version,
        )
    values = {n: t.detach() for n, t in [*source.module.named_parameters(), *source.module.named_buffers()]}
    return bind_foreign_state(graph.model, len(source.input_names), state, values)


@contextlib.contextmanager
def _mode(module: torch.nn.Module, training: bool) -> Iterator[None]:
    was_training = module.training
    module.train(training)
    try:
        yield
    finally:
        module.train(was_training)


def bind_foreign_state(
    model: onnx.ModelProto, data_count: int, state: Sequence[str], values: dict[str, torch.Tensor]
) -> onnx.ModelProto:
    """Rule: every graph input after the first `data_count` (the data) that is not in `state` becomes an initializer
    holding `values[name]` when a node reads it, and is removed when none does. `model` is modified and returned.

    Why: the torch builder's graph takes all module state; the trainer feeds only its own state, which leaves out
    tensors the exported forward does not use (BatchNorm's `num_batches_tracked`, unused parameters)."""
    kept = set(state)
    read = {name for node in model.graph.node for name in node.input}
    foreign = [i for i in list(model.graph.input)[data_count:] if i.name not in kept]
    missing = [i.name for i in foreign if i.name in read and i.name not in values]
    if missing:
        raise ValueError(f"graph inputs {missing} are neither trainer state nor module state with a value")
    for value in foreign:
        model.graph.input.remove(value)
        if value.name in read:
            model.graph.initializer.append(numpy_helper.from_array(values[value.name].cpu().numpy(), value.name))
    return model


class TorchGraphs:
    """`graphs(inputs)` -> the shape-dependent graph for the signature of `inputs` (the data, in model_desc order):
    the training graph, or with data parallelism the gradient-step graph.

    `first` was compiled for `first_inputs`' signature and is returned for it; any other signature is traced and
    compiled by `finish(gradient_model)` (the compiler's own tail: graph passes, then accumulation, clipping and the
    optimizer, or the gradient step), and must have `first`'s state contract. The caller caches the results
    (`session.GraphRunners`)."""

    def __init__(
        self,
        source: TorchSource,
        first,
        first_inputs: Sequence[torch.Tensor],
        finish: Callable[[onnx.ModelProto], object],
        trainable: list[str],
        state: list[str],
    ) -> None:
        self.source, self.first, self._finish = source, first, finish
        self._first_signature = shape_signature(first_inputs)
        self._trainable, self._state = list(trainable), list(state)

    def __call__(self, inputs: Sequence[torch.Tensor]):
        signature = shape_signature(inputs)
        if signature == self._first_signature:
            return self.first
        logger.info(
            "tracing and compiling a training graph for the new input shapes %s (torch gradient "
            "builder: one graph per input-shape signature)",
            [list(shape) for shape, _ in signature],
        )
        model = torch_gradient_model(self.source, inputs, list(self.first.outputs), self._trainable, self._state)
        graph = self._finish(model)
        check_same_state_contract(self.first, graph)
        return graph


_CONTRACT_VALUES = (
    "data_inputs",
    "outputs",
    "lr_input",
    "update_count_input",
    "loss_scale_input",
    "all_finite_output",
    "state_shapes",
)
_CONTRACT_KEYS = ("weight_updates", "optimizer_state", "accumulation", "gradients")


def check_same_state_contract(first, other) -> None:
    """Rule: graphs sharing one state (TrainingGraphs, or GradientStepGraphs) must name the same data inputs,
    outputs, step inputs, weights, optimizer moments, accumulation buffers and gradients, with the same shapes;
    raise RuntimeError naming the first difference."""
    for field in _CONTRACT_VALUES + _CONTRACT_KEYS:
        mine, theirs = getattr(first, field, None), getattr(other, field, None)
        if field in _CONTRACT_KEYS and mine is not None and theirs is not None:
            mine, theirs = list(mine), list(theirs)
        if mine != theirs:
            raise RuntimeError(
                f"the training graph for new input shapes differs from the first one in {field}: {theirs} != {mine}"
            )
