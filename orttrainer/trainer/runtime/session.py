"""The session: runs the compiled training and eval graphs with ONNX Runtime, owning the training state.

State (weights, frozen tensors, optimizer moments, gradient-accumulation buffers) lives in `OrtValue`s on the
device between steps. A step feeds them as inputs and receives the updated values as new, owned `OrtValue`s that
replace them — outputs are never bound onto input buffers (docs/engine.md §3.2: that corrupts weights still read by
the backward pass). Data and outputs cross between torch and ONNX Runtime through DLPack, without host copies.
A gradient-only training graph (`graph.outside_update`, compile/contract.py) leaves the update to `TorchOptimizer`
(update/torch_fused.py), which changes the weights and moments in place through DLPack views of the same
`OrtValue`s after the run; those state values are then never replaced by a run, only by `set_state`.

Which graph runs a batch (`GraphRunners`). Every training graph of a session has the same state contract, so all of
them read and replace the same state values:
- the `ort` gradient builder: one graph with dynamic batch and sequence dims; on the CPU also graphs specialised to
  the first few input-shape signatures (runtime/static_graphs.py), the dynamic graph's session released while
  specialised ones run;
- the `torch` builder: the compiler's `graph_for` gives the graph for each input-shape signature on first sight,
  kept per signature (`ShapeKeyedCache`); a graph traced with dynamic dims serves every signature its guards
  accept, with one ONNX Runtime session. Why signatures: a graph traced with concrete shapes is valid only for the
  input shapes and dtypes it was traced with, and one traced with dynamic dims only for the shapes its guards
  accept (gradient/torch_builder.py).
The eval graph works the same way: one, or (torch route, `eval_for`) the graph `eval_for` gives for each signature,
created when first needed. Each session is created with its graph's Dropout nodes seeded at the position the
trainer's stream has reached for the graph's key (`seeded`): one key for a graph with dynamic shapes, one per
input-shape signature otherwise (`stream_key`); the stream and its positions are training state
(`state.DropoutStreams`, with the rule; docs/engine.md §9).
"""

from __future__ import annotations

import warnings
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import numpy as np
import onnx
import torch

from ...dtypes import ort_to_numpy
from ..compile.contract import RunnableGraph, TrainingGraph
from ..graph.dropout_seeds import STREAM_STRIDE, dropout_nodes, seed_dropouts_pass
from ..graph.outputs import outputs_reading, prune_to_outputs
from ..graph.passes import run_passes, verification_enabled
from ..state import DropoutStreams
from ..update.torch_fused import TorchOptimizer
from . import ort_private
from .ort import (
    TRAINING_UNSAFE_FUSIONS,
    Device,
    OptimizedGraphs,
    create_session,
    optimized_model,
    providers_for,
    session_options,
)
from .static_graphs import MAX_STATIC_SIGNATURES, specializable, specialized

if TYPE_CHECKING:
    from ..compile.compiler import CompiledModel

ShapeSignature = tuple[tuple[tuple[int, ...], str], ...]
T = TypeVar("T")
Specialize = Callable[[Any, dict[str, torch.Tensor]], Any]  # a graph and a batch -> the graph for its shapes


def shape_signature(inputs: Sequence[torch.Tensor]) -> ShapeSignature:
    """The key a traced graph is valid for: each input's shape and dtype, in order."""
    return tuple((tuple(int(d) for d in t.shape), str(t.dtype)) for t in inputs)


ALL_SHAPES = "all"  # the key of a graph that runs every input shape


def seeded(streams: DropoutStreams, model: onnx.ModelProto, key: str) -> onnx.ModelProto:
    """`model` with its Dropout nodes seeded for `key`'s current position (graphs of other keys start at a
    different offset of the stream, so two shape signatures do not repeat each other's masks)."""
    if not dropout_nodes(model):
        return model
    streams.active = True
    return run_passes(model, [seed_dropouts_pass(streams.base + _key_offset(key), streams.positions.get(key, 0))])


def signature_key(signature: ShapeSignature | None) -> str:
    """A readable key for a shape signature (an HDF5 name: no '/'); `ALL_SHAPES` for graphs with dynamic shapes."""
    if signature is None:
        return ALL_SHAPES
    return "|".join("x".join(str(d) for d in shape) + ":" + dtype.removeprefix("torch.") for shape, dtype in signature)


