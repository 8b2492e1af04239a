"""The `torch` gradient builder: PyTorch's own autograd traced into one ONNX forward+backward graph.

Contract (shared with `gradient.build_ort_gradient_graph`): the returned ONNX model takes the data inputs (named by
`input_names`, in that order) followed by every state tensor of the module — parameters then buffers, in
`named_parameters()` / `named_buffers()` order and names (no `model.` prefix), trainable and frozen alike — and
outputs the forward outputs named by `output_names` (loss first) followed by `<p>_grad` for each `p` in
`trainable`, in that order. Frozen parameters (not in `trainable`) get no gradient.

How: `_JointWrapper(module, loss_fn)` returns `(loss, *outputs)`; AOTAutograd traces its forward and PyTorch's
backward of the loss into one functional aten graph (core aten decompositions plus batch norm, whose ONNX
translation ignores training mode; SDPA on its math backend); custom `torch.autograd.Function`s contribute their
own forward and backward. `torch.onnx.export(dynamo=True)` (needs onnxscript) writes that graph as plain ONNX ops,
so it runs on any ONNX Runtime build. Gradients are exactly PyTorch's.

Shape rule: the trace bakes shape-derived constants (a mean's divisor, view sizes) into the graph, so a graph is
valid only for the input shapes and dtypes it was traced with. Its ONNX inputs keep those static shapes (ONNX
Runtime rejects other shapes instead of computing a wrong result), `TorchGradientGraph.signature` records them, and
the trainer keeps one compiled graph per signature with `ShapeKeyedCache`.

Other rules: the module is traced in its current train/eval mode (dropout in training mode draws one mask, used by
forward and backward alike). Buffers updated in place by the forward (BatchNorm running statistics) are inputs
but their updates are not outputs (as with the `ort` builder): they are listed in `mutated_buffers`. State of
`loss_fn` (a loss module's `weight` buffer) is baked into the graph as constants. Every trainable parameter must
influence the loss. Tied parameters are one input and one summed gradient under their first name.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx
import torch

from ...dtypes import torch_to_onnx
from ..export import _ModelWithLoss
from ..shapes import ShapeSignature, shape_signature
from . import torch_private
from .errors import GradientBuildError

MAX_ORT_OPSET = 21  # the newest ONNX opset ONNX Runtime 1.19 runs


class UntraceableFunctionError(GradientBuildError):
    """A custom `torch.autograd.Function`'s forward or backward cannot be traced into a graph."""

    def __init__(self, function: str, phase: str, location: str, reason: str) -> None:
        self.function, self.phase, self.location = function, phase, location
        super().__init__(
            f"The {phase} of the custom torch.autograd.Function '{function}' cannot be traced into the ONNX "
            f"training graph: {reason} (at {location}). The torch gradient builder records {function}.{phase} "
            "once, with placeholder tensors that have no values, so it must compute with tensor operations only: "
            "no .item(), .tolist(), .numpy() or Python numbers read from tensors, no Python if/while on tensor "
            "values (use torch.where or masks), no outputs whose shape depends on values (torch.nonzero). Rewrite "
            f"{function}.{phase} that way, or train this model with plain PyTorch."
        )


@dataclass(frozen=True)
class TorchGradientGraph:
    """A joint forward+backward ONNX model and the layout the trainer feeds and reads (see the module docstring)."""

    model: onnx.ModelProto
    input_names: list[str]  # data inputs: the first graph inputs
    state_names: list[str]  # then every parameter and buffer of the module
    output_names: list[str]  # forward outputs, loss first
    gradient_names: list[str]  # then `<p>_grad` for each trainable parameter, in `trainable` order
    signature: ShapeSignature  # input shapes and dtypes this graph is valid for
    opset_version: int
    mutated_buffers: list[str]  # buffers the forward updates in place; this graph does not output the updates

    def check_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        """Raise ValueError unless `inputs` have the shapes and dtypes this graph was traced for."""
        got = shape_signature(inputs)
        if got != self.signature:
            raise ValueError(
                f"this gradient graph was traced for inputs {self.signature}, got {got}: build (or "
                "look up in a ShapeKeyedCache) the graph for these shapes"
            )


