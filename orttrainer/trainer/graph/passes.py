"""The graph-pass contract, and `run_passes`, which applies a list of passes.

A pass (`GraphPass`) has
* a `name`, used in its errors and as the stage name `run_passes` saves the model under;
* a rule: what it does to the graph, stated in the docstring of its function (`FunctionPass.rule`);
* a precondition, `check(model)`, which raises `PassPreconditionError` naming the pass and what is wrong;
* a declaration `mutates_input`: True when `apply` may modify its argument (and returns it), False when it returns
  a new model (or its argument unchanged) and leaves the argument as it was.

Verification (`verify=True`, by default when the environment sets `ORTTRAINER_VERIFY_PASSES=1`, as the test suite
does): after every pass, the result's node list is in topological order and `onnx.checker.check_model` accepts it,
and a pass declared as copying has left its argument byte for byte as it was. onnx 1.17's checker validates the
nodes of the domains it has schemas for (`ai.onnx`, `ai.onnx.ml`, `ai.onnx.training`, `ai.onnx.preview.training`:
op, attributes, input and output counts) and the model's structure (single assignment, topological order, opset
imports); for a node of any other domain (`com.microsoft`: ONNX Runtime's `GatherGrad`, `SoftmaxCrossEntropyLossGrad`,
`PassThrough`, `YieldOp`; `ai.onnx.contrib`) it only requires the domain to be imported, so those graphs pass and
those nodes are not checked (measured: `tests/test_graph_passes.py`). The checker also requires every graph input
and output to declare an element type and a shape; ONNX Runtime does not (an absent shape is an unknown rank), and
`append_statistics` declares some outputs so, so the checker runs on a copy where such declarations are completed
with placeholders (which it does not compare with anything).

Preconditions: a check returns `None` when the condition holds, else one sentence saying what is wrong (`Problem`);
`require` turns that sentence into a `PassPreconditionError` naming the pass. Checks never modify the model; the
ones several passes share are here (`not_among`, `dynamic_shape`, `repeated_output`, ...).

Switches for the speed-only rewrites (`rewrite_enabled`): each can be turned off, so that its effect can be
measured and a suspected difference ruled out. `ORTTRAINER_DISABLE_REWRITES` is a comma-separated list of rewrite
names (`all` turns every one off): `cross_entropy_as_plain_ops` (graph/cross_entropy.py), `static_shapes`
(graph/static_shapes.py: the 'ort' builder's graph specialised per input-shape signature; the torch builder's
graphs for the first input-shape signatures traced for their shapes, gradient/torch_graphs.STATIC_SIGNATURES),
`aten_translation` (the torch builder's static graphs translated to ONNX directly, gradient/aten_onnx.py, instead
of by torch.onnx), `where_sum_to_concat` (graph/static_shapes.py: slice gradients placed by one-hot `Where`s and
added become one `Concat`),
`summed_uses_to_one` (graph/summed_uses.py: a weight gradient summed over the weight's uses, one matrix product
per use, becomes one product of the concatenated operands), `noop_reductions` (graph/static_shapes.py: on every
gradient graph, a reduction over axes of size 1 becomes its input), `blocked_convolutions` (graph/nchwc.py: on the
CPU, convolutions run in ONNX Runtime's blocked channel layout, applied when a session is created) and
`conv_weight_gradient_per_offset`
(gradient/torch_decompositions.py: the torch builder writes a convolution's weight gradient as one matrix product per
kernel position instead of one convolution) and `threshold_backward_as_product` (gradient/torch_decompositions.py: the
torch builder writes ReLU's backward as the gradient times its mask instead of a `Where`) and
`recurrences_as_one_op` (gradient/recurrent_layers.py: the torch builder traces each LSTM or GRU layer's recurrence as
one op, which its direct translation unrolls, instead of step by step) and `safe_softmax_as_product`
(gradient/torch_decompositions.py: the torch builder writes the attention's softmax that zeroes rows of -inf only as
a product instead of a `Where`) and `traced_eval_graphs` (build/torch_route.py: the torch route's eval graphs traced
per input-shape signature and translated directly instead of exported by torch.export and torch.onnx). None of
them changes what is computed beyond float32 rounding, but for `threshold_backward_as_product`'s non-finite
gradients at masked positions (NaN where the `Where` gives 0, its docstring); each is tested both ways.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import onnx

VERIFY_ENVIRONMENT_VARIABLE = "ORTTRAINER_VERIFY_PASSES"
_CHECKER_LIMIT = 2**31 - 1  # protobuf's limit: the checker serializes the model; a larger one needs a file


class PassPreconditionError(ValueError):
    """A pass was given a model (or arguments) it is not defined for; `problem` says what is wrong."""

    def __init__(self, pass_name: str, problem: str) -> None:
        super().__init__(f"graph pass {pass_name!r}: {problem}")
        self.pass_name = pass_name
        self.problem = problem


class PassVerificationError(RuntimeError):
    """A pass broke its contract: its result is not a valid, sorted model, or it modified an input it declared it
    would copy. A bug in the pass, not in the caller's model."""

    def __init__(self, pass_name: str, problem: str) -> None:
        super().__init__(f"graph pass {pass_name!r}: {problem}")
        self.pass_name = pass_name
        self.problem = problem


