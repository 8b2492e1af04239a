"""TrainingSession: runs the compiled training and eval graphs with ONNX Runtime, owning the training state.

Training graphs (graph_runners.py): one with the `ort` gradient builder (dynamic batch and sequence dims; on the
CPU also specialised to the first few input-shape signatures); with the `torch` builder, the compiler's `graph_for`
gives the graph for each input-shape signature on first sight (a graph traced with dynamic dims serves every
signature its guards accept, with one ONNX Runtime session). Every training graph has the same state contract, so
all of them read and replace the same state values. The eval graph works the same way: one, or (torch route,
`eval_for`) the graph `eval_for` gives for each signature, created when first needed.

State (weights, frozen tensors, optimizer moments, gradient-accumulation buffers) lives in `OrtValue`s on the
device between steps. A step feeds them as inputs and receives the updated values as new, owned `OrtValue`s that
replace them — outputs are never bound onto input buffers (docs/engine.md §3.2: that corrupts weights still read by the
backward pass). Data and outputs cross between torch and ONNX Runtime through DLPack, without host copies.

A gradient-only training graph (`graph.outside_update`, graph/training.py) leaves the update to `TorchOptimizer`
(torch_optimizer.py), which changes the weights and moments in place through DLPack views of the same `OrtValue`s
after the run; those state values are then never replaced by a run, only by `set_state`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import onnx
import torch

from ..dtypes import ort_to_numpy
from . import ort_private
from .config import Device
from .graph.training import TrainingGraph
from .graph_runners import EvalGraph, EvalGraphs, GraphRunner, GraphRunners
from .ort_session import TRAINING_UNSAFE_FUSIONS, create_session, optimized_model, providers_for, session_options
from .rng import DropoutStreams
from .static_graphs import specializable, specialized
from .torch_optimizer import TorchOptimizer


@dataclass(frozen=True)
class SessionConfig:
    """Everything from the options that shapes how ONNX Runtime runs the graphs."""

    device: Device
    mem_limit: int = 0
    provider_options: dict | None = None
    session_options: Any = None  # onnxruntime.SessionOptions given by the user
    deterministic: bool = False
    optimized_model_path: str = ""


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
    ) -> None:
        import onnxruntime as ort

        self.config = config
        self.streams = streams
        self._options = session_options(config.session_options, config.deterministic, config.device, config.mem_limit)
        self._providers = providers_for(config.device, config.mem_limit, config.provider_options or {})
        # with eval_for, `first` only names the data inputs: the graphs are created when first needed
        first = EvalGraph(eval_model, eval_for.data_inputs if eval_for is not None else [])
        self._evals = GraphRunners(self._eval_session, first, eval_for, "", streams)
        self._state: dict[str, Any] = {name: self._to_device(value) for name, value in state.items()}
        self._views: dict[str, tuple[Any, torch.Tensor]] = {}
        self._partial_run = ort.RunOptions()
        self._partial_run.only_execute_path_to_fetches = True

    def _session(self, model: onnx.ModelProto, optimized_model_path: str, training: bool = True) -> Any:
        unsafe = TRAINING_UNSAFE_FUSIONS if training else ()
        return create_session(model, self._options, self._providers, self.config.device, optimized_model_path, unsafe)

    def _eval_session(self, model: onnx.ModelProto, optimized_model_path: str) -> Any:
        return self._session(model, optimized_model_path, training=False)

    def _specializer(self, graph: Any) -> Callable[[Any, dict[str, torch.Tensor]], Any | None] | None:
        """How `GraphRunners` specialises `graph` to input shapes, when it should (static_graphs.py)."""
        if not specializable(graph, self.config.device.type):
            return None
        return partial(specialized, optimize=partial(optimized_model, options=self._options, providers=self._providers))

    def prepare(self, data: dict[str, torch.Tensor]) -> None:
        """Build (if needed) the training graph and session for this batch's shapes, without running anything."""
        self._runners.for_data(data)

    def reopen_graphs(self) -> None:
        """Create the training graphs' sessions again at the dropout streams' current positions (rng.py)."""
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

    def evaluate(self, data: dict[str, torch.Tensor], outputs: list[str]) -> dict[str, torch.Tensor]:
        """Run the eval graph (for `data`'s shapes) on `data`; returns the requested outputs."""
        runner = self._evals.for_data(data)
        feeds = self._feeds(data, runner.inputs)
        fetched = self._run(runner.session, feeds, outputs)
        return {name: self._to_torch(value) for name, value in zip(outputs, fetched, strict=True)}

    # ------------------------------------------------------------------------------------------------------ state
    def state_names(self) -> list[str]:
        return list(self._state)

    def get_state(self, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the state tensors (never views: the caller must not alias the session's buffers)."""
        return {n: np.array(self._state[n].numpy(), copy=True) for n in (names or self._state)}

    def set_state(self, values: dict[str, np.ndarray]) -> None:
        """Replace state tensors; each value must match the current shape. All are checked before any is replaced,
        so a bad value leaves the state as it was."""
        arrays: dict[str, np.ndarray] = {}
        for name, value in values.items():
            if name not in self._state:
                raise KeyError(f"{name!r} is not a state tensor of this training session")
            current, array = self._state[name], np.asarray(value)
            if tuple(array.shape) != tuple(current.shape()):
                raise ValueError(f"state {name!r}: shape {tuple(array.shape)} does not match {tuple(current.shape())}")
            arrays[name] = array.astype(ort_to_numpy(current.data_type()), copy=False)
        self._state.update({name: self._to_device(array) for name, array in arrays.items()})

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

    # --------------------------------------------------------------------------------------------------- plumbing
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
        return to_torch_view(value).to(self.config.device.torch_device)


class TrainingSession(SessionBase):
    """ONNX Runtime sessions for the training graph(s) and the eval graph, sharing the state.

    `graph` is the (first) training graph and defines the state contract; `graph_for` see `GraphRunners`."""

    def __init__(
        self,
        graph: TrainingGraph,
        eval_model: onnx.ModelProto,
        state: dict[str, np.ndarray],
        config: SessionConfig,
        streams: DropoutStreams,
        graph_for: Callable[[Sequence[torch.Tensor]], TrainingGraph] | None = None,
        eval_for: EvalGraphs | None = None,
    ) -> None:
        super().__init__(eval_model, state, config, streams, eval_for)
        self.graph = graph
        self._runners = GraphRunners(
            self._session, graph, graph_for, config.optimized_model_path, streams, self._specializer(graph)
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
        previous weights and moments: the updated values are simply not adopted.
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
        fetched = self._run_training(runner, feeds, outputs + list(state_outputs.values()) + checks)
        results = dict(zip(outputs, fetched[: len(outputs)], strict=True))
        finite = bool(fetched[-1].numpy().all()) if checks else True
        if finite:
            new_state = fetched[len(outputs) : len(outputs) + len(state_outputs)]
            self._state.update(zip(state_outputs, new_state, strict=True))
        if optimizer_step:
            self._state.update(self._zeros)  # accumulation restarts from zero after every update (or skipped one)
        return {name: self._to_torch(value) for name, value in results.items()}, finite

    def _train_outside(
        self, runner: GraphRunner, feeds: dict[str, Any], outputs: list[str], step: tuple[float, int, float | None]
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """An optimizer step of a gradient-only graph: run it for the outputs and the gradient sums, then update the
        state in place (`TorchOptimizer`)."""
        assert self._optimizer is not None
        names = list(runner.graph.gradients)
        fetched = self._run_training(runner, feeds, outputs + [runner.graph.gradients[p] for p in names])
        grads = {p: to_torch_view(v) for p, v in zip(names, fetched[len(outputs) :], strict=True)}
        finite = self._optimizer.step(grads, *step)
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
