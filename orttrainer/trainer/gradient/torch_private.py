"""Every private or version-sensitive PyTorch API the `torch` gradient builder uses, behind small functions.

Rule: nothing else in orttrainer imports from `torch._*`, reads private attributes of torch objects, or matches
torch's error texts; it calls these wrappers. A torch upgrade that moves or changes one of them then breaks this
file (and `tests/test_torch_private.py`, which pins each wrapper's behaviour), not the gradient builder.

Verified on torch 2.13.0 (CPU) with onnxscript 0.7.2 and onnx 1.17.0.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import torch

# The oldest opset torch's ONNX translations (onnxscript torchlib) are written for. Lower requests go through a
# version converter that fails on common ops (verified: opset 14 -> "No Adapter From Version $16 for Identity").
MIN_DYNAMO_OPSET = 18


def core_aten_decompositions() -> dict:
    """The decomposition table that lowers composite aten ops (and their backward ops) to the core aten set,
    which the ONNX translation table covers."""
    from torch._decomp import core_aten_decompositions as table

    return table()


def training_decompositions() -> dict:
    """`core_aten_decompositions()` plus the batch-norm ops, lowered to mean/var arithmetic.

    Why: onnxscript's translation of `_native_batch_norm_legit_functional` forces `training = False` (its
    "temporary fix" for old ONNX Runtime), so a training-mode BatchNorm would be exported with running statistics
    instead of batch statistics: a silently wrong loss and gradient (verified with onnxscript 0.7.2)."""
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    table = core_aten_decompositions()
    table.update(
        get_decompositions(
            [
                aten._native_batch_norm_legit_functional,
                aten._native_batch_norm_legit,
                aten._native_batch_norm_legit_no_training,
                aten.native_batch_norm,
            ]
        )
    )
    return table


@contextlib.contextmanager
def math_sdpa() -> Iterator[None]:
    """Force `scaled_dot_product_attention` onto its math backend while tracing.

    Why: the fused CPU/CUDA kernels (flash, memory-efficient) appear in the traced graph as opaque ops with
    opaque backward ops that have no ONNX translation; the math backend traces into matmul/softmax."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


@dataclass(frozen=True)
class JointSignature:
    """What each placeholder and output of a joint forward+backward graph is, in graph order.

    inputs: one `(kind, name)` per placeholder; kind is "parameter" or "buffer" (name = the wrapper's qualified
    name, tied parameters appear once per name) or "user" (name = the placeholder name).
    outputs: one `(kind, name)` per graph output; kind is "mutation" (name = mutated buffer or placeholder),
    "user" (name = the output node name; the loss is the one at `loss_index` among the user outputs) or
    "gradient" (name = qualified parameter name).
    """

    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]


def aot_export_joint(
    module: torch.nn.Module, args: Sequence[Any], loss_index: int = 0
) -> tuple[torch.fx.GraphModule, JointSignature]:
    """Trace `module(*args)` and PyTorch's backward of its output `loss_index` into one functional aten graph.

    Decompositions: `training_decompositions()`. Placeholders are (parameters, buffers, user inputs); outputs
    are (mutated inputs, user outputs, parameter gradients), as `JointSignature` spells out. Custom
    `torch.autograd.Function`s contribute their own forward and backward. `module` must return a tuple; every
    non-loss output must not require grad (detach it); every parameter that requires grad must receive a
    gradient (see `is_missing_gradient_error`)."""
    from torch._functorch.aot_autograd import aot_export_module

    with torch.enable_grad(), warnings.catch_warnings():
        # anomaly-mode and pytree deprecation warnings fire on every trace; failures raise instead
        warnings.simplefilter("ignore")
        graph, sig = aot_export_module(
            module, list(args), trace_joint=True, output_loss_index=loss_index, decompositions=training_decompositions()
        )
    if not isinstance(graph, torch.fx.GraphModule):  # the joint trace always returns one
        raise TypeError(f"aot_export_module returned {type(graph).__name__}, not a GraphModule")
    return graph, _joint_signature(graph, sig)


