"""Passes on the state of a model: which tensors are initializers (constants of the graph) and which are graph inputs
(fed per step), under which names and in which order.

* `strip_prefix`: initializer names lose the exporter's wrapper prefix.
* `set_initializers`: initializers take the module's own values.
* `move_initializers_to_inputs`: state initializers become graph inputs.
* `bind_foreign_state`: graph inputs that are not the trainer's state become initializers (or disappear).
* `order_inputs`: the graph inputs become exactly the data, then the state.

Each checks its precondition first (`PassPreconditionError`). All but `set_initializers` return a new model and leave
their argument untouched; `set_initializers` replaces initializers in place, because it runs on the freshly exported
model, whose weights would otherwise be copied once more.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ...dtypes import tensor_proto, torch_to_onnx
from .editor import copy_model, graph_value_names
from .passes import FunctionPass, Problem, first_problem, repeated_initializer, require

__all__ = [
    "bind_foreign_state",
    "bind_foreign_state_pass",
    "move_initializers_to_inputs",
    "move_initializers_to_inputs_pass",
    "order_inputs",
    "order_inputs_pass",
    "set_initializers",
    "set_initializers_pass",
    "strip_prefix",
    "strip_prefix_pass",
]


def strip_prefix(model: onnx.ModelProto, prefix: str) -> onnx.ModelProto:
    """Rule: initializers named `<prefix><name>` are renamed `<name>`, and so are their uses by nodes and their
    graph-input and value_info entries.

    Precondition: `prefix` is not empty, and no stripped name is already the name of another tensor."""
    require("strip_prefix", _strip_problem(model, prefix))
    result = copy_model(model)
    renamed = {i.name: i.name[len(prefix) :] for i in result.graph.initializer if i.name.startswith(prefix)}
    for init in result.graph.initializer:
        init.name = renamed.get(init.name, init.name)
    for node in result.graph.node:
        for k, name in enumerate(node.input):
            if name in renamed:
                node.input[k] = renamed[name]
    for value in list(result.graph.input) + list(result.graph.value_info):
        value.name = renamed.get(value.name, value.name)
    return result


def _strip_problem(model: onnx.ModelProto, prefix: str) -> Problem:
    if not prefix:
        return "the prefix is empty"
    prefixed = {i.name for i in model.graph.initializer if i.name.startswith(prefix)}
    others = graph_value_names(model.graph) - prefixed
    clashes = sorted(name[len(prefix) :] for name in prefixed if name[len(prefix) :] in others)
    return f"the stripped names {clashes} are already used by other tensors" if clashes else None


def set_initializers(model: onnx.ModelProto, values: Mapping[str, Any]) -> onnx.ModelProto:
    """Rule: each initializer named in `values` gets that value (same name); other names in `values` are ignored.
    `model` is modified and returned.

    Why: the exporter records buffers after its training-mode forward run, i.e. with BatchNorm statistics already
    moved by the sample batch; the trainer must start from the module's own values.

    Precondition: each value has its initializer's shape and element type (torch tensors or numpy arrays)."""
    arrays = {name: _as_array(value) for name, value in values.items()}
    require("set_initializers", _value_problem(model, arrays))
    for i, init in enumerate(model.graph.initializer):
        if init.name in arrays:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(arrays[init.name], init.name))
    return model


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _value_problem(model: onnx.ModelProto, arrays: Mapping[str, np.ndarray]) -> Problem:
    for init in model.graph.initializer:
        array = arrays.get(init.name)
        if array is None:
            continue
        if tuple(array.shape) != tuple(init.dims):
            return f"the value for {init.name!r} has shape {list(array.shape)}, the initializer {list(init.dims)}"
        if helper.np_dtype_to_tensor_dtype(array.dtype) != init.data_type:
            expected = onnx.TensorProto.DataType.Name(init.data_type)
            return f"the value for {init.name!r} is {array.dtype}, the initializer {expected}"
    return None


def move_initializers_to_inputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """Rule: each initializer in `names` becomes a graph input of the same name, type and shape (appended after
    the existing inputs, in initializer order); all other initializers stay constants. An initializer that is
    already listed as a graph input (IR < 4 models, `keep_initializers_as_inputs=True`) keeps that input. Names
    that are no initializer are ignored.

    Precondition: no initializer name is listed twice, and no name in `names` is a sparse initializer (which has
    no dense graph-input form here)."""
    wanted = set(names)
    require("move_initializers_to_inputs", _move_problem(model, wanted))
    result = copy_model(model)
    inputs = {i.name for i in result.graph.input}
    kept = []
    for init in result.graph.initializer:
        if init.name in wanted:
            if init.name not in inputs:
                result.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            kept.append(init)
    del result.graph.initializer[:]
    result.graph.initializer.extend(kept)
    return result


def _move_problem(model: onnx.ModelProto, wanted: set[str]) -> Problem:
    sparse = sorted(s.values.name for s in model.graph.sparse_initializer if s.values.name in wanted)
    return first_problem(
        repeated_initializer(model.graph),
        f"state tensors {sparse} are sparse initializers" if sparse else None,
    )


