"""The `torch` gradient builder: PyTorch's own autograd traced into one ONNX forward+backward graph.

Contract (shared with `gradient.build_ort_gradient_graph`): the returned ONNX model takes the data inputs (named by
`input_names`, in that order) followed by every state tensor of the module — parameters then buffers, in
`named_parameters()` / `named_buffers()` order and names (no `model.` prefix), trainable and frozen alike — and
outputs the forward outputs named by `output_names` (loss first) followed by `<p>_grad` for each `p` in
`trainable`, in that order. Frozen parameters (not in `trainable`) get no gradient.

How: `JointWrapper(module, loss_fn)` returns `(loss, *outputs)`; AOTAutograd traces its forward and PyTorch's
backward of the loss into one functional aten graph (core aten decompositions plus batch norm, whose ONNX
translation ignores training mode; SDPA on its math backend); custom `torch.autograd.Function`s contribute their
own forward and backward. `torch.onnx.export(dynamo=True)` (needs onnxscript) writes that graph as plain ONNX ops,
so it runs on any ONNX Runtime build. Gradients are exactly PyTorch's. Tracing details (dynamic dims and their
fallback, tensor attributes, checkpoints, errors) are in `torch_trace.py`.

Shape rule: given `dynamic_dims`, the graph is traced with those dims symbolic and is valid for every input shape
its guards accept (`TorchGradientGraph.accepts`; those ONNX dims are dynamic). Otherwise, or when the symbolic
trace fails, the trace bakes shape-derived constants (a mean's divisor, view sizes) into the graph, so it is valid
only for the input shapes and dtypes it was traced with: its ONNX inputs keep those static shapes (ONNX Runtime
rejects other shapes instead of computing a wrong result), `TorchGradientGraph.signature` records them, and the
trainer keeps one compiled graph per signature with `ShapeKeyedCache`.

Other rules: the module is traced in its current train/eval mode (dropout in training mode draws one mask, used by
forward and backward alike). Buffers updated in place by the forward (BatchNorm's running statistics and batch
counter) are inputs, and their new values are outputs after the gradients, named `<buffer>__updated`
(compile/contract.buffer_update_name) and listed in `mutated_buffers`: exactly PyTorch's update. State of
`loss_fn` (a loss module's `weight` buffer) and plain tensor attributes are baked into the graph as constants.
Every trainable parameter must influence the loss. Tied parameters are one input and one summed gradient under
their first name.

Mixed precision (`loss_scale=(scaled_loss, loss_scale_input)`): the module computes in float16 on its float32 state
(build/export.py), the graph takes one more input after the state, the float32 scalar `loss_scale_input`, and
outputs `scaled_loss` = loss · loss_scale (float32) before the forward outputs; the backward starts from the scaled
loss, so the gradients are those of the scaled loss (float32, through each parameter's cast) — the contract of the
'ort' path's mixed-precision gradient model (graph/mixed_precision.py), which the shared tail unscales.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import onnx
import torch

from ...dtypes import torch_to_onnx
from ..compile.contract import buffer_update_name
from ..graph.passes import rewrite_enabled
from ..graph.recompute import RecomputePlan
from ..runtime.session import ShapeSignature, shape_signature
from . import torch_private
from .aten_onnx import UntranslatableGraph, translate
from .eager_fallback import export_with_eager_fallback
from .errors import GradientBuildError
from .torch_memory import invertible_layer_norm, pin_outputs
from .torch_recompute import layer_boundaries, layer_nodes, recompute_joint
from .torch_trace import (
    LOSS_SCALE_BUFFER,
    JointWrapper,
    UntraceableFunctionError,
    tensor_attributes_as_buffers,
    trace_forward,
    trace_joint,
)

_logger = logging.getLogger(__name__)

__all__ = [
    "MAX_ORT_OPSET",
    "TorchGradientGraph",
    "UntraceableFunctionError",
    "build_torch_forward_graph",
    "build_torch_gradient_graph",
]

MAX_ORT_OPSET = 21  # the newest ONNX opset ONNX Runtime 1.19 runs
RECOMPUTED_KEY = "orttrainer.recomputed_nodes"  # model metadata: how many nodes the backward recomputes


@dataclass(frozen=True)
class TraceFeatures:
    """The trainer's features that act on the traced joint graph (module docstring, "Features"): the recompute
    options (gradient/torch_recompute.py), memory-efficient gradients (gradient/torch_memory.py), and `marking`,
    a context in which the `orttrainer.debug` marks are taken while the module runs (trainer/activations.py)."""

    recompute: RecomputePlan = field(default_factory=RecomputePlan)
    memory_efficient: bool = False
    marking: Callable[[], contextlib.AbstractContextManager] | None = None


@dataclass(frozen=True)
class TorchGradientGraph:
    """A joint forward+backward ONNX model and the layout the trainer feeds and reads (see the module docstring)."""

    model: onnx.ModelProto
    input_names: list[str]  # data inputs: the first graph inputs
    state_names: list[str]  # then every parameter and buffer of the module
    output_names: list[str]  # forward outputs, loss first (mixed precision: the scaled loss before them)
    gradient_names: list[str]  # then `<p>_grad` for each trainable parameter, in `trainable` order
    signature: ShapeSignature  # input shapes and dtypes this graph was traced with
    opset_version: int
    mutated_buffers: list[str]  # buffers the forward updates in place: their new values follow the gradients
    guards: torch_private.ShapeGuards | None = None  # a dynamic-shape graph: the shapes it is valid for
    loss_scale_input: str | None = None  # mixed precision: the last graph input (module docstring)
    values: torch_private.ValueGuards | None = None  # the forward branched on values: the inputs it is valid for

    @property
    def dynamic(self) -> bool:
        """Whether the graph was traced with dynamic dims (else: valid for `signature` only)."""
        return self.guards is not None

    @property
    def dynamic_dims(self) -> list[list[int]]:
        """For each data input, the dims that are dynamic in this graph."""
        return self.guards.dynamic_dims if self.guards is not None else [[] for _ in self.input_names]

    def accepts(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether this graph computes the right result for `inputs`: their signature is the traced one, or the
        graph is dynamic, the dtypes and ranks match and the trace's shape guards hold for their sizes; and the
        branches the forward took on values go the same way for them (`values`)."""
        got = shape_signature(inputs)
        if got == self.signature:
            return self.values is None or self.values.hold(inputs)
        same_types = [(len(s), t) for s, t in got] == [(len(s), t) for s, t in self.signature]
        return self.guards is not None and same_types and self.guards.accepts(inputs)

    def check_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        """Raise ValueError unless this graph `accepts` `inputs`."""
        got = shape_signature(inputs)
        if not self.accepts(inputs):
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
    dynamic_dims: Sequence[Sequence[int]] | None = None,
    same_sizes: Sequence[Sequence[tuple[int, int]]] = (),
    loss_scale: tuple[str, str] | None = None,
    features: TraceFeatures | None = None,
    float16_casts: bool = True,
) -> TorchGradientGraph:
    """Trace `module` (+ `loss_fn`) on `sample_inputs` and return its forward+backward ONNX graph.

    `input_names` name `sample_inputs` (with a loss_fn the last one is the label, as in `_ModelWithLoss`);
    `output_names` name the first outputs of `(loss, *module outputs)`; `trainable` get `<p>_grad` outputs;
    `frozen` parameters (and parameters in neither list) get none. `opset_version` below 18 is raised to 18 (the
    exporter's minimum); above 21 is an error. `dynamic_dims[i]` lists the dims of input i to keep dynamic (see
    the module docstring; None: none), `same_sizes` groups of (input, dim) that are one size, `loss_scale` the
    (scaled loss, loss-scale input) names under mixed precision (module docstring; `float16_casts` False: the
    module computes in float16 itself, only the loss scale is added), `features` what else acts on the trace
    (`TraceFeatures`). Raises
    GradientBuildError (UntraceableFunctionError for a custom Function that cannot be traced) when PyTorch
    cannot trace or export the model.
    """
    _check_arguments(module, input_names, sample_inputs, trainable, frozen)
    opset = _effective_opset(opset_version)
    inputs = [t.detach() for t in sample_inputs]  # gradients are for parameters only
    names = [loss_scale[0], *output_names] if loss_scale else list(output_names)
    request = _Trace(
        module,
        loss_fn,
        list(input_names),
        inputs,
        names,
        list(trainable),
        opset,
        same_sizes,
        loss_scale,
        features or TraceFeatures(),
        float16_casts,
    )
    if dynamic_dims is not None and any(dynamic_dims):
        try:
            return _build(request, dynamic_dims)
        except GradientBuildError as err:
            if err.unreachable:  # parameters without gradient: the caller freezes them
                raise
            _log_dynamic_failure(module, inputs, err)
        except Exception as err:  # the concrete-shape build names real errors
            _log_dynamic_failure(module, inputs, err)
    return _build(request, None)