def build_torch_gradient_graph(
    module: torch.nn.Module,
    loss_fn: Callable | None,
    input_names: Sequence[str],
    sample_inputs: Sequence[torch.Tensor],
    output_names: Sequence[str],
    trainable: Sequence[str],
    frozen: Sequence[str] = (),
    opset_version: int = torch_private.MIN_DYNAMO_OPSET,
) -> TorchGradientGraph:
    """Trace `module` (+ `loss_fn`) on `sample_inputs` and return its forward+backward ONNX graph.

    `input_names` name `sample_inputs` (with a loss_fn the last one is the label, as in `_ModelWithLoss`);
    `output_names` name the first outputs of `(loss, *module outputs)`; `trainable` get `<p>_grad` outputs;
    `frozen` parameters (and parameters in neither list) get none. `opset_version` below 18 is raised to 18 (the
    exporter's minimum); above 21 is an error. Raises GradientBuildError (UntraceableFunctionError for a custom
    Function that cannot be traced) when PyTorch cannot trace or export the model.
    """
    _check_arguments(module, input_names, sample_inputs, trainable, frozen)
    opset = _effective_opset(opset_version)
    inputs = [t.detach() for t in sample_inputs]  # gradients are for parameters only
    wrapper = _JointWrapper(module, loss_fn, input_names)
    with _requires_grad_only(wrapper, module, set(trainable)):
        graph, sig = _trace(wrapper, inputs, trainable)
    canonical = _canonical_names(module)
    state = {name: tensor.detach() for name, tensor in [*module.named_parameters(), *module.named_buffers()]}
    state_inputs, mutated = _rewrite_joint(
        graph, sig, _state_tensors(wrapper), canonical, trainable, len(output_names), type(module).__name__
    )
    gradient_names = [f"{p}_grad" for p in trainable]
    try:
        model = torch_private.export_graph_to_onnx(
            graph,
            [*(state[n] for n in state_inputs), *inputs],
            [*state_inputs, *input_names],
            [*output_names, *gradient_names],
            opset,
        )
    except Exception as err:
        raise GradientBuildError(
            f"torch.onnx could not export the traced forward+backward graph of "
            f"{type(module).__name__} to ONNX opset {opset}: {err}"
        ) from err
    state_names = list(canonical.values())
    model = _order_inputs(model, list(input_names), {n: state[n] for n in state_names})
    return TorchGradientGraph(
        model,
        list(input_names),
        state_names,
        list(output_names),
        gradient_names,
        shape_signature(inputs),
        opset,
        mutated,
    )


