"""The training graph's state contract: what a compiled graph reads and writes, and every name in it, defined once.

Read it the way optax presents a `GradientTransformation`:

- *init*: `zero_state(graph.state_shapes)` plus the model's weights is the state a graph starts from — the optimizer
  moments and the gradient-accumulation buffers start at zero;
- *update*: one run of `graph.model` takes the data inputs, every state tensor, the learning rate and the update
  number, and returns the outputs plus the new value of each state tensor (`weight_updates`, `optimizer_state`,
  `accumulation`, `buffer_updates`: state input -> the output holding its new value). The session swaps them in
  (runtime/session.py): weights and moments after an optimizer step, accumulation buffers after a micro-step, and
  the buffers the forward updates itself (BatchNorm's running statistics) after every run, as PyTorch's forward
  does.

A `TrainingGraph` is the whole step in one process; with data parallelism a step is a `GradientStepGraph` (the
forward and backward pass of one rank) and an optimizer `TrainingGraph`, with the gradients combined across ranks in
between (`DataParallelGraphs`). With the update run by torch (update/path.py: `update="torch"`) a training graph is
gradient-only: `outside_update` says what the session applies to the state in place, and the graph outputs the
gradient sums (`gradients`).

Every graph that serves one state (the graphs for other input shapes, the specialised ones) has the same contract
(`check_same_state_contract`). The graph pass that builds the training tail writes the contract into the model's
metadata (`write_contract`); `training_graph(model)` reads it back, so a model carries its own contract.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

import numpy as np
import onnx

from ...schema.model_desc import LEARNING_RATE_IO_DESCRIPTION_NAME

LEARNING_RATE_INPUT = LEARNING_RATE_IO_DESCRIPTION_NAME  # the legacy model_desc's name of the learning-rate input
UPDATE_COUNT_INPUT = "__update_count"  # int64: the 1-based number of this optimizer update (bias corrections)
LOSS_SCALE_INPUT = "loss_scale"  # float32: the loss scale under mixed precision (the 'ort' builder's forward)
ALL_FINITE_OUTPUT = "all_gradients_finite"  # bool [1]: the gradients of this step are finite (mixed precision)

UPDATE_PATHS = ("graph", "fused", "torch")


def gradient_name(weight: str) -> str:
    """The gradient builders' output: the gradient of the loss with respect to `weight`."""
    return f"{weight}_grad"


def accumulation_buffer_name(weight: str) -> str:
    """The running sum of `weight`'s micro-batch gradients within an accumulation window."""
    return f"{weight}_grad_accumulation_buffer"


def reduced_gradient_name(weight: str) -> str:
    """Data parallelism: the optimizer graph's input holding `weight`'s gradient combined across ranks."""
    return f"{weight}_grad__reduced"


def buffer_update_name(buffer: str) -> str:
    """The output holding the new value of a buffer the forward updates (BatchNorm's running statistics)."""
    return f"{buffer}__updated"


def moment_names(weight: str) -> tuple[str, str]:
    """Legacy names of the optimizer moments of `weight` (as ONNX Runtime's TrainingSession named them)."""
    return f"Moment_1_{weight}", f"Moment_2_{weight}"


@dataclass(frozen=True)
class ParamGroup:
    """Trainable tensors that share one set of optimizer hyper-parameters."""

    hyper: dict
    params: list[str]


@dataclass(frozen=True)
class OutsideUpdate:
    """The update a gradient-only graph leaves to the session (`update="torch"`): the same semantics as the graph's
    (optimizer, groups, mean over `gradient_divisor` summed gradients, global-norm clipping, the finite check under
    mixed precision), applied to the tensors in `updated` (ZeRO: this rank's)."""

    optimizer_name: str
    groups: list[ParamGroup]
    gradient_divisor: int
    clip: bool
    check_finite: bool
    updated: list[str]


@dataclass(frozen=True)
class TrainingGraph:
    """A compiled training graph and the contract the session needs to run it (module docstring)."""

    model: onnx.ModelProto
    data_inputs: list[str]
    outputs: list[str]
    weight_updates: dict[str, str]  # trainable weight -> output with its updated value (outside_update: itself)
    optimizer_state: dict[str, str]  # optimizer state input (moments) -> output with its updated value (ditto)
    accumulation: dict[str, str]  # accumulation buffer input -> output with the new running sum
    state_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # moments and buffers (zero-initialised)
    lr_input: str = LEARNING_RATE_INPUT
    update_count_input: str = UPDATE_COUNT_INPUT
    loss_scale_input: str | None = None
    all_finite_output: str | None = None  # a graph output, except with outside_update (the session computes it)
    gradients: dict[str, str] = field(default_factory=dict)  # update="torch": trainable -> output holding `G`
    outside_update: OutsideUpdate | None = None  # update="torch": what the session applies after the run
    buffer_updates: dict[str, str] = field(default_factory=dict)  # frozen buffer -> its new value, every run