def build_torch_forward_graph(
    wrapper: torch.nn.Module,
    module: torch.nn.Module,
    input_names: Sequence[str],
    inputs: Sequence[torch.Tensor],
    output_names: Sequence[str],
    opset_version: int = torch_private.MIN_DYNAMO_OPSET,
    float16: bool = False,
) -> tuple[onnx.ModelProto, torch_private.ValueGuards | None]:
    """The forward-only ONNX model of `wrapper` (a module around `module` returning its outputs as a flat tuple,
    loss first: build/torch_route._EvalForward) for the shapes of `inputs`, translated directly
    (gradient/aten_onnx.py): graph inputs are the data (`input_names`) then every state tensor of `module` under
    its first name, as in the builder's contract (module docstring); graph outputs are the first
    len(output_names) outputs, so named, then the new value of each buffer the forward updates in place
    (`<buffer>__updated`). State of `wrapper` outside `module` (a loss module's weight) and tensor attributes are
    constants. Traced in the mode the module is in; `float16`: the wrapper computes in float16 (mixed precision).
    With the model, the value guards of its branches on values (None: none; gradient/torch_trace.py). A graph the
    direct translation does not cover (a size the values decide: `x[mask]`, `masked_select`) goes to torch.onnx,
    as the training graph does. Raises UntranslatableGraph when torch.onnx fails too, PyTorch's error when the
    trace fails."""
    opset = _effective_opset(opset_version)
    canonical = _canonical_names(module)  # before tracing: tensor attributes are buffers only while it runs
    state = {name: tensor.detach() for name, tensor in [*module.named_parameters(), *module.named_buffers()]}
    graph, sig, values = trace_forward(wrapper, inputs, float16)
    state_inputs, mutated = _rewrite_joint(
        graph, sig, _traced_state(wrapper), canonical, [], len(output_names), type(module).__name__
    )
    outputs = [*output_names, *map(buffer_update_name, mutated)]
    try:
        model = translate(graph, [*state_inputs, *input_names], outputs, opset)
    except UntranslatableGraph as err:
        _logger.info("the direct ONNX translation does not cover this eval graph (%s); using torch.onnx", err)
        del graph
        graph, sig, _ = trace_forward(wrapper, inputs, float16, for_torch_onnx=True)  # its decompositions
        state_inputs, _ = _rewrite_joint(
            graph, sig, _traced_state(wrapper), canonical, [], len(output_names), type(module).__name__
        )
        graph.recompile()  # the rewrites edited the graph only; torch.onnx runs its Python code
        try:
            model = export_with_eager_fallback(
                graph, [*(state[n] for n in state_inputs), *inputs], [*state_inputs, *input_names], outputs, opset
            )
        except Exception as onnx_err:
            raise UntranslatableGraph(f"{err}; torch.onnx: {type(onnx_err).__name__}: {onnx_err}") from onnx_err
    del graph  # the traced graph and its fake tensors are not needed any more
    return _order_inputs(model, list(input_names), {n: state[n] for n in canonical.values()}), values


