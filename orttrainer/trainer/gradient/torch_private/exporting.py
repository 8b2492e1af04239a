"""torch.onnx's dynamo exporter, for aten graphs (the torch builder's traces) and modules (the eval forward).

Part of `torch_private` (see its docstring for the rule); verified on torch 2.13.0 with onnxscript 0.7.2 and onnx
1.17.0.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import onnx
import torch

from .custom_ops import register_translations
from .custom_ops import translations as own_translations

# The oldest opset torch's ONNX translations (onnxscript torchlib) are written for. Lower requests go through a
# version converter that fails on common ops (verified: opset 14 -> "No Adapter From Version $16 for Identity").
MIN_DYNAMO_OPSET = 18


_logger = logging.getLogger(__name__)
_UNSUPPORTED_AT_OPSET = re.compile(
    r"operator '(?P<op>[^']+)' to ONNX opset version (?P<opset>\d+) is not supported\. "
    r"Support for this operator was added in version (?P<needed>\d+)"
)


def unsupported_at_opset(err: BaseException) -> tuple[str, int, int] | None:
    """(op, requested opset, first opset that has it) when the TorchScript exporter refused an operator at the
    requested opset but supports it at a later one (`torch.onnx.errors.UnsupportedOperatorError`, anywhere in
    `err`'s cause chain); None otherwise."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, torch.onnx.errors.UnsupportedOperatorError):
            match = _UNSUPPORTED_AT_OPSET.search(str(seen))
            if match:
                return match["op"], int(match["opset"]), int(match["needed"])
        seen = seen.__cause__ or seen.__context__
    return None


@functools.lru_cache(maxsize=4)
def _registry(opset_version: int) -> Any:
    """torch.onnx's table of ONNX translations (onnxscript torchlib) for an opset, with orttrainer's own operators
    (`custom_ops.py`); building one takes ~1.5 s."""
    from torch.onnx._internal.exporter import _registration

    registry = _registration.ONNXRegistry.from_torchlib(opset_version=opset_version)
    register_translations(registry)
    return registry


@functools.lru_cache(maxsize=1)
def onnx_decompositions() -> dict:
    """The decompositions torch.onnx applies to the ops it has no ONNX translation for (e.g. `aten.squeeze.dims`).

    Why: the torch builder traces with these too (`tracing.trace_decompositions`), so its graphs contain only
    translatable ops and `export_graph_to_onnx` can skip the exporter's own decomposition pass, which re-traces
    the whole graph (5.4 of the 13.5 s a dynamic-shape transformer export took, verified on 2.13)."""
    from torch.onnx._internal.exporter import _decomp

    implemented = set(_decomp.get_onnx_implemented_overloads(_registry(MIN_DYNAMO_OPSET)))
    return dict(_decomp.create_onnx_friendly_decomposition_table(implemented))


def has_translation(target: Any, opset_version: int) -> bool:
    """Whether torch.onnx has an ONNX translation for an fx node's `target`; True for what is not an aten-level op
    overload (`operator.getitem`, which the exporter handles itself)."""
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return bool(_registry(max(opset_version, MIN_DYNAMO_OPSET)).is_registered(target))


def failed_node(err: BaseException) -> tuple[str, str] | None:
    """(name, op) of the fx node whose translation failed, from the exporter's error ("Error when translating node
    %cholesky : [num_users=2] = call_function[target=torch.ops.aten.cholesky.default]..."; in the error or its
    causes), else None. The name is the exporter's: torch.export names a graph's nodes again, `<op>` then
    `<op>_1`, `<op>_2`... in graph order."""
    import re

    while err is not None:
        found = re.search(r"Error when translating node %(\w+) : .*?target=torch\.ops\.([\w.]+)\]", str(err))
        if found:
            return found.group(1), found.group(2)
        err = err.__cause__  # type: ignore[assignment]
    return None


def untranslated_op(err: BaseException) -> str | None:
    """The op ("aten.x.default") torch.onnx found no translation for or failed to translate, from a module
    export's error ("No ONNX function found for <OpOverload(op='aten.x', overload='default')>", or `failed_node`'s
    text; in the error or its causes), else None."""
    import re

    failed = failed_node(err)
    if failed is not None:
        return failed[1]
    while err is not None:
        found = re.search(r"No ONNX function found for <OpOverload\(op='([\w.]+)', overload='(\w+)'\)>", str(err))
        if found:
            return f"{found.group(1)}.{found.group(2)}"
        err = err.__cause__  # type: ignore[assignment]
    return None


def record_node(domain: str, op_type: str, inputs: Sequence[Any], attributes: dict[str, Any], outputs: int) -> list:
    """Inside a translation function (`export_module_to_onnx`'s `translations`), while torch.onnx translates a
    node: add one ONNX node to the graph being built and return its output values."""
    import onnx_ir as ir
    from torch.onnx._internal.exporter import _core

    tracer = _core.current_tracer
    if tracer is None:
        raise RuntimeError("record_node is called outside a torch.onnx translation")
    node = ir.Node(
        domain, op_type, list(inputs), ir.convenience.convert_attributes(attributes), num_outputs=outputs, version=1
    )
    tracer.nodes.append(node)
    return list(node.outputs)


def export_graph_to_onnx(
    graph: torch.nn.Module,
    args: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    opset_version: int,
    dynamic_dims: Sequence[Sequence[int]] | None = None,
    allow_static: bool = False,
) -> onnx.ModelProto:
    """ONNX model of `graph` (an aten-level graph, or a module in the mode it should be exported in) through
    `torch.onnx.export(dynamo=True)` (needs onnxscript).

    Rules: input shapes stay static, except the dims `dynamic_dims[i]` of input i, which must stay dynamic (a
    trace that specialises one raises) or, with `allow_static`, stay dynamic unless the trace specialises them
    (torch.export's Dim.AUTO: read the result's input shapes); opset_version must be >= MIN_DYNAMO_OPSET; the IR
    version is capped at 10 (the newest ONNX Runtime 1.19 loads). An aten graph traced with
    `onnx_decompositions` is translated without the exporter's decomposition pass (`_export_decomposed`); if
    that fails, through `torch.onnx.export`. An aten graph's int32 indices are read as int64 first
    (`int64_indices`)."""
    if opset_version < MIN_DYNAMO_OPSET:
        raise ValueError(f"torch.onnx's dynamo exporter writes opset >= {MIN_DYNAMO_OPSET}, got {opset_version}")
    if isinstance(graph, torch.fx.GraphModule):
        int64_indices(graph)
    if isinstance(graph, torch.fx.GraphModule) and not allow_static:
        try:
            if dynamic_dims is None or not any(dynamic_dims):
                model = _translate_static(graph, input_names, output_names, opset_version)
            else:
                model = _export_decomposed(graph, args, input_names, output_names, opset_version, dynamic_dims)
        except Exception as err:
            if _no_onnx_function(err):  # the graph is decomposed with the exporter's table already: nothing to add
                raise
            _logger.debug("direct ONNX translation failed (%s: %s); using torch.onnx.export", type(err).__name__, err)
            try:  # its error is vaguer than the direct one
                model = _export(graph, args, input_names, output_names, opset_version, dynamic_dims, False).model_proto
            except Exception:
                raise err from None
    else:
        model = _export(graph, args, input_names, output_names, opset_version, dynamic_dims, allow_static).model_proto
    model.ir_version = min(model.ir_version, 10)
    return model


def views_as_reshapes(graph: torch.fx.GraphModule) -> None:
    """Rule: every `aten.view` of the graph becomes `aten.reshape`, every `aten.contiguous` an explicit
    `aten.clone(memory_format=torch.contiguous_format)` (in place).

    Why: a view traced on a tensor that the eager kernel left contiguous (`x.transpose(1, 2).contiguous()` then a
    view, where `.contiguous()` did nothing) fails when torch.onnx re-traces the graph with its decompositions'
    strides ("Cannot view a tensor with shape ... and strides ...": transformers' T5 after SDPA,
    nn.TransformerDecoderLayer; torch 2.13). ONNX tensors have no strides: a Reshape and an Identity either way."""
    aten = torch.ops.aten
    changed = False
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.view.default and 0 not in node.args[1]:  # a 0 is "keep this dim" for Reshape
            node.target, changed = aten.reshape.default, True
        elif node.target is aten.contiguous.default:
            node.target, node.args = aten.clone.default, node.args[:1]
            node.kwargs, changed = {"memory_format": torch.contiguous_format}, True
    if changed:
        graph.recompile()


def int64_indices(graph: torch.fx.GraphModule) -> None:
    """Rule: each int32 index tensor of `aten.index`, `aten.index_put` and their `_unsafe_` forms is read through
    `aten._to_copy(index, dtype=torch.int64)` (in place; the other indices and ops are unchanged).

    Why: torch.onnx writes these ops as GatherND and ScatterND, whose indices ONNX defines as int64 only, and passes
    an int32 index through, so ONNX Runtime refuses the graph ("Type 'tensor(int32)' ... of operator (ScatterND) ...
    is invalid"). PyTorch's own decomposition of `unfold_backward` (the backward of `Tensor.unfold`, `torch.stft`)
    indexes with an int32 `arange` (torch 2.13)."""
    aten = torch.ops.aten
    indexing = {aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default, aten._unsafe_index_put.default}
    changed = False
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target not in indexing or len(node.args) < 2:
            continue
        indices = list(node.args[1])
        for position, index in enumerate(indices):
            value = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int32:
                continue
            with graph.graph.inserting_before(node):
                wide = graph.graph.call_function(aten._to_copy.default, (index,), {"dtype": torch.int64})
            wide.meta["val"] = value.to(torch.int64)
            indices[position] = wide
            node.args, changed = (node.args[0], indices, *node.args[2:]), True
    if changed:
        graph.recompile()


def _no_onnx_function(err: BaseException) -> bool:
    """True for the exporter's "No ONNX function found for <op>" (in the error or its cause)."""
    while err is not None:
        if "No ONNX function found" in str(err):
            return True
        err = err.__cause__  # type: ignore[assignment]
    return False


def _export_decomposed(
    graph: torch.fx.GraphModule,
    args: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    opset_version: int,
    dynamic_dims: Sequence[Sequence[int]] | None,
) -> onnx.ModelProto:
    """`torch.onnx.export(dynamo=True)`'s steps (torch 2.13, `_core.export`) minus the decomposition pass:
    torch.export, explicit type promotion, no assertion nodes, translation, opset conversion, optimisation,
    renaming. A dim torch.export would specialise raises (no refinement from its suggested fixes)."""
    from torch.onnx._internal._lazy_import import onnxscript_apis
    from torch.onnx._internal.exporter import _core, _fx_passes

    graph.eval()  # an aten graph has no train/eval behaviour; this only silences the exporter's training warning
    shapes = None
    if dynamic_dims is not None and any(dynamic_dims):
        shapes = tuple({d: torch.export.Dim.DYNAMIC for d in dims} or None for dims in dynamic_dims)
    views_as_reshapes(graph)
    with _quiet_exporter():
        exported = torch.export.export(graph, tuple(args), dynamic_shapes=shapes, strict=False)
        module = exported.graph_module
        _fx_passes.insert_type_promotion_nodes(module)
        exported._graph_module = _fx_passes.remove_assertion_nodes(module)
        program = _core._exported_program_to_onnx_program(exported, registry=_registry(opset_version))
        program.model = onnxscript_apis.convert_version(program.model, opset_version)
        program.optimize()
    _name_ends(program.model, input_names, output_names)
    return program.model_proto


def _translate_static(
    graph: torch.fx.GraphModule, input_names: list[str], output_names: list[str], opset_version: int
) -> onnx.ModelProto:
    """`_export_decomposed` for a traced graph with static shapes, without torch.export and with a lighter
    optimiser: the graph is translated as it is (every placeholder a user input, every output a user output),
    then its constants folded, unused nodes removed and common subexpressions merged.

    Why: torch.export re-traces the whole graph with fake tensors only to hand the translator the graph it was
    given, whose nodes already carry their shapes and dtypes (`meta["val"]`), and onnxscript's default rewrite
    rules try every rule on every node (105,650 match attempts on the benchmark transformer); together 8.2 of the
    10 s its static export took (docs/engine.md §19). ONNX Runtime's own optimiser removes the no-op nodes those
    rules would have removed when it creates the session."""
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import _constant_folding
    from torch.export import graph_signature as gs
    from torch.onnx._internal._lazy_import import onnxscript_apis
    from torch.onnx._internal.exporter import _core, _fx_passes

    for node in graph.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(graph, str(node.target), None), torch.Tensor):
            node.meta["val"] = getattr(graph, str(node.target))  # a constant: the translator writes its value
    with _quiet_exporter():
        _fx_passes.insert_type_promotion_nodes(graph)
        graph = _fx_passes.remove_assertion_nodes(graph)
        placeholders = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
        outputs = [str(v.name) for v in graph.graph.output_node().args[0]]  # type: ignore[union-attr]
        signature = gs.ExportGraphSignature(
            [gs.InputSpec(gs.InputKind.USER_INPUT, gs.TensorArgument(n), None) for n in placeholders],
            [gs.OutputSpec(gs.OutputKind.USER_OUTPUT, gs.TensorArgument(n), None) for n in outputs],
        )
        traced: Any = _TracedProgram(graph, signature)  # what the translator reads of an ExportedProgram
        program = _core._exported_program_to_onnx_program(traced, registry=_registry(opset_version))
        if opset_version != MIN_DYNAMO_OPSET:
            program.model = onnxscript_apis.convert_version(program.model, opset_version)
        model = program.model
        for step in (
            common_passes.InlinePass(),
            _constant_folding.FoldConstantsPass(
                shape_inference=True,
                input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
            ),
            common_passes.RemoveUnusedNodesPass(),
            common_passes.RemoveUnusedFunctionsPass(),
            common_passes.RemoveUnusedOpsetsPass(),
            common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
            common_passes.DeduplicateInitializersPass(),
            common_passes.CommonSubexpressionEliminationPass(),
            common_passes.OutputFixPass(),
            common_passes.NameFixPass(),
        ):
            step(model)
    _name_ends(model, input_names, output_names)
    return program.model_proto