class _JointWrapper(torch.nn.Module):
    """`(loss, *outputs)` of `_ModelWithLoss`, flattened to tensors, with the outputs detached: AOTAutograd
    differentiates the loss only and rejects other outputs that require grad."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable | None, input_names: Sequence[str]) -> None:
        super().__init__()
        self.inner = _ModelWithLoss(module, loss_fn, list(input_names))

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss, *outputs = _flatten_tensors(self.inner(*inputs))
        return (loss, *(t.detach() for t in outputs))


def _flatten_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _flatten_tensors(item)]
    return []


def _check_arguments(
    module: torch.nn.Module,
    input_names: Sequence[str],
    sample_inputs: Sequence[torch.Tensor],
    trainable: Sequence[str],
    frozen: Sequence[str],
) -> None:
    if len(input_names) != len(sample_inputs) or not all(isinstance(t, torch.Tensor) for t in sample_inputs):
        raise ValueError(
            f"need one sample tensor per input {list(input_names)}, got {[type(t).__name__ for t in sample_inputs]}"
        )
    params = dict(module.named_parameters())
    unknown = [n for n in [*trainable, *frozen] if n not in params]
    both = sorted(set(trainable) & set(frozen))
    if unknown or both:
        raise ValueError(
            f"trainable/frozen must name parameters of {type(module).__name__}: unknown {unknown}, in both lists {both}"
        )


def _effective_opset(opset_version: int) -> int:
    if opset_version > MAX_ORT_OPSET:
        raise ValueError(f"ONNX Runtime 1.19 runs ONNX opsets up to {MAX_ORT_OPSET}, got opset {opset_version}")
    # the dynamo exporter translates to opset >= 18 only; converting down fails on common ops
    return max(opset_version, torch_private.MIN_DYNAMO_OPSET)


class _requires_grad_only:
    """Within the block exactly the module parameters named in `trainable` require grad (AOTAutograd emits
    gradients for those); parameters of the loss function never do. Restores the flags on exit."""

    def __init__(self, wrapper: torch.nn.Module, module: torch.nn.Module, trainable: set[str]) -> None:
        wanted = {id(p) for n, p in module.named_parameters() if n in trainable}
        self._params = list(wrapper.parameters())
        self._saved = [p.requires_grad for p in self._params]
        self._wanted = [id(p) in wanted for p in self._params]

    def __enter__(self) -> None:
        for p, flag in zip(self._params, self._wanted, strict=True):
            p.requires_grad_(flag)

    def __exit__(self, *exc) -> None:
        for p, flag in zip(self._params, self._saved, strict=True):
            p.requires_grad_(flag)


def _trace(wrapper: _JointWrapper, inputs: Sequence[torch.Tensor], trainable: Sequence[str]):
    try:
        with torch_private.math_sdpa():
            return torch_private.aot_export_joint(wrapper, inputs, loss_index=0)
    except Exception as err:
        raise _explain_trace_error(err, wrapper, inputs, trainable) from err


def _explain_trace_error(
    err: Exception, wrapper: _JointWrapper, inputs: Sequence[torch.Tensor], trainable: Sequence[str]
) -> Exception:
    """Name the custom Function, or the parameters without gradient, behind a failed trace."""
    found = _failing_function(err)
    if found is not None:
        cls, phase, location = found
        return UntraceableFunctionError(cls.__qualname__, phase, location, f"{type(err).__name__}: {_first_line(err)}")
    model_name = type(wrapper.inner.model).__name__
    if torch_private.is_missing_gradient_error(err):
        unused = _parameters_without_gradient(wrapper, inputs, trainable)
        return GradientBuildError(
            f"PyTorch produced no gradient for {unused or 'some trainable parameters'} of "
            f"{model_name}: these parameters do not influence the loss. Freeze them with "
            "options utils.frozen_weights.",
            unreachable=unused,
        )
    return GradientBuildError(
        f"PyTorch could not trace the forward and backward of {model_name} into a graph: {type(err).__name__}: {err}"
    )


def _failing_function(err: BaseException) -> tuple[type, str, str] | None:
    """(class, phase, "file:line") of the innermost custom Function forward/backward on the failing stack,
    following chained exceptions."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame, line in reversed(list(traceback.walk_tb(current.__traceback__))):
            found = torch_private.autograd_function_of_frame(frame)
            if found is not None:
                return (*found, f"{frame.f_code.co_filename}:{line}")
        current = current.__cause__ or current.__context__
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _parameters_without_gradient(
    wrapper: _JointWrapper, inputs: Sequence[torch.Tensor], trainable: Sequence[str]
) -> list[str]:
    """Eager check on a copy (the forward may update buffers): trainable parameters whose gradient is None."""
    try:
        runner = copy.deepcopy(wrapper)
        params = dict(runner.inner.model.named_parameters())
        loss = runner(*inputs)[0]
        grads = torch.autograd.grad(loss, [params[n] for n in trainable], allow_unused=True)
    except Exception:
        return []
    return [n for n, g in zip(trainable, grads, strict=True) if g is None]


def _state_tensors(wrapper: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(wrapper.named_parameters(remove_duplicate=False)),
        **dict(wrapper.named_buffers(remove_duplicate=False)),
    }