def _log_dynamic_failure(module: torch.nn.Module, inputs: Sequence[torch.Tensor], err: Exception) -> None:
    _logger.info(
        "the dynamic-shape trace of %s failed (%s: %s); tracing it for the shapes %s only",
        type(module).__name__,
        type(err).__name__,
        str(err).strip().split("\n")[0],
        [list(t.shape) for t in inputs],
    )


@dataclass(frozen=True)
class _Trace:
    module: torch.nn.Module
    loss_fn: Callable | None
    input_names: list[str]
    inputs: list[torch.Tensor]
    output_names: list[str]
    trainable: list[str]
    opset: int
    same_sizes: Sequence[Sequence[tuple[int, int]]]
    loss_scale: tuple[str, str] | None  # (scaled loss output, loss-scale input) under mixed precision
    features: TraceFeatures
    float16_casts: bool  # under mixed precision: the trace casts the state and inputs (False: the module does)


def _build(request: _Trace, dynamic_dims: Sequence[Sequence[int]] | None) -> TorchGradientGraph:
    """The graph traced with `dynamic_dims` (None: the sample's shapes). A graph with static shapes is translated
    to ONNX directly (gradient/aten_onnx.py) when it can be (switch: `graph/passes.rewrite_enabled(
    "aten_translation")`), else by torch.onnx, for which it is traced again with torch.onnx's decompositions."""
    if dynamic_dims is None and rewrite_enabled("aten_translation"):
        try:
            return _traced_and_translated(request, None, direct=True)
        except UntranslatableGraph as err:
            _logger.info("the direct ONNX translation does not cover this graph (%s); using torch.onnx", err)
    return _traced_and_translated(request, dynamic_dims, direct=False)


