"""Which gradient builder differentiates a model (option `_internal_use.gradient_builder`).

'ort' is ONNX Runtime's C++ builder on the exported ONNX graph (`ort_builder.py`); 'torch' traces PyTorch's own
autograd (`torch_builder.py`); 'auto' (the default) takes 'torch' for a model with a custom
`torch.autograd.Function` (the exporter inlines its forward, so only the torch builder keeps the user's backward),
for a model that stops or rewrites a gradient on its way to the loss (`.detach()`, `.data`, `torch.no_grad()`, a
gradient hook: the exporter writes plain ops there, and ONNX Runtime's builder would differentiate through them)
and, on the CPU, for a model with recurrent layers (ONNX Runtime's LSTM and GRU gradient kernels train them about
3× slower than the torch builder's graph of the same layers; README § Benchmarks), and otherwise tries 'ort',
falling back to 'torch' when any part of the 'ort' route fails (`build.forward.auto_fallback`). The custom
Functions and the gradient edits come from a dry run in PyTorch, before any export. An ONNX model uses 'ort' where
ONNX Runtime's training build is installed and otherwise 'torch', which traces an `OnnxModule` (`onnx_module/`) of
it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..runtime.ort import TRAINING_EXTRA_HINT

OPTION = "_internal_use.gradient_builder"


@dataclass(frozen=True)
class BuilderChoice:
    """`builder`: 'ort', 'torch', or 'auto' before compiling (try 'ort', fall back to 'torch' when any part of the
    'ort' route fails: build.forward.auto_fallback); after compiling, the builder that made the graph. `reason`: why,
    for the log."""

    builder: str
    reason: str


def choose_builder(
    option: str,
    *,
    onnx_model: bool = False,
    custom_functions: Sequence[str] = (),
    training_build: bool = True,
    edits_forward: bool = False,
    recurrent_layers: Sequence[str] = (),
    cpu: bool = True,
    gradient_edits: Sequence[str] = (),
) -> BuilderChoice:
    """Rules, in order:
    - an ONNX model: 'auto' means 'ort' with ONNX Runtime's training build (`training_build`) and 'torch' (an
      `OnnxModule` traced) without it; 'ort' without the training build is a ValueError;
    - custom Functions with `edits_forward` (`_internal_use.extra_postprocess` on a PyTorch model) are a
      NotImplementedError: both exporters write a Function's forward only, so the edited graph's gradient would
      ignore the user's backward;
    - the same for `gradient_edits` (where the model stops or rewrites a gradient that reaches the loss:
      `.detach()`, `.data`, `torch.no_grad()`, a gradient hook on a parameter or an activation; places from the
      dry run, build/export.py): both exporters write plain ops there, so an edited graph, or ONNX Runtime's
      gradient of the exported one, would differentiate through them;
    - 'ort' with custom Functions, then 'ort' with gradient edits, is a NotImplementedError naming them (their
      backward would be ignored; ONNX Runtime would differentiate through the edits);
    - 'torch', and 'auto' with custom Functions, mean 'torch'; 'auto' without the training build
      (`training_build=False`: the maintained onnxruntime) means 'torch'; 'auto' with gradient edits means 'torch';
      'auto' with `recurrent_layers` (the class names of the model's nn.RNN/LSTM/GRU modules) on the CPU (`cpu`)
      means 'torch'; 'auto' otherwise stays 'auto'.
    Every trainer option works on both builders: no option decides the builder."""
    functions = list(custom_functions)
    if onnx_model:
        return _choose_for_onnx(option, training_build)
    if functions and edits_forward:
        raise NotImplementedError(
            f"options _internal_use.extra_postprocess edits the exported forward graph, but the model uses custom "
            f"torch.autograd.Function(s) {functions}: the exported graph holds their forward only, so the edited "
            "graph's gradient would ignore their backward. Turn extra_postprocess off to train them with their "
            "backward (the torch gradient builder)."
        )
    edits = _listed(gradient_edits)
    if edits and edits_forward:
        raise NotImplementedError(
            f"options _internal_use.extra_postprocess edits the exported forward graph, but the model stops or "
            f"rewrites a gradient that reaches the loss ({edits}; {_EDITS}): the exported graph has plain ops there, "
            "so the edited graph's gradient would flow through them. Turn extra_postprocess off to train the model "
            "with PyTorch's autograd (the torch gradient builder)."
        )
    if option == "ort" and functions:
        raise NotImplementedError(
            f"the model uses custom torch.autograd.Function(s) {functions}: the ONNX exporter inlines their forward "
            "and ONNX Runtime's gradient builder would ignore their backward (a silently wrong gradient). Set "
            f"options {OPTION} to 'torch' or 'auto' (the default) to train it with PyTorch's autograd."
        )
    if option == "ort" and edits:
        raise NotImplementedError(
            f"the model stops or rewrites a gradient that reaches the loss ({edits}; {_EDITS}): the ONNX exporter "
            "writes plain ops there and drops hooks, and ONNX Runtime's gradient builder would differentiate through "
            f"them (a silently wrong gradient). Set options {OPTION} to 'torch' or 'auto' (the default) to train it "
            "with PyTorch's autograd."
        )
    if option in ("torch", "ort"):
        return BuilderChoice(option, f"options {OPTION}={option!r}")
    if functions:
        return BuilderChoice(
            "torch",
            f"auto: the model uses custom torch.autograd.Function(s) {functions}, whose "
            "backward only the torch builder keeps",
        )
    if not training_build:
        return BuilderChoice(
            "torch", "auto: onnxruntime-training is not installed, and the torch builder runs on any ONNX Runtime build"
        )
    if edits:
        return BuilderChoice(
            "torch",
            f"auto: the model stops or rewrites a gradient that reaches the loss ({edits}), which only the torch "
            "builder keeps",
        )
    if recurrent_layers and cpu:
        return BuilderChoice(
            "torch",
            f"auto: the model has recurrent layers ({', '.join(sorted(set(recurrent_layers)))}), which the torch "
            "builder's graph trains about 3x faster on the CPU than ONNX Runtime's recurrent gradient kernels; set "
            f"options {OPTION}='ort' for a faster first step instead",
        )
    return BuilderChoice("auto", "auto: no custom torch.autograd.Function")


_EDITS = "`.detach()`, `.data`, `torch.no_grad()` or a gradient hook"


def _listed(places: Sequence[str], shown: int = 3) -> str:
    """The first `shown` places, and how many more."""
    more = f" and {len(places) - shown} more" if len(places) > shown else ""
    return "; ".join(places[:shown]) + more


def _choose_for_onnx(option: str, training_build: bool) -> BuilderChoice:
    if option == "ort" and not training_build:
        raise ValueError(
            f"options {OPTION}='ort' needs ONNX Runtime's gradient builder, which only onnxruntime-training has: "
            f"{TRAINING_EXTRA_HINT}; or use 'torch' or 'auto' to let PyTorch's autograd differentiate the ONNX model"
        )
    if option in ("torch", "ort"):
        return BuilderChoice(option, f"options {OPTION}={option!r}")
    if training_build:
        return BuilderChoice("ort", "auto: an ONNX model, and onnxruntime-training is installed")
    return BuilderChoice("torch", "auto: an ONNX model, and onnxruntime-training is not installed")
