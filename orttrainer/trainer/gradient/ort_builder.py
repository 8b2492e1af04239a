"""The `ort` gradient builder: ONNX Runtime's C++ GradientGraphBuilder behind orttrainer's gradient contract.

Contract shared by every gradient builder: given a forward model whose output `loss_name` is a scalar loss, return a
model that additionally outputs `<param>_grad` for every trainable parameter, with every state tensor (trainable
and frozen) as a graph input, so that weights are fed per step instead of baked into the session.

ONNX Runtime's private training-graph API (`get_optimized_model`, `GradientGraphBuilder`) is reached through
`trainer/runtime/ort_private.py`.
"""

from __future__ import annotations

import re

import onnx

from ..graph.cast_propagation import has_float16
from ..graph.state_inputs import move_initializers_to_inputs
from ..runtime import ort_private
from .errors import GradientBuildError
from .ort_options import GradientOptions, build_configured_gradient_graph


def build_ort_gradient_graph(
    forward: onnx.ModelProto,
    loss_name: str,
    trainable: list[str],
    state: list[str],
    options: GradientOptions | None = None,
) -> onnx.ModelProto:
    """Forward model with `loss_name` -> model that also outputs `<p>_grad` for each `p` in `trainable`.

    `state` (trainable and frozen tensors) must be initializers of `forward`; they become graph inputs. ORT's
    pre-training transformers (Gelu/LayerNorm fusions, ...) run first, as the legacy TrainingSession did.
    Outputs are ordered: the forward outputs, then the gradients in `trainable` order. `options` other than ORT's
    defaults (cast propagation, memory-efficient gradients) go through `ort_options.py`; on a model without float16
    tensors cast propagation is a no-op (`GradientOptions.for_float32`).
    """
    from onnxruntime import SessionOptions

    model = move_initializers_to_inputs(forward, state)
    if options is not None and not has_float16(model):
        options = options.for_float32()
    session_options = SessionOptions()
    session_options.log_severity_level = 3  # the pre-training transformers log every pass at INFO level otherwise
    requires_grad = set(trainable)
    try:
        if options is not None and not options.builtin:
            graded = build_configured_gradient_graph(model, loss_name, trainable, state, options)
        else:
            optimized = ort_private.pre_training_optimized_model(
                model.SerializeToString(), requires_grad, session_options
            )
            graded = onnx.load_from_string(
                ort_private.gradient_graph(optimized, loss_name, requires_grad, session_options)
            )
    except GradientBuildError:
        raise
    except Exception as err:  # the pybind layer raises plain RuntimeError/Fail with the C++ message
        raise _explain(err, forward) from err
    _refuse_wrong_kernels(graded)
    return _order_outputs(graded, [o.name for o in forward.graph.output], trainable)


def _refuse_wrong_kernels(graded: onnx.ModelProto) -> None:
    """Rule: a gradient graph with an `AveragePoolGrad` whose result the graph does not declare with every size
    known is refused (GradientBuildError; 'auto' then lets PyTorch differentiate the model). Why: onnxruntime-
    training's AveragePoolGrad kernel takes its output's shape from the shape the graph declares for it, not from
    the forward input, and reads a symbolic size (the batch) as 0: a CNN with `nn.AvgPool2d` and a dynamic batch
    died of a floating-point exception (SIGFPE) at its first step, EfficientNet of a segmentation fault
    (docs/engine.md §40). With every size declared it computes ONNX's AveragePool gradient. `graph/conv_grad.py`
    mends ConvGrad's faults instead; this one has no mending that keeps the kernel."""
    declared = {v.name: v for v in [*graded.graph.value_info, *graded.graph.output]}
    nodes = [
        n.name or "<unnamed>"
        for n in graded.graph.node
        if n.op_type == "AveragePoolGrad" and not _sizes_known(declared.get(n.output[0]))
    ]
    if nodes:
        raise GradientBuildError(
            f"ONNX Runtime's AveragePool gradient kernel cannot train this model: it takes the shape of its result "
            f"from the graph, where the batch size is not known, and crashes the process (node"
            f"{'s' if len(nodes) > 1 else ''} {', '.join(repr(n) for n in nodes)}). Let PyTorch differentiate the "
            "model instead (options {'_internal_use': {'gradient_builder': 'torch'}}; the default 'auto' does so)."
        )


def _sizes_known(value: onnx.ValueInfoProto | None) -> bool:
    if value is None or not value.type.tensor_type.HasField("shape"):
        return False
    return all(d.HasField("dim_value") and d.dim_value > 0 for d in value.type.tensor_type.shape.dim)


def _order_outputs(model: onnx.ModelProto, forward_outputs: list[str], trainable: list[str]) -> onnx.ModelProto:
    by_name = {o.name: o for o in model.graph.output}
    missing = [f"{p}_grad" for p in trainable if f"{p}_grad" not in by_name]
    if missing:
        raise GradientBuildError(
            f"ONNX Runtime produced no gradient for {missing}: these parameters do not "
            "influence the loss. Freeze them with options utils.frozen_weights."
        )
    ordered = [by_name[n] for n in forward_outputs] + [by_name[f"{p}_grad"] for p in trainable]
    del model.graph.output[:]
    model.graph.output.extend(ordered)
    return model


_NO_GRADIENT = re.compile(r"gradient builder has not been registered[:\s]*([A-Za-z0-9_]+)")
_UNREACHABLE = re.compile(r"Cannot compute the partial derivative for '([^']+)' as it's unreachable")


def _explain(err: Exception, forward: onnx.ModelProto) -> Exception:
    """Turn ORT's C++ error into one that names the op, the nodes and what to do."""
    text = str(err)
    unreachable = _UNREACHABLE.findall(text)
    if unreachable:
        return GradientBuildError(
            f"parameters {unreachable} have no differentiable path to the loss; freeze them "
            "with options utils.frozen_weights",
            unreachable,
        )
    match = _NO_GRADIENT.search(text)
    if not match:
        return GradientBuildError(f"ONNX Runtime could not build the gradient graph: {text}")
    op = match.group(1)
    nodes = [n.name or f"<unnamed {n.op_type}>" for n in forward.graph.node if n.op_type == op]
    return GradientBuildError(
        f"ONNX Runtime's gradient builder cannot differentiate op '{op}' (node{'s' if len(nodes) > 1 else ''} "
        f"{', '.join(repr(n) for n in nodes) or '?'}). Let PyTorch differentiate the model instead (options "
        "{'_internal_use': {'gradient_builder': 'torch'}}; the default 'auto' does so), rewrite that part of the "
        "model with differentiable ops, or freeze the parameters that lead only into it (options "
        "utils.frozen_weights).",
        op_type=op,
    )