def _traced_and_translated(
    request: _Trace, dynamic_dims: Sequence[Sequence[int]] | None, direct: bool
) -> TorchGradientGraph:
    module, input_names, inputs, trainable = request.module, request.input_names, request.inputs, request.trainable
    wrapper, canonical, state = _wrap(request)
    graph, sig, guards, values = trace_joint(
        wrapper, inputs, trainable, dynamic_dims, request.same_sizes, for_torch_onnx=not direct
    )
    if guards is not None and not any(guards.dynamic_dims):
        guards = None  # the trace specialised every dynamic dim: valid for the sample's shapes only
    state_inputs, mutated = _rewrite_joint(
        graph, sig, _traced_state(wrapper), canonical, trainable, len(request.output_names), type(module).__name__
    )
    graph, recomputed = _apply_features(graph, request)
    output_names = [*request.output_names, *(f"{p}_grad" for p in trainable), *map(buffer_update_name, mutated)]
    if direct:
        model = translate(graph, [*state_inputs, *input_names], output_names, request.opset)
        del graph  # the traced graph and its fake tensors are not needed any more
        return _gradient_graph(request, model, state, canonical, mutated, None, recomputed, values)
    # The rewrites since the trace edited the graph only; torch.onnx runs its Python code, generated here once (on
    # the LSTM's joint graph of 9,000 nodes a generation takes 0.34 s; the direct translation reads the nodes)
    graph.recompile()
    try:
        model = export_with_eager_fallback(  # ops without an ONNX translation run in PyTorch (see there)
            graph,
            [*(state[n] for n in state_inputs), *inputs],
            [*state_inputs, *input_names],
            output_names,
            request.opset,
            None if guards is None else [*([] for _ in state_inputs), *guards.dynamic_dims],
        )
    except Exception as err:
        raise GradientBuildError(
            f"torch.onnx could not export the traced forward+backward graph of "
            f"{type(module).__name__} to ONNX opset {request.opset}: {err}"
        ) from err
    return _gradient_graph(request, model, state, canonical, mutated, guards, recomputed, values)


