"""Which gradient builder differentiates a model (option `_internal_use.gradient_builder`).

'ort' is ONNX Runtime's C++ builder on the exported ONNX graph (`ort_builder.py`); 'torch' traces PyTorch's own
autograd (`torch_builder.py`); 'auto' (the default) takes 'torch' for a model with a custom
`torch.autograd.Function` (the exporter inlines its forward, so only the torch builder keeps the user's backward)
and otherwise tries 'ort', falling back to 'torch' when the TorchScript export fails or ONNX Runtime has no gradient
for an op (`build.build_from_torch`). The custom Functions come from a dry run in PyTorch, before any export. An
ONNX model uses 'ort' where ONNX Runtime's training build is installed and otherwise 'torch', which traces an
`OnnxModule` (`onnx_module/`) of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..runtime.ort import TRAINING_EXTRA_HINT

if TYPE_CHECKING:
    from ...schema.options import ORTTrainerOptions

OPTION = "_internal_use.gradient_builder"


@dataclass(frozen=True)
class BuilderChoice:
    """`builder`: 'ort', 'torch', or 'auto' before compiling (try 'ort', fall back to 'torch' when any part of the
    'ort' route fails: build.forward.auto_fallback); after compiling, the builder that made the graph. `reason`: why,
    for the log."""

    builder: str
    reason: str


def ort_only_options(options: ORTTrainerOptions, onnx_model: bool = False) -> list[str]:
    """The options set in `options` (an ORTTrainerOptions) that only the 'ort' builder honours: recompute and
    memory-efficient gradients act on ONNX Runtime's gradient graph (cast propagation works on both builders,
    graph/cast_propagation.py for the torch builder's graphs; so does `extra_postprocess`, which on the torch
    builder edits torch.export's forward graph, build/forward.edited_torch_forward); mixed precision counts for an
    ONNX model only (the torch builder traces a PyTorch model in float16 itself, build/export.py). (The trainer adds
    'orttrainer.debug statistics' when a StatisticsSubscriber's manager is subscribed to the model: the statistics
    are outputs of the exported graph's marked tensors.)"""
    graph = options.graph_transformer
    checks = (
        ("mixed_precision.enabled", bool(options.mixed_precision.enabled) and onnx_model),
        ("graph_transformer.gelu_recompute", graph.gelu_recompute),
        ("graph_transformer.attn_dropout_recompute", graph.attn_dropout_recompute),
        ("graph_transformer.transformer_layer_recompute", graph.transformer_layer_recompute),
        ("utils.memory_efficient_gradient", options.utils.memory_efficient_gradient),
    )
    return [name for name, is_set in checks if is_set]


def choose_builder(
    option: str,
    *,
    onnx_model: bool = False,
    custom_functions: Sequence[str] = (),
    ort_only: Sequence[str] = (),
    training_build: bool = True,
    edits_forward: bool = False,
) -> BuilderChoice:
    """Rules, in order:
    - an ONNX model: 'auto' means 'ort' with ONNX Runtime's training build (`training_build`) and 'torch' (an
      `OnnxModule` traced) without it; 'ort' without the training build is a ValueError; 'torch' (chosen or
      implied) with `ort_only` features is a NotImplementedError;
    - custom Functions with `edits_forward` (`_internal_use.extra_postprocess` on a PyTorch model) are a
      NotImplementedError: both exporters write a Function's forward only, so the edited graph's gradient would
      ignore the user's backward;
    - `ort_only` features (see `ort_only_options`) need 'ort': with them 'torch' is a NotImplementedError (so is
      'auto' with custom Functions, or for an ONNX model without the training build), and 'auto' means 'ort';
    - 'ort' with custom Functions is a NotImplementedError naming them (their backward would be ignored);
    - 'torch', and 'auto' with custom Functions, mean 'torch'; 'auto' without the training build
      (`training_build=False`: the maintained onnxruntime) means 'torch'; 'auto' otherwise stays 'auto'."""
    functions, ort_only = list(custom_functions), list(ort_only)
    if onnx_model:
        return _choose_for_onnx(option, ort_only, training_build)
    if functions and edits_forward:
        raise NotImplementedError(
            f"options _internal_use.extra_postprocess edits the exported forward graph, but the model uses custom "
            f"torch.autograd.Function(s) {functions}: the exported graph holds their forward only, so the edited "
            "graph's gradient would ignore their backward. Turn extra_postprocess off to train them with their "
            "backward (the torch gradient builder)."
        )
    _refuse_for_module(option, functions, ort_only, training_build)
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
    if not training_build:
        return BuilderChoice(
            "torch", "auto: onnxruntime-training is not installed, and the torch builder runs on any ONNX Runtime build"
        )
    return BuilderChoice("auto", "auto: no custom torch.autograd.Function")


def _refuse_for_module(option: str, functions: list[str], ort_only: list[str], training_build: bool) -> None:
    """The combinations `choose_builder` refuses for a PyTorch model (its rules 2 and 3)."""
    if ort_only and not training_build:
        raise NotImplementedError(
            f"{ort_only} need onnxruntime-training (they act on ONNX Runtime's gradient graph), which is not "
            f"installed here: turn them off, or {TRAINING_EXTRA_HINT}"
        )
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


def _choose_for_onnx(option: str, ort_only: list[str], training_build: bool) -> BuilderChoice:
    if option == "ort" and not training_build:
        raise ValueError(
            f"options {OPTION}='ort' needs ONNX Runtime's gradient builder, which only onnxruntime-training has: "
            f"{TRAINING_EXTRA_HINT}; or use 'torch' or 'auto' to let PyTorch's autograd differentiate the ONNX model"
        )
    if ort_only and (option == "torch" or not training_build):
        raise NotImplementedError(
            f"{ort_only} need ONNX Runtime's gradient builder, but the ONNX model would be trained with the 'torch' "
            f"gradient builder ({'as requested' if option == 'torch' else 'onnxruntime-training is not installed'}),"
            f" which does not support them. Turn them off, or {TRAINING_EXTRA_HINT} and use 'ort' or 'auto'."
        )
    if option in ("torch", "ort"):
        return BuilderChoice(option, f"options {OPTION}={option!r}")
    if training_build:
        return BuilderChoice("ort", "auto: an ONNX model, and onnxruntime-training is installed")
    return BuilderChoice("torch", "auto: an ONNX model, and onnxruntime-training is not installed")