@dataclass(frozen=True)
class GradientStepGraph:
    """The forward and backward pass of one rank; `gradients` maps each trainable tensor to its output."""

    model: onnx.ModelProto
    data_inputs: list[str]
    outputs: list[str]
    gradients: dict[str, str]
    accumulation: dict[str, str] = field(default_factory=dict)  # buffer input -> running-sum output
    state_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    loss_scale_input: str | None = None
    buffer_updates: dict[str, str] = field(default_factory=dict)  # frozen buffer -> its new value, every run


def buffer_updates_of(model: onnx.ModelProto) -> dict[str, str]:
    """The buffer updates a gradient model computes: every graph input `b` with an output `buffer_update_name(b)`
    (the gradient builders name them so)."""
    outputs = {o.name for o in model.graph.output}
    return {i.name: buffer_update_name(i.name) for i in model.graph.input if buffer_update_name(i.name) in outputs}


@dataclass(frozen=True)
class DataParallelGraphs:
    """One rank's step: its gradient-step graph and the optimizer graph the combined gradients feed."""

    step: GradientStepGraph
    optimizer: TrainingGraph
    reduced_inputs: dict[str, str]  # trainable tensor -> optimizer graph input for its combined gradient


class RunnableGraph(Protocol):
    """What the session needs of any graph it runs: its model and its data inputs (model_desc order)."""

    @property
    def model(self) -> onnx.ModelProto: ...

    @property
    def data_inputs(self) -> list[str]: ...


StepGraph = TrainingGraph | GradientStepGraph  # the graph that runs a batch (data parallel: the gradient step)


def zero_state(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """*init*: the initial values of optimizer moments and accumulation buffers."""
    return {name: np.zeros(shape, dtype=np.float32) for name, shape in shapes.items()}


_SAME_STATE = (
    "data_inputs",
    "outputs",
    "lr_input",
    "update_count_input",
    "loss_scale_input",
    "all_finite_output",
    "state_shapes",
    "weight_updates",
    "optimizer_state",
    "accumulation",
    "gradients",
    "buffer_updates",
)


def check_same_state_contract(first: StepGraph, other: StepGraph) -> None:
    """Rule: graphs sharing one state (TrainingGraphs, or GradientStepGraphs) must name the same data inputs,
    outputs, step inputs, weights, optimizer moments, accumulation buffers and gradients, with the same shapes;
    raise RuntimeError naming the first difference."""
    for name in _SAME_STATE:
        mine, theirs = getattr(first, name, None), getattr(other, name, None)
        if isinstance(mine, dict) and isinstance(theirs, dict) and name != "state_shapes":
            mine, theirs = list(mine.items()), list(theirs.items())
        if mine != theirs:
            raise RuntimeError(
                f"the training graph for new input shapes differs from the first one in {name}: {theirs} != {mine}"
            )


CONTRACT_KEY = "orttrainer.contract"


def write_contract(model: onnx.ModelProto, graph: StepGraph) -> None:
    """Record `graph`'s contract (everything but the model) in `model`'s metadata, replacing an earlier one."""
    record = {f.name: getattr(graph, f.name) for f in fields(graph) if f.name != "model"}
    if isinstance(graph, TrainingGraph) and graph.outside_update is not None:
        record["outside_update"] = asdict(graph.outside_update)
    text = json.dumps({"kind": type(graph).__name__, **record}, sort_keys=True)
    kept = [p for p in model.metadata_props if p.key != CONTRACT_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=CONTRACT_KEY, value=text)


def read_contract(model: onnx.ModelProto) -> StepGraph:
    """The `TrainingGraph` or `GradientStepGraph` recorded in `model` by `write_contract`, with `model` itself;
    ValueError when it has none."""
    text = next((p.value for p in model.metadata_props if p.key == CONTRACT_KEY), None)
    if text is None:
        raise ValueError("the model carries no orttrainer training contract (it was not built by the training tail)")
    record: dict[str, Any] = json.loads(text)
    kind = record.pop("kind")
    record["state_shapes"] = {k: tuple(v) for k, v in record.get("state_shapes", {}).items()}
    if kind == "GradientStepGraph":
        return GradientStepGraph(model=model, **record)
    outside = record.pop("outside_update", None)
    if outside is not None:
        groups = [ParamGroup(g["hyper"], g["params"]) for g in outside.pop("groups")]
        record["outside_update"] = OutsideUpdate(groups=groups, **outside)
    return TrainingGraph(model=model, **record)