def _joint_signature(graph: torch.fx.GraphModule, sig: Any) -> JointSignature:
    if sig.input_tokens or sig.output_tokens:
        raise NotImplementedError(
            "the traced graph threads effect tokens (side-effecting ops such as print or "
            "custom ops with effects); the torch gradient builder does not support them"
        )
    placeholders = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
    inputs = []
    for name in placeholders:
        if name in sig.inputs_to_parameters:
            inputs.append(("parameter", sig.inputs_to_parameters[name]))
        elif name in sig.inputs_to_buffers:
            inputs.append(("buffer", sig.inputs_to_buffers[name]))
        else:
            inputs.append(("user", name))
    # outputs are positional: (mutated inputs, user outputs, gradients of the parameters that require grad)
    mutations = {**sig.buffers_to_mutate, **sig.user_inputs_to_mutate, **sig.parameters_to_mutate}
    gradients = sig.backward_signature.gradients_to_parameters
    names = [n.name if isinstance(n, torch.fx.Node) else str(n) for n in output_values(graph.graph)]
    n_mut, n_user = len(mutations), len(sig.user_outputs)
    outputs = [("mutation", mutations[n]) for n in names[:n_mut]]
    outputs += [("user", n) for n in names[n_mut : n_mut + n_user]]
    outputs += [("gradient", gradients[n]) for n in names[n_mut + n_user :]]
    return JointSignature(tuple(inputs), tuple(outputs))


def output_values(graph: torch.fx.Graph) -> list:
    """The values the graph's output node returns (an fx graph returns one tuple)."""
    values = graph.output_node().args[0]
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"the traced graph returns {type(values).__name__}, not a tuple")
    return list(values)


def is_missing_gradient_error(err: BaseException) -> bool:
    """True for AOTAutograd's assertion that a parameter requiring grad got no gradient from the loss."""
    return isinstance(err, AssertionError) and "did not receive a gradient" in str(err)


def autograd_function_of_frame(frame: Any) -> tuple[type, str] | None:
    """`(Function class, "forward" | "backward")` when `frame` runs a custom `torch.autograd.Function`'s forward
    or backward (its first argument is the Function's ctx), else None."""
    if frame.f_code.co_name not in ("forward", "backward") or frame.f_code.co_argcount == 0:
        return None
    ctx = frame.f_locals.get(frame.f_code.co_varnames[0])
    cls = getattr(type(ctx), "_forward_cls", None)  # the ctx of a Python Function is its backward node
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        return None
    if getattr(cls, frame.f_code.co_name, None) is None:
        return None
    return cls, frame.f_code.co_name


def export_graph_to_onnx(
    graph: torch.fx.GraphModule,
    args: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    opset_version: int,
) -> onnx.ModelProto:
    """ONNX model of an aten-level `graph` through `torch.onnx.export(dynamo=True)` (needs onnxscript).

    Rules: input shapes stay static (the graph was traced for them); opset_version must be >= MIN_DYNAMO_OPSET;
    the IR version is capped at 10 (the newest ONNX Runtime 1.19 loads)."""
    if opset_version < MIN_DYNAMO_OPSET:
        raise ValueError(f"torch.onnx's dynamo exporter writes opset >= {MIN_DYNAMO_OPSET}, got {opset_version}")
    graph.eval()  # an aten graph has no train/eval behaviour; this only silences the exporter's training warning
    with _quiet_exporter():
        program = torch.onnx.export(
            graph,
            tuple(args),
            input_names=input_names,
            output_names=output_names,
            opset_version=opset_version,
            dynamo=True,
            optimize=True,
            verify=False,
            report=False,
            verbose=False,
        )
    if program is None:  # dynamo=True always returns a program
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no ONNX program")
    model = program.model_proto
    model.ir_version = min(model.ir_version, 10)
    return model


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The dynamo exporter logs 'torchvision is not installed' and optimizer warnings on every export."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
