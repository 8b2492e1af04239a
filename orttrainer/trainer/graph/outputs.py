"""Output selection: which graph outputs a model keeps.

Both passes return a new model (the argument is untouched) and check their precondition first
(`PassPreconditionError`). They change only the output list: nodes stay, and a session that runs with
`only_execute_path_to_fetches` (or ONNX Runtime's graph optimizer) skips the work nothing reads any more.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import onnx

from .editor import copy_model
from .passes import FunctionPass, Problem, graph_output_names, not_among, require

__all__ = ["keep_outputs", "keep_outputs_pass", "without_outputs", "without_outputs_pass"]


def without_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """Rule: the graph outputs named in `names` are removed; the other outputs keep their order.

    Precondition: every name in `names` is a graph output."""
    dropped = set(names)
    require("without_outputs", _outputs_problem(model, dropped))
    return _select(model, lambda name: name not in dropped)


def keep_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """Rule: only the graph outputs named in `names` remain, in the graph's order (not the order of `names`).

    Precondition: every name in `names` is a graph output."""
    kept = set(names)
    require("keep_outputs", _outputs_problem(model, kept))
    return _select(model, lambda name: name in kept)


def _select(model: onnx.ModelProto, keep) -> onnx.ModelProto:
    result = copy_model(model)
    kept = [o for o in result.graph.output if keep(o.name)]
    del result.graph.output[:]
    result.graph.output.extend(kept)
    return result


def _outputs_problem(model: onnx.ModelProto, names: set[str]) -> Problem:
    return not_among(names, graph_output_names(model), "outputs", "the graph outputs")


def without_outputs_pass(names: Iterable[str]) -> FunctionPass:
    dropped = set(names)
    return FunctionPass(
        "without_outputs", partial(without_outputs, names=dropped), partial(_outputs_problem, names=dropped)
    )


def keep_outputs_pass(names: Iterable[str]) -> FunctionPass:
    kept = set(names)
    return FunctionPass("keep_outputs", partial(keep_outputs, names=kept), partial(_outputs_problem, names=kept))