def stream_key(model: onnx.ModelProto, signature: ShapeSignature | None) -> str:
    """The stream key of a training graph run on inputs of `signature`: `ALL_SHAPES` when the graph has no data
    inputs to specialise on (`signature` None or empty) or any of its inputs has a dynamic dim (it serves many
    signatures, one stream), else the key of `signature`."""
    if not signature or any(_has_dynamic_dim(i) for i in model.graph.input):
        return ALL_SHAPES
    return signature_key(signature)


def _has_dynamic_dim(value: onnx.ValueInfoProto) -> bool:
    tensor = value.type.tensor_type
    return tensor.HasField("shape") and any(not d.HasField("dim_value") for d in tensor.shape.dim)


def _key_offset(key: str) -> int:
    return 0 if key == ALL_SHAPES else zlib.crc32(key.encode()) % STREAM_STRIDE


class ShapeKeyedCache(Generic[T]):
    """One value (a gradient graph, a compiled session) per input-shape signature, least recently used evicted.

    Rule: `get_or_build(inputs, build)` returns the value stored for `key(inputs)` (default: the shape signature;
    the torch builder's graphs add the way a forward's branches on values go, compile/compiler.TorchShapeGraphs),
    calling `build()` only on a miss; at most `max_entries` values are kept."""

    def __init__(
        self, max_entries: int = 16, key: Callable[[Sequence[torch.Tensor]], Hashable] = shape_signature
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._key = key
        self._values: OrderedDict[Hashable, T] = OrderedDict()

    def get_or_build(self, inputs: Sequence[torch.Tensor], build: Callable[[], T]) -> T:
        key = self._key(inputs)
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = build()
        self._values[key] = value
        if len(self._values) > self.max_entries:
            self._values.popitem(last=False)
        return value

    def replace_all(self, rebuild: Callable[[T], T]) -> None:
        """Replace every stored value `v` by `rebuild(v)`, keeping keys and their order."""
        for key, value in list(self._values.items()):
            self._values[key] = rebuild(value)

    def __contains__(self, inputs: Sequence[torch.Tensor]) -> bool:
        return self._key(inputs) in self._values

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> list[T]:
        """The stored values, least recently used first (several signatures may share one value)."""
        return list(self._values.values())


class GraphKeys:
    """The key under which a graph of the torch builder serves a batch (`ShapeKeyedCache(key=...)`): the batch's
    shape signature, and which of the graphs traced for a forward's branches on values accept it (`on_values`,
    which compile/compiler.TorchShapeGraphs and build/torch_route.TorchEvalGraphs fill). Why here: it runs on
    every step, and without such graphs it is the signature alone."""

    def __init__(self) -> None:
        self.on_values: list[Callable[[Sequence[torch.Tensor]], bool]] = []

    def __call__(self, inputs: Sequence[torch.Tensor]) -> Hashable:
        signature = shape_signature(inputs)
        if not self.on_values:
            return signature
        return signature, tuple(accepts(inputs) for accepts in self.on_values)


MAX_TRAINING_GRAPHS = 16  # torch builder: input-shape signatures kept compiled at once
MAX_PRUNED_EVAL_GRAPHS = 16  # eval graphs pruned for eval steps without some inputs, kept at once


G = TypeVar("G", bound=RunnableGraph)


@dataclass(frozen=True)
class GraphRunner(Generic[G]):
    """A graph, its onnxruntime.InferenceSession, and the inputs the session kept (ONNX Runtime prunes unused
    ones)."""

    graph: G
    session: Any
    inputs: frozenset[str]
    key: str  # the dropout stream key of the graph (`stream_key`)


@dataclass(frozen=True)
class EvalGraph:
    """An eval model and its data inputs (model_desc order), as `GraphRunners` runs it."""

    model: onnx.ModelProto
    data_inputs: list[str]


class EvalGraphs(Protocol):
    """The torch route's eval graphs: `self(inputs)` for the data (in `data_inputs` order); the same graph for
    inputs it also serves, and for inputs of the same `keys`. `serving(given)`: the graph for data that lacks some
    inputs (`SessionBase.evaluate`)."""

    data_inputs: list[str]

    keys: GraphKeys

    def __call__(self, inputs: Sequence[torch.Tensor]) -> EvalGraph: ...

    def serving(self, given: dict[str, torch.Tensor]) -> EvalGraph: ...


class GraphRunners(Generic[G]):
    """The graph (and ONNX Runtime session) that runs a batch: `graph` for every batch, or — given `graph_for`
    (torch builder) — `graph_for(inputs)` for the shape signature of `inputs` (the data in `graph.data_inputs`
    order), asked on the first batch with that signature (with `graph_key`: with that key, ShapeKeyedCache); a
    graph it returned before keeps its session.
    `optimized_model_path` receives the first graph's optimized model (every later one would overwrite it). Each
    session is created with its graph's Dropout nodes seeded at the position `streams` has reached for it
    (`seeded`)."""

    def __init__(
        self,
        create: Callable[[onnx.ModelProto, str], Any],
        graph: G,
        graph_for: Callable[[Sequence[torch.Tensor]], G] | None,
        optimized_model_path: str,
        streams: DropoutStreams,
        specialize: Callable[[G, dict[str, torch.Tensor]], G | None] | None = None,
        graph_key: Callable[[Sequence[torch.Tensor]], Hashable] | None = None,
    ) -> None:
        self.graph, self._create, self._graph_for = graph, create, graph_for
        self.streams = streams
        self._path = optimized_model_path
        self._cache: ShapeKeyedCache[GraphRunner[G]] = ShapeKeyedCache(
            MAX_TRAINING_GRAPHS, graph_key or shape_signature
        )
        self._specialize = specialize if graph_for is None else None
        self._static: dict[ShapeSignature, GraphRunner[G]] = {}
        self._pinned: dict[ShapeSignature, GraphRunner[G]] = {}  # graphs made for one signature (`pin`)
        self._dynamic: GraphRunner[G] | None = None
        self.latest: GraphRunner[G] | None = None
        if graph_for is None:
            self.for_data({})  # the (dynamic) graph: create its session now, so a broken graph fails here

    def for_data(self, data: dict[str, torch.Tensor]) -> GraphRunner[G]:
        if self._pinned and data:
            pinned = self._pinned.get(shape_signature([data[n] for n in self.graph.data_inputs]))
            if pinned is not None:
                self.latest = pinned
                return pinned
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
        return self._open(graph, stream_key(graph.model, shape_signature(inputs) if inputs else None))

    def _open(self, graph: G, key: str) -> GraphRunner[G]:
        path, self._path = self._path, ""
        session = self._create(seeded(self.streams, graph.model, key), path)
        return GraphRunner(graph, session, frozenset(i.name for i in session.get_inputs()), key)

    def pin(self, inputs: Sequence[torch.Tensor], graph: G) -> None:
        """Run `graph` for the input-shape signature of `inputs` (the data, in `graph.data_inputs` order) from now
        on: a graph made for those shapes alone (the TorchScript route's model exported again for them)."""
        signature = shape_signature(inputs)
        self._pinned[signature] = self._open(graph, stream_key(graph.model, signature))

    def pinned(self, inputs: Sequence[torch.Tensor]) -> bool:
        return shape_signature(inputs) in self._pinned

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
        self._pinned = {signature: self._open(r.graph, r.key) for signature, r in self._pinned.items()}
        if self._dynamic is not None:
            self._dynamic = self._open(self._dynamic.graph, self._dynamic.key)
        self.latest = None

    def __len__(self) -> int:
        return len(self._cache) + len(self._static) + len(self._pinned) + (self._dynamic is not None)

    @property
    def graph_count(self) -> int:
        """How many distinct graphs (and sessions) are kept."""
        shared = len({id(r.graph) for r in self._cache.values()})
        return shared + len(self._static) + len(self._pinned) + (self._dynamic is not None)


@dataclass(frozen=True)
class SessionConfig:
    """Everything from the options that shapes how ONNX Runtime runs the graphs."""

    device: Device
    mem_limit: int = 0
    provider_options: dict | None = None
    session_options: Any = None  # onnxruntime.SessionOptions given by the user
    deterministic: bool = False
    optimized_model_path: str = ""
    # False: training sessions without ONNX Runtime's buffer reuse (docs/engine.md §16); on the CPU no session has it
    memory_reuse: bool = True


class SessionBase(ABC):
    """What every session kind shares: ONNX Runtime options and providers, the eval graph's session, and the state
    (`OrtValue`s by name) that every graph reads and replaces. Subclasses run training steps."""

    _runners: GraphRunners[Any]  # the training (or gradient-step) graphs, set by the subclass

    def __init__(
        self,
        eval_model: onnx.ModelProto,
        state: dict[str, np.ndarray],
        config: SessionConfig,
        streams: DropoutStreams,
        eval_for: EvalGraphs | None = None,
        data_inputs: Sequence[str] = (),
    ) -> None:
        import onnxruntime as ort

        self.config = config
        self.streams = streams
        self._torch_device = config.device.torch_device
        self._options = session_options(config.session_options, config.deterministic, config.device, config.mem_limit)
        self._providers = providers_for(config.device, config.mem_limit, config.provider_options or {})
        self._optimized_graphs = OptimizedGraphs.for_sessions(config.session_options, config.device)
        # with eval_for, `first` only names the data inputs: the graphs are created when first needed
        first = EvalGraph(eval_model, list(eval_for.data_inputs if eval_for is not None else data_inputs))
        keys = eval_for.keys if eval_for is not None else None
        self._evals = GraphRunners(self._eval_session, first, eval_for, "", streams, graph_key=keys)
        self._eval_for = eval_for
        # eval_step without some inputs: (graph, given inputs, outputs) -> the pruned graph's runners
        self._pruned: OrderedDict[tuple, GraphRunners[EvalGraph]] = OrderedDict()
        self._state: dict[str, Any] = {name: self._to_device(value) for name, value in state.items()}
        self._views: dict[str, tuple[Any, torch.Tensor]] = {}
        self._partial_run = ort.RunOptions()
        self._partial_run.only_execute_path_to_fetches = True

    def _session(self, model: onnx.ModelProto, optimized_model_path: str, training: bool = True) -> Any:
        unsafe = TRAINING_UNSAFE_FUSIONS if training else ()
        reuse = self.config.memory_reuse or not training
        return create_session(
            model,
            self._options,
            self._providers,
            self.config.device,
            optimized_model_path,
            unsafe,
            reuse,
            self._optimized_graphs,
        )

    def _eval_session(self, model: onnx.ModelProto, optimized_model_path: str) -> Any:
        return self._session(model, optimized_model_path, training=False)

    def _specializer(self, graph: Any) -> Callable[[Any, dict[str, torch.Tensor]], Any | None] | None:
        """How `GraphRunners` specialises `graph` to input shapes, when it should (static_graphs.py)."""
        if not specializable(graph, self.config.device.type):
            return None
        specialize = partial(
            specialized, optimize=partial(optimized_model, options=self._options, providers=self._providers)
        )
        cache = getattr(self, "_cache_specialised", None)  # the compile cache (build/cached.py), when used
        return cache(specialize) if cache is not None else specialize

    def prepare(self, data: dict[str, torch.Tensor]) -> None:
        """Build (if needed) the training graph and session for this batch's shapes, without running anything."""
        self._runners.for_data(data)

    def reopen_graphs(self) -> None:
        """Create the training graphs' sessions again at the dropout streams' current positions (`seeded`)."""
        self._runners.reopen()

    def _run_training(self, runner: GraphRunner, feeds: dict[str, Any], fetch: list[str]) -> list:
        """Run a training graph and count its dropout draws; a failed run may have drawn without being counted,
        so its sessions start again where the count says."""
        try:
            fetched = self._run(runner.session, feeds, fetch)
        except BaseException:
            self.reopen_graphs()
            raise
        self.streams.advance(runner.key)
        return fetched

    @abstractmethod
    def train(
        self,
        data: dict[str, torch.Tensor],
        lr: float,
        update_count: int,
        outputs: list[str],
        optimizer_step: bool,
        loss_scale: float | None = None,
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """Run one micro-step (`optimizer_step=False`: accumulate gradients) or an optimizer step; returns the
        requested outputs and whether the step's gradients were all finite."""

    @property
    @abstractmethod
    def train_session(self) -> Any:
        """The onnxruntime.InferenceSession that ran the last update."""

    @property
    def training_graph_count(self) -> int:
        """How many training graphs are compiled and kept (torch builder: one per input-shape signature its first,
        dynamic-shape graph does not serve)."""
        return self._runners.graph_count

    def prepare_eval(self, data: dict[str, torch.Tensor]) -> None:
        """Build (if needed) the eval graph and session for this batch's shapes, without running anything."""
        self._evals.for_data(data)

    def evaluate(self, data: dict[str, torch.Tensor], outputs: list[str]) -> dict[str, torch.Tensor]:
        """Run the eval graph (for `data`'s shapes) on `data`; returns the requested outputs. Where `data` lacks
        some data inputs, the eval graph pruned to `outputs` runs (`graph/outputs.prune_to_outputs`); they must be
        among `computable(data, outputs)`."""
        if self._missing(data):
            runner = self._pruned_runner(data, outputs)
        else:
            runner = self._evals.for_data(data)
        feeds = self._feeds(data, runner.inputs)
        fetched = self._run(runner.session, feeds, outputs)
        return {name: self._to_torch(value) for name, value in zip(outputs, fetched, strict=True)}

    def pin_graphs(self, data: dict[str, torch.Tensor], step_graph: Any, eval_model: onnx.ModelProto) -> None:
        """Run `step_graph` (the training graph, or with data parallelism the gradient-step graph) and the eval
        graph `eval_model` for `data`'s input-shape signature from now on (`GraphRunners.pin`). The caller checked
        that `step_graph` has the state contract of the session's graphs."""
        self._runners.pin([data[n] for n in self._runners.graph.data_inputs], step_graph)
        if eval_model.graph.node:
            names = self._evals.graph.data_inputs
            self._evals.pin([data[n] for n in names], EvalGraph(eval_model, names))

    def pinned(self, data: dict[str, torch.Tensor]) -> bool:
        """Whether `data`'s input-shape signature has graphs of its own (`pin_graphs`)."""
        return self._runners.pinned([data[n] for n in self._runners.graph.data_inputs])

    def computable(self, data: dict[str, torch.Tensor], outputs: list[str]) -> list[str]:
        """Those of `outputs` the eval graph computes without the data inputs `data` lacks."""
        missing = self._missing(data)
        if not missing:
            return list(outputs)
        needing = outputs_reading(self._eval_graph_without(data).model, missing)
        return [name for name in outputs if name not in needing]

    def _missing(self, data: dict[str, torch.Tensor]) -> list[str]:
        return [name for name in self._evals.graph.data_inputs if name not in data]

    def _eval_graph_without(self, data: dict[str, torch.Tensor]) -> EvalGraph:
        """The eval graph that serves `data`, which lacks some data inputs: the one eval graph, or the torch
        route's (`EvalGraphs.serving`)."""
        return self._evals.graph if self._eval_for is None else self._eval_for.serving(data)

    def _pruned_runner(self, data: dict[str, torch.Tensor], outputs: list[str]) -> GraphRunner[EvalGraph]:
        """The eval graph pruned to `outputs` with `data`'s inputs, and its session: kept per graph, given inputs
        and outputs (the last MAX_PRUNED_EVAL_GRAPHS)."""
        graph = self._eval_graph_without(data)
        given = [name for name in graph.data_inputs if name in data]
        key = (id(graph), tuple(given), tuple(outputs))
        runners = self._pruned.get(key)
        if runners is None:
            pruned = EvalGraph(prune_to_outputs(graph.model, outputs), given)
            runners = GraphRunners(self._eval_session, pruned, None, "", self.streams)
            self._pruned[key] = runners
            if len(self._pruned) > MAX_PRUNED_EVAL_GRAPHS:
                self._pruned.popitem(last=False)
        self._pruned.move_to_end(key)
        return runners.for_data({})

    def state_names(self) -> list[str]:
        return list(self._state)

    def get_state(self, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the state tensors (never views: the caller must not alias the session's buffers)."""
        return {n: np.array(self._state[n].numpy(), copy=True) for n in (names or self._state)}

    def checked_state(self, values: dict[str, Any]) -> dict[str, np.ndarray]:
        """`values` as the arrays `set_state` writes: each must name a state tensor of this session, have its shape
        and convert to its element type; the error names the first that does not. Nothing changes."""
        arrays: dict[str, np.ndarray] = {}
        for name, value in values.items():
            if name not in self._state:
                raise KeyError(f"{name!r} is not a state tensor of this training session")
            current = self._state[name]
            dtype = ort_to_numpy(current.data_type())
            try:
                array = np.asarray(value)
                if tuple(array.shape) != tuple(current.shape()):
                    raise ValueError(f"shape {tuple(array.shape)} does not match {tuple(current.shape())}")
                arrays[name] = array.astype(dtype, copy=False)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"state {name!r}: {err} (a {type(value).__name__} given for {dtype.__name__})"
                ) from err
        return arrays

    def set_state(self, values: dict[str, Any]) -> None:
        """Replace state tensors (`checked_state` says what is accepted). All are checked, and copied to the
        device, before any is replaced, so a bad value leaves the state as it was."""
        on_device = {name: self._to_device(array) for name, array in self.checked_state(values).items()}
        self._state.update(on_device)

    def state_view(self, name: str) -> torch.Tensor:
        """A torch tensor sharing the memory of state `name` (kept while the state holds the same `OrtValue`)."""
        value = self._state[name]
        cached = self._views.get(name)
        if cached is None or cached[0] is not value:
            cached = (value, to_torch_view(value))
            self._views[name] = cached
        return cached[1]

    def _step_feeds(self, g: Any, inputs: frozenset[str] | set[str], lr: float, update_count: int) -> dict[str, Any]:
        """The learning rate and update number, for a graph that reads them (a gradient-only graph does not)."""
        feeds = {}
        if g.lr_input in inputs:
            feeds[g.lr_input] = self._host_scalar(np.float32(lr))
        if g.update_count_input in inputs:
            feeds[g.update_count_input] = self._host_scalar(np.int64(update_count))
        return feeds

    def _feeds(self, data: dict[str, torch.Tensor], wanted: set[str] | frozenset[str]) -> dict[str, Any]:
        feeds = {name: self._state[name] for name in wanted if name in self._state}
        for name, tensor in data.items():
            if name in wanted:  # inputs the graph does not use were pruned by ORT
                feeds[name] = from_torch(tensor)
        return feeds

    def _run(self, session: Any, feeds: dict[str, Any], fetch: list[str]) -> list:
        # Only what the fetched outputs need runs: accumulation steps skip the optimizer, eval skips unfetched
        # statistics (the legacy eval_step ran with only_execute_path_to_fetches too).
        return ort_private.run_with_ort_values(session, feeds, fetch, self._partial_run)

    def _to_device(self, array: np.ndarray):
        return ort_private.owned_ortvalue(array, self.config.device.type, self.config.device.index)

    def _host_scalar(self, value: np.generic):
        return ort_private.owned_ortvalue(np.array(value), "cpu", 0)

    def _to_torch(self, value) -> torch.Tensor:
        return to_torch_view(value).to(self._torch_device)


class TrainingSession(SessionBase):
    """ONNX Runtime sessions for the training graph(s) and the eval graph of one process, sharing the state.

    `compiled.training` is the (first) training graph and defines the state contract; `compiled.graph_for` see
    `GraphRunners`; `state` is the initial state (compile/compiler.py), which the session takes over."""

    def __init__(
        self,
        compiled: CompiledModel,
        state: dict[str, np.ndarray],
        config: SessionConfig,
        streams: DropoutStreams,
        eval_for: EvalGraphs | None = None,
        cache_specialised: Callable[[Specialize], Specialize] | None = None,
    ) -> None:
        super().__init__(compiled.eval_model, state, config, streams, eval_for, compiled.step_graph.data_inputs)
        self._cache_specialised = cache_specialised
        self.graph = graph = compiled.training
        graph_for = cast(Callable[[Sequence[torch.Tensor]], TrainingGraph] | None, compiled.graph_for)  # one process
        self._runners = GraphRunners(
            self._session,
            graph,
            graph_for,
            config.optimized_model_path,
            streams,
            self._specializer(graph),
            compiled.graph_key,
        )
        self._zeros = {name: self._to_device(np.zeros_like(state[name])) for name in graph.accumulation}
        update = graph.outside_update
        self._optimizer = TorchOptimizer(update, self.state_view) if update is not None else None

    @property
    def train_session(self) -> Any:
        """The onnxruntime.InferenceSession of the training graph run last (None before the first one exists)."""
        return self._runners.latest.session if self._runners.latest is not None else None

    def train(
        self,
        data: dict[str, torch.Tensor],
        lr: float,
        update_count: int,
        outputs: list[str],
        optimizer_step: bool,
        loss_scale: float | None = None,
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """Run one micro-step (`optimizer_step=False`: accumulate gradients) or an optimizer step.

        Returns the requested forward outputs as torch tensors on the trainer's device, and whether the step's
        gradients were all finite (mixed precision; always True otherwise). A non-finite optimizer step keeps the
        previous weights and moments: the updated values are simply not adopted. The buffers the forward updates
        (`buffer_updates`) take their new values after every run, finite or not, as PyTorch's forward updates them.
        """
        runner = self._runners.for_data(data)
        g = runner.graph
        feeds = self._feeds(data, runner.inputs)
        feeds.update(self._step_feeds(g, runner.inputs, lr, update_count))
        if g.loss_scale_input:
            feeds[g.loss_scale_input] = self._host_scalar(np.float32(loss_scale))
        if optimizer_step and self._optimizer is not None:
            return self._train_outside(runner, feeds, outputs, (lr, update_count, loss_scale))
        state_outputs = {**g.weight_updates, **g.optimizer_state} if optimizer_step else g.accumulation
        checks = [g.all_finite_output] if optimizer_step and g.all_finite_output else []
        updated = list(state_outputs.values()) + list(g.buffer_updates.values())
        fetched = self._run_training(runner, feeds, outputs + updated + checks)
        results = dict(zip(outputs, fetched[: len(outputs)], strict=True))
        finite = bool(fetched[-1].numpy().all()) if checks else True
        new_state = dict(zip([*state_outputs, *g.buffer_updates], fetched[len(outputs) :], strict=False))
        if not finite:
            new_state = {name: new_state[name] for name in g.buffer_updates}
        self._state.update(new_state)
        if optimizer_step:
            self._state.update(self._zeros)  # accumulation restarts from zero after every update (or skipped one)
        return {name: self._to_torch(value) for name, value in results.items()}, finite

    def _train_outside(
        self, runner: GraphRunner, feeds: dict[str, Any], outputs: list[str], step: tuple[float, int, float | None]
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """An optimizer step of a gradient-only graph: run it for the outputs and the gradient sums, then update the
        state in place (`TorchOptimizer`)."""
        assert self._optimizer is not None
        graph = runner.graph
        names = list(graph.gradients)
        fetch = outputs + [graph.gradients[p] for p in names] + list(graph.buffer_updates.values())
        fetched = self._run_training(runner, feeds, fetch)
        grads = {p: to_torch_view(v) for p, v in zip(names, fetched[len(outputs) :], strict=False)}
        finite = self._optimizer.step(grads, *step)
        self._state.update(zip(graph.buffer_updates, fetched[len(outputs) + len(names) :], strict=True))
        self._state.update(self._zeros)  # accumulation restarts from zero after every update (or skipped one)
        return {name: self._to_torch(value) for name, value in zip(outputs, fetched, strict=False)}, finite


def to_torch_view(value) -> torch.Tensor:
    """A torch tensor sharing the OrtValue's memory (DLPack), on the value's own device."""
    tensor = torch.utils.dlpack.from_dlpack(value.to_dlpack())
    if value.data_type() == "tensor(bool)":  # onnxruntime exports bool as uint8
        tensor = tensor.view(torch.bool)
    return tensor


def from_torch(tensor: torch.Tensor) -> Any:
    """An OrtValue sharing the tensor's memory (DLPack); it keeps the tensor alive."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return ort_private.ortvalue_from_torch(tensor)