def _gradient_graph(
    request: _Trace,
    model: onnx.ModelProto,
    state: dict[str, torch.Tensor],
    canonical: dict[int, str],
    mutated: list[str],
    guards: torch_private.ShapeGuards | None,
    recomputed: int,
    values: torch_private.ValueGuards | None,
) -> TorchGradientGraph:
    """The translated `model` as the builder's result; `recomputed`: the nodes recompute copied (metadata)."""
    input_names = request.input_names
    model = _order_inputs(model, list(input_names), {n: state[n] for n in canonical.values()})  # the scale last
    if request.features.recompute:
        model.metadata_props.add(key=RECOMPUTED_KEY, value=str(recomputed))
    scale_input = request.loss_scale[1] if request.loss_scale else None
    state_names = [n for n in canonical.values() if n != scale_input]
    return TorchGradientGraph(
        model,
        input_names,
        state_names,
        request.output_names,
        [f"{p}_grad" for p in request.trainable],
        shape_signature(request.inputs),
        request.opset,
        mutated,
        guards,
        scale_input,
        values,
    )


def _wrap(request: _Trace) -> tuple[JointWrapper, dict[int, str], dict[str, torch.Tensor]]:
    """The wrapper to trace, id(tensor) -> its state name (`_canonical_names`; under mixed precision the wrapper's
    loss-scale buffer too, last, named as the loss-scale input) and the state tensors by those names."""
    module = request.module
    hooks = _trace_hooks(request) if _has_hooks(request.features) else None
    wrapper = JointWrapper(
        module, request.loss_fn, request.input_names, request.loss_scale is not None, hooks, request.float16_casts
    )
    canonical = _canonical_names(module)  # before tracing: tensor attributes are buffers only while it runs
    state = {name: tensor.detach() for name, tensor in [*module.named_parameters(), *module.named_buffers()]}
    if request.loss_scale:
        scale = getattr(wrapper, LOSS_SCALE_BUFFER)
        canonical[id(scale)], state[request.loss_scale[1]] = request.loss_scale[1], scale
    return wrapper, canonical, state


def _has_hooks(features: TraceFeatures) -> bool:
    return features.marking is not None or features.memory_efficient or features.recompute.layers is not None


def _trace_hooks(request: _Trace) -> Callable[[], contextlib.AbstractContextManager]:
    """The context the module runs in while traced: the activation marks, each transformer layer's boundaries
    (layer recompute), layer norms with the invertible gradient (memory-efficient gradients)."""
    features = request.features

    @contextlib.contextmanager
    def hooks() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if features.marking is not None:
                stack.enter_context(features.marking())
            if features.recompute.layers is not None:
                stack.enter_context(layer_boundaries(request.module))
            if features.memory_efficient:
                stack.enter_context(invertible_layer_norm())
            yield

    return hooks


def _apply_features(graph: torch.fx.GraphModule, request: _Trace) -> tuple[torch.fx.GraphModule, int]:
    """The traced joint graph with recompute applied and, with recompute or memory-efficient gradients, every
    output pinned where autograd computes it (gradient/torch_memory.py); the layer marks removed. Returns the
    graph and how many nodes its backward recomputes. Recompute's notes become warnings."""
    features, forward_outputs = request.features, len(request.output_names)
    layers = layer_nodes(graph)
    recomputed = 0
    if features.recompute:
        result = recompute_joint(graph, features.recompute, forward_outputs, layers)
        graph, recomputed = result.graph, result.count
        for note in result.notes:
            warnings.warn(f"options {note}", stacklevel=2)
    if features.recompute or features.memory_efficient:
        pin_outputs(graph)
    return graph, recomputed


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
    complex_state = [n for n, t in module.state_dict(keep_vars=True).items() if t.is_complex()]
    if complex_state:  # complex values inside the graph are pairs of reals (gradient/aten_onnx_complex.py)
        raise GradientBuildError(
            f"{type(module).__name__} holds complex tensors as state ({', '.join(complex_state)}): ONNX Runtime "
            "keeps no complex tensor between steps. Keep a complex constant as a non-persistent buffer "
            "(register_buffer(name, tensor, persistent=False)) or a plain tensor attribute (the graph holds "
            "either as a constant), compute it in forward, or register torch.view_as_real(tensor) and call "
            "torch.view_as_complex on it in forward"
        )
    complex_inputs = [n for n, t in zip(input_names, sample_inputs, strict=True) if t.is_complex()]
    if complex_inputs:
        raise GradientBuildError(
            f"complex inputs ({', '.join(complex_inputs)}): ONNX Runtime takes none; pass torch.view_as_real(input) "
            "and call torch.view_as_complex on it in forward"
        )


