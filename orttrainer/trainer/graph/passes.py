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
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import onnx

from .conditions import Problem, require, unsorted_input
from .errors import PassPreconditionError, PassVerificationError

__all__ = [
    "VERIFY_ENVIRONMENT_VARIABLE",
    "first_result",
    "FunctionPass",
    "GraphPass",
    "PassPreconditionError",
    "PassVerificationError",
    "record_stage",
    "run_passes",
    "verification_enabled",
    "verify_model",
]

VERIFY_ENVIRONMENT_VARIABLE = "ORTTRAINER_VERIFY_PASSES"
_CHECKER_LIMIT = 2**31 - 1  # protobuf's limit: the checker serializes the model; a larger one needs a file


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
    placeholder ones (the checker requires both, ONNX Runtime neither), and default-domain nodes of an op that ONNX
    defines only from a later opset (ONNX Runtime registers `LayerNormalization` in the ONNX domain from opset 1,
    ONNX from 17; its fusions write it so) are checked as the custom-domain nodes they are to ONNX Runtime."""
    values = [*model.graph.input, *model.graph.output]
    early = _early_ops(model)
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


def _early_ops(model: onnx.ModelProto) -> set[str]:
    """Default-domain op types of `model` that ONNX defines, but only from a later opset than the model's."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    types = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}
    return {t for t in types if onnx.defs.has(t) and not onnx.defs.has(t, max_inclusive_version=opset)}