def bind_foreign_state(
    model: onnx.ModelProto, data_count: int, state: Sequence[str], values: Mapping[str, Any]
) -> onnx.ModelProto:
    """Rule: every graph input after the first `data_count` (the data) that is not in `state` becomes an initializer
    holding `values[name]` when a node reads it, and is removed when none does.

    Why: the torch builder's graph takes all module state; the trainer feeds only its own state, which leaves out
    tensors the exported forward does not use (BatchNorm's `num_batches_tracked`, unused parameters).

    Precondition: `data_count` is at most the number of graph inputs, and every such input a node reads has a
    value in `values`."""
    require("bind_foreign_state", _foreign_problem(model, data_count, state, values))
    result = copy_model(model)
    read = {name for node in result.graph.node for name in node.input}
    foreign = [i for i in list(result.graph.input)[data_count:] if i.name not in set(state)]
    for value in foreign:
        result.graph.input.remove(value)
        if value.name in read:
            given = values[value.name]
            result.graph.initializer.append(
                tensor_proto(given, value.name)
                if isinstance(given, torch.Tensor)
                else numpy_helper.from_array(np.asarray(given), value.name)
            )
    return result


def _foreign_problem(
    model: onnx.ModelProto, data_count: int, state: Sequence[str], values: Mapping[str, Any]
) -> Problem:
    if not 0 <= data_count <= len(model.graph.input):
        return f"data_count {data_count} is not between 0 and the {len(model.graph.input)} graph inputs"
    read = {name for node in model.graph.node for name in node.input}
    kept = set(state)
    foreign = [i.name for i in list(model.graph.input)[data_count:] if i.name not in kept]
    missing = [name for name in foreign if name in read and name not in values]
    return f"graph inputs {missing} are neither trainer state nor module state with a value" if missing else None


def order_inputs(model: onnx.ModelProto, data: list[str], state: Mapping[str, torch.Tensor]) -> onnx.ModelProto:
    """Rule: graph inputs become exactly `data` then `state`, in that order. A state tensor the exporter dropped
    (unused by the graph, e.g. a buffer only the dropped in-place update read) is added back as an unused input,
    typed and shaped as its tensor in `state`; a graph input that is in neither list and that no node reads is
    removed.

    Precondition: `data` and `state` share no name, every graph input a node reads is in one of them, and every
    data name is a graph input."""
    require("order_inputs", _order_problem(model, data, state))
    result = copy_model(model)
    by_name = {i.name: i for i in result.graph.input}
    ordered = []
    for name in [*data, *state]:
        if name not in by_name:
            tensor = state[name]
            by_name[name] = helper.make_tensor_value_info(name, torch_to_onnx(tensor.dtype), list(tensor.shape))
        ordered.append(by_name[name])
    del result.graph.input[:]
    result.graph.input.extend(ordered)
    return result


def _order_problem(model: onnx.ModelProto, data: list[str], state: Mapping[str, torch.Tensor]) -> Problem:
    inputs = [i.name for i in model.graph.input]
    read = {name for node in model.graph.node for name in node.input}
    both = sorted(set(data) & set(state))
    lost = sorted(name for name in inputs if name in read and name not in set(data) | set(state))
    absent = sorted(set(data) - set(inputs))
    return first_problem(
        f"names {both} are both data and state" if both else None,
        f"graph inputs {lost} are read by nodes but are neither data nor state" if lost else None,
        f"data inputs {absent} are not graph inputs" if absent else None,
    )


# ----------------------------------------------------------------------------------------- as passes for run_passes
def strip_prefix_pass(prefix: str) -> FunctionPass:
    return FunctionPass("strip_prefix", partial(strip_prefix, prefix=prefix), partial(_strip_problem, prefix=prefix))


def set_initializers_pass(values: Mapping[str, Any]) -> FunctionPass:
    arrays = {name: _as_array(value) for name, value in values.items()}
    return FunctionPass(
        "set_initializers",
        partial(set_initializers, values=arrays),
        partial(_value_problem, arrays=arrays),
        mutates_input=True,
    )


def move_initializers_to_inputs_pass(names: Iterable[str]) -> FunctionPass:
    wanted = set(names)
    return FunctionPass(
        "move_initializers_to_inputs",
        partial(move_initializers_to_inputs, names=wanted),
        partial(_move_problem, wanted=wanted),
    )


def bind_foreign_state_pass(data_count: int, state: Sequence[str], values: Mapping[str, Any]) -> FunctionPass:
    state = list(state)
    return FunctionPass(
        "bind_foreign_state",
        partial(bind_foreign_state, data_count=data_count, state=state, values=values),
        partial(_foreign_problem, data_count=data_count, state=state, values=values),
    )


def order_inputs_pass(data: list[str], state: Mapping[str, torch.Tensor]) -> FunctionPass:
    data = list(data)
    return FunctionPass(
        "order_inputs", partial(order_inputs, data=data, state=state), partial(_order_problem, data=data, state=state)
    )