class _TracedProgram:
    """What the translator (`_core._exported_program_to_onnx_program`) reads of an ExportedProgram, for a traced
    graph whose state is passed as user inputs: no parameters, buffers or lifted constants."""

    def __init__(self, graph: torch.fx.GraphModule, signature: Any) -> None:
        self.graph_module, self.graph, self.graph_signature = graph, graph.graph, signature
        self.range_constraints: dict = {}
        self.constants: dict = {}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())


DimSpec = int | tuple[int, int | None]  # a static size, or a dynamic dim's (min, max) range (max None: unbounded)


def export_module_to_onnx(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    opset_version: int,
    dynamic_dims: Sequence[Sequence[int]],
    translations: dict | None = None,
) -> tuple[onnx.ModelProto, list[list[DimSpec]]]:
    """`export_graph_to_onnx(..., allow_static=True)` for a module, and each input's dims as torch.export traced
    them: the size of a static (or specialised) dim, the range of a dynamic one. The ONNX inputs get those
    static sizes too. Why: torch.onnx leaves a dim declared dynamic symbolic in the ONNX inputs even when
    torch.export specialised it (verified on 2.13), and drops the runtime assertions of its ranges.
    `translations` (op overload -> function) replace or add torch.onnx's translations of those ops."""
    from .tracing import causal_mask_from_hint, linalg_checks_untraced, module_state_kept

    with causal_mask_from_hint(), module_state_kept(module), linalg_checks_untraced():  # see there
        program = _export(
            module,
            args,
            input_names,
            output_names,
            opset_version,
            dynamic_dims,
            allow_static=True,
            keep_state=True,
            translations=translations,
        )
    exported = program.exported_program
    if exported is None:
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no exported program")
    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    specs: list[list[DimSpec]] = []
    for name in exported.graph_signature.user_inputs:
        shape = placeholders[name].meta["val"].shape
        specs.append([_dim_spec(size, exported.range_constraints) for size in shape])
    model = program.model_proto
    model.ir_version = min(model.ir_version, 10)
    for value, dims in zip(model.graph.input, specs, strict=False):  # user inputs come first
        for dim, spec in zip(value.type.tensor_type.shape.dim, dims, strict=True):
            if isinstance(spec, int):
                dim.dim_value = spec
    return model, specs