def _canonical_names(module: torch.nn.Module) -> dict[int, str]:
    """id(tensor) -> the module's name for it: its first name, so tied parameters share one."""
    names: dict[int, str] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        names.setdefault(id(tensor), name)
    return names


def _rewrite_joint(
    graph: torch.fx.GraphModule,
    sig: torch_private.JointSignature,
    tensors: dict[str, torch.Tensor],
    canonical: dict[int, str],
    trainable: Sequence[str],
    n_outputs: int,
    model_name: str,
) -> tuple[list[str], list[str]]:
    """Put the traced graph into the contract's shape, in place. Returns (state placeholder names in graph
    order, mutated buffers).

    Rules: a tied parameter's placeholders merge into the first one; state that is not the module's (the loss
    function's) becomes a constant; outputs become the first `n_outputs` user outputs, then one gradient per
    trainable parameter (the sum of its tied copies' gradients); in-place buffer updates are dropped."""
    fx = graph.graph
    placeholders = [n for n in fx.nodes if n.op == "placeholder"]
    first: dict[str, torch.fx.Node] = {}
    for node, (kind, name) in zip(placeholders, sig.inputs, strict=True):
        if kind == "user":
            continue
        module_name = canonical.get(id(tensors[name]))
        if module_name is None:
            _bake_constant(graph, node, tensors[name])
        elif module_name in first:
            node.replace_all_uses_with(first[module_name])
            fx.erase_node(node)
        else:
            first[module_name] = node
    out = fx.output_node()
    values = torch_private.output_values(fx)
    user = [v for v, (kind, _) in zip(values, sig.outputs, strict=True) if kind == "user"]
    if len(user) < n_outputs:
        raise ValueError(
            f"output_names describe {n_outputs} outputs, but {model_name} (with its loss_fn) "
            f"returns {len(user)} tensors"
        )
    grads: dict[str, list[torch.fx.Node]] = {}
    for value, (kind, name) in zip(values, sig.outputs, strict=True):
        if kind == "gradient":
            grads.setdefault(canonical[id(tensors[name])], []).append(value)
    with fx.inserting_before(out):
        summed = [_sum_nodes(fx, grads[p]) for p in trainable]
    out.args = (tuple(user[:n_outputs] + summed),)
    graph.recompile()
    mutated = sorted(
        {canonical.get(id(tensors[name]), name) for kind, name in sig.outputs if kind == "mutation" and name in tensors}
    )
    return list(first), mutated


def _bake_constant(graph: torch.fx.GraphModule, node: torch.fx.Node, tensor: torch.Tensor) -> None:
    index = 0
    while hasattr(graph, f"_orttrainer_constant_{index}"):
        index += 1
    attr = f"_orttrainer_constant_{index}"
    graph.register_buffer(attr, tensor.detach().clone())
    with graph.graph.inserting_before(node):
        constant = graph.graph.get_attr(attr)
    node.replace_all_uses_with(constant)
    graph.graph.erase_node(node)


def _sum_nodes(fx: torch.fx.Graph, nodes: list[torch.fx.Node]) -> torch.fx.Node:
    total = nodes[0]
    for node in nodes[1:]:
        total = fx.call_function(torch.ops.aten.add.Tensor, (total, node))
    return total


def _order_inputs(model: onnx.ModelProto, data: list[str], state: dict[str, torch.Tensor]) -> onnx.ModelProto:
    """Rule: graph inputs become exactly `data` then `state`, in that order. A state tensor the exporter dropped
    (unused by the graph, e.g. a buffer only the dropped in-place update read) is added back as an unused input."""
    by_name = {i.name: i for i in model.graph.input}
    ordered = []
    for name in [*data, *state]:
        if name not in by_name:
            by_name[name] = onnx.helper.make_tensor_value_info(
                name, torch_to_onnx(state[name].dtype), list(state[name].shape)
            )
        ordered.append(by_name[name])
    del model.graph.input[:]
    model.graph.input.extend(ordered)
    return model