Problem = str | None


def require(pass_name: str, *problems: Problem) -> None:
    """Raise `PassPreconditionError` for the first problem that is not None."""
    problem = first_problem(*problems)
    if problem:
        raise PassPreconditionError(pass_name, problem)


def first_problem(*problems: Problem) -> Problem:
    return next((p for p in problems if p), None)


def graph_input_names(model: onnx.ModelProto) -> set[str]:
    return {i.name for i in model.graph.input}


def graph_output_names(model: onnx.ModelProto) -> set[str]:
    return {o.name for o in model.graph.output}


def unsorted_input(graph: onnx.GraphProto) -> Problem:
    """Topological order: every node input is empty, a graph input, an initializer, or an output of an earlier node."""
    available = {v.name for v in graph.input} | {i.name for i in graph.initializer} | {""}
    for node in graph.node:
        missing = [name for name in node.input if name not in available]
        if missing:
            return f"node {node.name or node.op_type!r} reads {missing[0]!r} before any node produces it"
        available.update(node.output)
    return None


def unproduced_input(graph: onnx.GraphProto) -> Problem:
    """Every node input is produced by some node (in any order), or is a graph input or initializer."""
    available = {v.name for v in graph.input} | {i.name for i in graph.initializer} | {""}
    available.update(name for node in graph.node for name in node.output)
    for node in graph.node:
        missing = [name for name in node.input if name not in available]
        if missing:
            return f"node {node.name or node.op_type!r} reads {missing[0]!r}, which nothing produces"
    return None


def repeated_output(graph: onnx.GraphProto) -> Problem:
    """Single assignment: no tensor is the output of two nodes, or of a node and a graph input or initializer."""
    produced = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        for name in node.output:
            if name and name in produced:
                return f"tensor {name!r} is assigned twice (node {node.name or node.op_type!r} writes it again)"
            produced.add(name)
    return None


def not_among(names: Iterable[str], present: set[str], what: str, where: str = "the graph") -> Problem:
    """Every name in `names` is in `present`; `what` says what the names are, `where` what `present` is."""
    missing = sorted({n for n in names if n not in present})
    return f"{what} {missing} are missing from {where}" if missing else None


def dynamic_shape(model: onnx.ModelProto, names: Iterable[str], what: str = "trainable tensor") -> Problem:
    """Every graph input in `names` has a shape whose dimensions are all numbers (other names are not checked)."""
    by_name = {i.name: i for i in model.graph.input}
    for name in names:
        tensor_type = by_name[name].type.tensor_type if name in by_name else None
        if tensor_type is None:
            continue
        if not tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in tensor_type.shape.dim):
            return f"{what} {name!r} has a dynamic shape; parameters must have static shapes"
    return None