def _dim_spec(size: Any, ranges: dict) -> DimSpec:
    if isinstance(size, int):
        return size
    symbol = size.node.expr
    bounds = ranges.get(symbol)
    if bounds is None:
        return (0, None)
    import sympy
    from torch.utils._sympy.numbers import int_oo  # torch's integer infinity (its `is_finite` is True)

    lower, upper = int(bounds.lower), None if bounds.upper in (int_oo, sympy.oo) else int(bounds.upper)
    return lower if lower == upper else (lower, upper)  # a symbol pinned to one value is a specialised dim


def _export(
    graph: torch.nn.Module,
    args: Sequence[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
    opset_version: int,
    dynamic_dims: Sequence[Sequence[int]] | None,
    allow_static: bool,
    keep_state: bool = False,
    translations: dict | None = None,
) -> Any:
    """`torch.onnx.export(dynamo=True)`. With `keep_state`, the module's parameters and buffers stay initializers
    of the graph with all their uses, whatever their values (`_optimize_keeping_state`). Why: the optimiser folds
    initializers as constants (a zero Gemm bias is dropped, verified with onnxscript 0.7.2), but the trainer feeds
    the eval graph the trained values under those names (`set_initializers`, the session's state)."""
    if opset_version < MIN_DYNAMO_OPSET:
        raise ValueError(f"torch.onnx's dynamo exporter writes opset >= {MIN_DYNAMO_OPSET}, got {opset_version}")
    if isinstance(graph, torch.fx.GraphModule):
        graph.eval()  # an aten graph has no train/eval behaviour; this only silences the exporter's training warning
    shapes: Any = None
    if dynamic_dims is not None and any(dynamic_dims):
        kind = torch.export.Dim.AUTO if allow_static else torch.export.Dim.DYNAMIC
        shapes = tuple({d: kind for d in dims} or None for dims in dynamic_dims)
        if _takes_varargs(graph):  # torch.export matches dynamic_shapes to forward's parameters: *inputs is one
            shapes = (shapes,)
    options: dict[str, Any] = {
        "opset_version": opset_version,
        "dynamo": True,
        "optimize": not keep_state,
        "verify": False,
        "report": False,
        "verbose": False,
        # orttrainer's own operators (custom_ops.py), and the caller's (op overload -> translation function)
        "custom_translation_table": {**own_translations(), **(translations or {})},
    }
    with _quiet_exporter():
        try:
            program = torch.onnx.export(graph, tuple(args), dynamic_shapes=shapes, **options)
        except Exception as err:
            if "Cannot view a tensor" not in str(err):
                raise
            # torch.export first, with views written as reshapes (`views_as_reshapes`), then torch.onnx
            exported = torch.export.export(graph, tuple(args), dynamic_shapes=shapes, strict=False)
            views_as_reshapes(exported.graph_module)
            program = torch.onnx.export(exported, tuple(args), **options)
    if program is None:  # dynamo=True always returns a program
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no ONNX program")
    if keep_state:
        _optimize_keeping_state(program)
    _name_ends(program.model, input_names, output_names)
    return program


def _name_ends(model: Any, input_names: Sequence[str], output_names: Sequence[str]) -> None:
    """Name the graph's first inputs `input_names` and first outputs `output_names`, in order. A value of the graph
    that already has one of these names (the exporter names values `val_<k>`, and an ONNX model saved from the
    torch route has initializers so named) is renamed first. Why not the exporter's own renaming: it renames
    without looking, leaving two values with one name (verified on torch 2.13)."""
    from onnx_ir.traversal import RecursiveGraphIterator

    graph = model.graph
    ends = [*zip(graph.inputs, input_names, strict=False), *zip(graph.outputs, output_names, strict=False)]
    wanted = [name for _, name in ends]
    if len(set(wanted)) < len(wanted):
        raise ValueError(f"input and output names must be distinct: {wanted}")
    values = [*graph.inputs, *graph.initializers.values()]
    values += [value for node in RecursiveGraphIterator(graph) for value in node.outputs]
    taken = {v.name for v in values} | set(wanted)
    ours = {id(v) for v, _ in ends}
    for value in values:
        if value.name in wanted and id(value) not in ours:
            k = 1
            while f"{value.name}_{k}" in taken:
                k += 1
            value.name = f"{value.name}_{k}"
            taken.add(value.name)
    for value, name in ends:
        value.name = name


def _optimize_keeping_state(program: Any) -> None:
    """`program.optimize()` with the module's parameters and buffers out of its reach: meanwhile each is a plain
    graph input without a value (the optimiser reads an initializer's value even when it is also an input), then
    an initializer again, with its value."""
    signature = program.exported_program.graph_signature
    names = {*signature.parameters, *signature.buffers}
    graph = program.model.graph
    state = {name: (value, value.const_value) for name, value in graph.initializers.items() if name in names}
    for name, (value, _) in state.items():
        graph.initializers.pop(name)
        value.const_value = None
        graph.inputs.append(value)
    with _quiet_exporter():
        program.optimize()
    graph = program.model.graph
    for value, const in state.values():
        graph.inputs.remove(value)
        value.const_value = const
        graph.register_initializer(value)


def _takes_varargs(module: torch.nn.Module) -> bool:
    parameters = list(inspect.signature(module.forward).parameters.values())
    return len(parameters) == 1 and parameters[0].kind is inspect.Parameter.VAR_POSITIONAL


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