def _effective_opset(opset_version: int) -> int:
    if opset_version > MAX_ORT_OPSET:
        raise ValueError(f"ONNX Runtime 1.19 runs ONNX opsets up to {MAX_ORT_OPSET}, got opset {opset_version}")
    # the dynamo exporter translates to opset >= 18 only; converting down fails on common ops
    return max(opset_version, torch_private.MIN_DYNAMO_OPSET)


def _traced_state(wrapper: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The wrapper's state by qualified name, as the trace named it (tensor attributes included)."""
    with tensor_attributes_as_buffers(wrapper):
        return {
            **dict(wrapper.named_parameters(remove_duplicate=False)),
            **dict(wrapper.named_buffers(remove_duplicate=False)),
        }


def _canonical_names(module: torch.nn.Module) -> dict[int, str]:
    """id(tensor) -> the module's name for it: its first name, so tied parameters share one. A complex buffer that
    is not persistent (torchtitan's rotary table, `register_buffer("freqs_cis", ..., persistent=False)`) is left
    out: the graph holds it as a constant, as a plain tensor attribute, since ONNX Runtime keeps no complex tensor
    between steps (`_check_arguments` refuses complex state) and a checkpoint never holds it."""
    persistent = module.state_dict(keep_vars=True)
    names: dict[int, str] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if not (tensor.is_complex() and name not in persistent):
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
    """Put the traced graph into the contract's shape, in place (the graph only, not its Python code). Returns
    (state placeholder names in graph order, mutated buffers).

    Rules: a tied parameter's placeholders merge into the first one; state that is not the module's (the loss
    function's) becomes a constant; outputs become the first `n_outputs` user outputs, then one gradient per
    trainable parameter (the sum of its tied copies' gradients), then the new value of each module buffer the
    forward updates in place, in name order (other in-place updates, of inputs, are dropped)."""
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
    updates: dict[str, torch.fx.Node] = {}  # module buffer -> its value after the forward's in-place update
    for value, (kind, name) in zip(values, sig.outputs, strict=True):
        if kind == "gradient":
            grads.setdefault(canonical[id(tensors[name])], []).append(value)
        elif kind == "mutation" and name in tensors and id(tensors[name]) in canonical:
            updates[canonical[id(tensors[name])]] = value
        elif kind == "mutation" and name in tensors and tensors[name].is_complex():  # a constant (_canonical_names)
            buffer = name.removeprefix("inner.").removeprefix("model.")  # past JointWrapper and _EvalForward
            raise GradientBuildError(
                f"{model_name} writes into its complex buffer {buffer} in forward: the graph holds a complex buffer "
                "as a constant. Register torch.view_as_real(tensor) as the buffer and call torch.view_as_complex "
                "on it in forward"
            )
    with fx.inserting_before(out):
        summed = [_sum_nodes(fx, grads[p]) for p in trainable]
    mutated = sorted(updates)
    out.args = (tuple(user[:n_outputs] + summed + [updates[b] for b in mutated]),)
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
        value = total.meta.get("val")
        total = fx.call_function(torch.ops.aten.add.Tensor, (total, node))
        if value is not None:
            total.meta["val"] = value  # the sum of gradients of one tensor: its shape and dtype
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