def default_opset(model: onnx.ModelProto) -> int:
    """The default-domain (`ai.onnx`) opset version the model imports; 0 when it imports none."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def opset_below(model: onnx.ModelProto, version: int, why: str) -> Problem:
    found = default_opset(model)
    if found >= version:
        return None
    return f"needs default-domain opset >= {version} ({why}); the model imports {found or 'none'}"


def repeated_initializer(graph: onnx.GraphProto) -> Problem:
    seen: set[str] = set()
    for init in graph.initializer:
        if init.name in seen:
            return f"initializer {init.name!r} is listed twice"
        seen.add(init.name)
    return None


REWRITES_ENVIRONMENT_VARIABLE = "ORTTRAINER_DISABLE_REWRITES"
REWRITES = (
    "cross_entropy_as_plain_ops",
    "static_shapes",
    "aten_translation",
    "where_sum_to_concat",
    "summed_uses_to_one",
    "noop_reductions",
    "blocked_convolutions",
    "conv_weight_gradient_per_offset",
    "threshold_backward_as_product",
    "recurrences_as_one_op",
    "safe_softmax_as_product",
    "traced_eval_graphs",
)


def rewrite_enabled(name: str) -> bool:
    """Whether the rewrite `name` (one of REWRITES) is on; ValueError for a name the variable does not know."""
    if name not in REWRITES:
        raise ValueError(f"unknown rewrite {name!r}; expected one of {list(REWRITES)}")
    disabled = {part.strip() for part in os.environ.get(REWRITES_ENVIRONMENT_VARIABLE, "").split(",") if part.strip()}
    unknown = disabled - {*REWRITES, "all"}
    if unknown:
        raise ValueError(
            f"{REWRITES_ENVIRONMENT_VARIABLE} names unknown rewrites {sorted(unknown)}; known: {list(REWRITES)}"
        )
    return name not in disabled and "all" not in disabled


class GraphPass(Protocol):
    """What `run_passes` needs of a pass (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def mutates_input(self) -> bool: ...

    def check(self, model: onnx.ModelProto) -> None: ...

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto: ...


@dataclass(frozen=True)
class FunctionPass:
    """A pass made of a function `ModelProto -> ModelProto` (its docstring states the rule) and a precondition
    that returns `None` when the model is acceptable, else what is wrong with it.

    The graph modules' functions check their own precondition too, so that their direct callers get the same
    error; under `run_passes` such a check runs twice, one scan of the graph each."""

    name: str
    rule: Callable[[onnx.ModelProto], onnx.ModelProto]
    precondition: Callable[[onnx.ModelProto], Problem] | None = None
    mutates_input: bool = False

    @property
    def doc(self) -> str:
        """The rule, as the docstring of the function (of the wrapped function for a `functools.partial`)."""
        return inspect.getdoc(getattr(self.rule, "func", self.rule)) or ""

    def check(self, model: onnx.ModelProto) -> None:
        if self.precondition is not None:
            require(self.name, self.precondition(model))

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """The rule alone (`run_passes` and `__call__` check the precondition first)."""
        return self.rule(model)

    def __call__(self, model: onnx.ModelProto) -> onnx.ModelProto:
        self.check(model)
        return self.apply(model)


def first_result(function: Callable[..., tuple], **arguments: Any) -> Callable[[onnx.ModelProto], onnx.ModelProto]:
    """`model -> function(model, **arguments)[0]`, with `function`'s docstring: the rule of a pass whose function
    also returns names (the caller of the pass reads them back from the model)."""

    def rule(model: onnx.ModelProto) -> onnx.ModelProto:
        return function(model, **arguments)[0]

    return functools.update_wrapper(rule, function)


def verification_enabled() -> bool:
    return os.environ.get(VERIFY_ENVIRONMENT_VARIABLE, "") == "1"


def run_passes(
    model: onnx.ModelProto,
    passes: Sequence[GraphPass],
    *,
    save: Mapping[str, str] | None = None,
    verify: bool | None = None,
) -> onnx.ModelProto:
    """Apply `passes` in order; each one's precondition is checked first. `model` itself is never modified: before
    the first pass that mutates its input, the runner copies the model if it is still the caller's.

    `save` maps pass names to paths: the model after that pass is written there (the `debug.graph_save_paths`
    stages; the caller chooses which pass ends which stage). `verify` (default: `verification_enabled()`) checks
    every result and every copying pass as the module docstring says; a failure raises `PassVerificationError`.
    """
    verifying = verification_enabled() if verify is None else verify
    current = model
    for graph_pass in passes:
        if graph_pass.mutates_input and current is model:
            current = onnx.ModelProto()
            current.CopyFrom(model)
        current = _apply_one(graph_pass, current, verifying)
        record_stage(graph_pass.name, current, save=save, verify=False)
    return current


def _apply_one(graph_pass: GraphPass, model: onnx.ModelProto, verifying: bool) -> onnx.ModelProto:
    graph_pass.check(model)
    before = model.SerializeToString() if verifying and not graph_pass.mutates_input else None
    result = graph_pass.apply(model)
    if not isinstance(result, onnx.ModelProto):
        raise PassVerificationError(graph_pass.name, f"returned {type(result).__name__}, not an onnx.ModelProto")
    if before is not None and model.SerializeToString() != before:
        raise PassVerificationError(graph_pass.name, "is declared as copying its input, but it modified it")
    if verifying:
        verify_model(result, graph_pass.name)
    return result


def record_stage(
    name: str, model: onnx.ModelProto, *, save: Mapping[str, str] | None = None, verify: bool | None = None
) -> None:
    """The end of stage `name`, for models built by other means than a pass (the training graph): verify `model`
    (default: `verification_enabled()`) and write it to `save[name]` when that is given."""
    if verification_enabled() if verify is None else verify:
        verify_model(model, name)
    path = (save or {}).get(name)
    if path:
        onnx.save(model, path)


def verify_model(model: onnx.ModelProto, pass_name: str) -> None:
    """Raise `PassVerificationError` unless the nodes are in topological order and `onnx.checker` accepts the
    model (skipped above 2 GiB, where the checker needs the model in a file)."""
    problem = unsorted_input(model.graph)
    if problem:
        raise PassVerificationError(pass_name, f"its result is not in topological order: {problem}")
    if model.ByteSize() > _CHECKER_LIMIT:
        return
    try:
        onnx.checker.check_model(_declarations_completed(model))
    except onnx.checker.ValidationError as err:
        raise PassVerificationError(pass_name, f"onnx.checker rejects its result: {err}") from err


def _declarations_completed(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy the checker can judge: graph inputs and outputs declared without element type or shape get
    placeholder ones (the checker requires both, ONNX Runtime neither), and default-domain nodes of an op ONNX does
    not define at the model's opset (ONNX Runtime registers `LayerNormalization` in the ONNX domain from opset 1,
    ONNX from 17, and some of its own ops there too: `_runtime_ops`) are checked as the custom-domain nodes they
    are to ONNX Runtime."""
    values = [*model.graph.input, *model.graph.output]
    early = _runtime_ops(model)
    if not early and all(v.type.tensor_type.elem_type and v.type.tensor_type.HasField("shape") for v in values):
        return model
    completed = onnx.ModelProto()
    completed.CopyFrom(model)
    for value in [*completed.graph.input, *completed.graph.output]:
        if not value.type.HasField("tensor_type") and value.type.WhichOneof("value") is not None:
            continue  # sequences, maps, optionals: declared otherwise, checked as they are
        tensor_type = value.type.tensor_type
        tensor_type.elem_type = tensor_type.elem_type or onnx.TensorProto.FLOAT
        if not tensor_type.HasField("shape"):
            tensor_type.shape.SetInParent()
    if early:
        for node in completed.graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in early:
                node.domain = _RUNTIME_DOMAIN
        if all(o.domain != _RUNTIME_DOMAIN for o in completed.opset_import):
            completed.opset_import.append(onnx.helper.make_opsetid(_RUNTIME_DOMAIN, 1))
    return completed


_RUNTIME_DOMAIN = "com.microsoft"


_RUNTIME_ONNX_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization", "SparseSoftmaxCrossEntropy"})


def _runtime_ops(model: onnx.ModelProto) -> set[str]:
    """Default-domain op types of `model` that ONNX does not define at the model's opset but ONNX Runtime runs: ops
    ONNX defines only from a later opset, and ONNX Runtime's own ops registered in the ONNX domain — its gradient
    ops (`MaxPoolGrad`, every name ending in `Grad`) and fusions (`_RUNTIME_ONNX_DOMAIN_OPS`, docs/engine.md
    §11.1). Any other unknown op stays an error of the checker."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    types = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}
    return {
        t
        for t in types
        if not onnx.defs.has(t, max_inclusive_version=opset)
        and (onnx.defs.has(t) or t.endswith("Grad") or t in _RUNTIME_ONNX_DOMAIN_OPS)
    }
