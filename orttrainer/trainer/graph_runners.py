"""`GraphRunners`: the training graph(s) of a session and their ONNX Runtime sessions (session.py's state is shared by
all of them).

One graph and its session; with the torch builder the graph `graph_for` gives for each input-shape signature (a
`ShapeKeyedCache`; a graph traced with dynamic dims serves every signature its guards accept, with one session); with
the `ort` builder on the CPU, the one dynamic graph plus graphs specialised to the first few signatures (`specialize`,
static_graphs.py), the dynamic graph's session released while specialised ones run. Each session is created with its
graph's Dropout nodes seeded at the position the trainer's stream has reached for the graph's key (rng.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import onnx
import torch

from .graph.passes import verification_enabled
from .rng import ALL_SHAPES, DropoutStreams, stream_key
from .shapes import ShapeKeyedCache, ShapeSignature, shape_signature
from .static_graphs import MAX_STATIC_SIGNATURES

MAX_TRAINING_GRAPHS = 16  # torch builder: input-shape signatures kept compiled at once


class RunnableGraph(Protocol):
    """What `GraphRunners` needs of a graph: its model and its data inputs (a TrainingGraph or GradientStepGraph)."""

    @property
    def model(self) -> onnx.ModelProto: ...

    @property
    def data_inputs(self) -> list[str]: ...


G = TypeVar("G", bound=RunnableGraph)


@dataclass(frozen=True)
class GraphRunner(Generic[G]):
    """A graph, its onnxruntime.InferenceSession, and the inputs the session kept (ONNX Runtime prunes unused
    ones)."""

    graph: G
    session: Any
    inputs: frozenset[str]
    key: str  # the dropout stream key of the graph (rng.py)


@dataclass(frozen=True)
class EvalGraph:
    """An eval model and its data inputs (model_desc order), as `GraphRunners` runs it."""

    model: onnx.ModelProto
    data_inputs: list[str]


class EvalGraphs(Protocol):
    """The torch route's eval graphs: `self(inputs)` for the data (in `data_inputs` order); the same graph for
    inputs it also serves."""

    data_inputs: list[str]

    def __call__(self, inputs: Sequence[torch.Tensor]) -> EvalGraph: ...


class GraphRunners(Generic[G]):
    """The graph (and ONNX Runtime session) that runs a batch: `graph` for every batch, or — given `graph_for`
    (torch builder) — `graph_for(inputs)` for the shape signature of `inputs` (the data in `graph.data_inputs`
    order), asked on the first batch with that signature; a graph it returned before keeps its session.
    `optimized_model_path` receives the first graph's optimized model (every later one would overwrite it). Each
    session is created with its graph's Dropout nodes seeded at the position `streams` has reached for it
    (rng.py)."""

    def __init__(
        self,
        create: Callable[[onnx.ModelProto, str], Any],
        graph: G,
        graph_for: Callable[[Sequence[torch.Tensor]], G] | None,
        optimized_model_path: str,
        streams: DropoutStreams,
        specialize: Callable[[G, dict[str, torch.Tensor]], G | None] | None = None,
    ) -> None:
        self.graph, self._create, self._graph_for = graph, create, graph_for
        self.streams = streams
        self._path = optimized_model_path
        self._cache: ShapeKeyedCache[GraphRunner[G]] = ShapeKeyedCache(MAX_TRAINING_GRAPHS)
        self._specialize = specialize if graph_for is None else None
        self._static: dict[ShapeSignature, GraphRunner[G]] = {}
        self._dynamic: GraphRunner[G] | None = None
        self.latest: GraphRunner[G] | None = None
        if graph_for is None:
            self.for_data({})  # the (dynamic) graph: create its session now, so a broken graph fails here

    def for_data(self, data: dict[str, torch.Tensor]) -> GraphRunner[G]:
        if self._graph_for is not None:
            inputs = [data[n] for n in self.graph.data_inputs]
            self.latest = self._cache.get_or_build(inputs, lambda: self._new(inputs))
        else:
            self.latest = self._static_for(data) or self._dynamic_runner()
        return self.latest

    def _dynamic_runner(self) -> GraphRunner[G]:
        if self._dynamic is None:
            self._dynamic = self._new([])
        return self._dynamic

    def _static_for(self, data: dict[str, torch.Tensor]) -> GraphRunner[G] | None:
        """The graph specialised to `data`'s shapes (static_graphs.py): built for the first MAX_STATIC_SIGNATURES
        signatures, None for later ones (and without `specialize`)."""
        if self._specialize is None or not data:
            return None
        signature = shape_signature([data[n] for n in self.graph.data_inputs])
        runner = self._static.get(signature)
        if runner is None and len(self._static) < MAX_STATIC_SIGNATURES:
            try:
                graph = self._specialize(self.graph, data)
                if graph is None:  # refused (static_graphs.specialized): the dynamic graph runs
                    self._specialize = None
                    return None
                runner = self._open(graph, ALL_SHAPES)
            except Exception as err:  # a speed-only rewrite must not stop training: the dynamic graph runs
                if verification_enabled():
                    raise
                warnings.warn(
                    f"specialising the training graph to its input shapes failed ({err}); the dynamic "
                    "graph runs instead",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self._specialize = None
                return None
            self._static[signature] = runner
            self._dynamic = None  # released (its session and arena) until a signature needs it again
        return runner

    def _new(self, inputs: list[torch.Tensor]) -> GraphRunner[G]:
        graph = self._graph_for(inputs) if self._graph_for is not None else self.graph
        known = next((r for r in self._cache.values() if r.graph is graph), None)
        if known is not None:  # a dynamic-shape graph serving another signature
            return known
        return self._open(graph, stream_key(graph.model, inputs))

    def _open(self, graph: G, key: str) -> GraphRunner[G]:
        path, self._path = self._path, ""
        session = self._create(self.streams.seeded(graph.model, key), path)
        return GraphRunner(graph, session, frozenset(i.name for i in session.get_inputs()), key)

    def reopen(self) -> None:
        """Create every kept graph's session again, seeded at the streams' current positions (after a load, or a
        failed run whose draws the positions did not count)."""
        reopened: dict[int, GraphRunner[G]] = {}  # signatures sharing a graph keep sharing one session

        def again(runner: GraphRunner[G]) -> GraphRunner[G]:
            if id(runner.graph) not in reopened:
                reopened[id(runner.graph)] = self._open(runner.graph, runner.key)
            return reopened[id(runner.graph)]

        self._cache.replace_all(again)
        self._static = {signature: self._open(r.graph, r.key) for signature, r in self._static.items()}
        if self._dynamic is not None:
            self._dynamic = self._open(self._dynamic.graph, self._dynamic.key)
        self.latest = None

    def __len__(self) -> int:
        return len(self._cache) + len(self._static) + (self._dynamic is not None)

    @property
    def graph_count(self) -> int:
        """How many distinct graphs (and sessions) are kept."""
        shared = len({id(r.graph) for r in self._cache.values()})
        return shared + len(self._static) + (self._dynamic is not None)
