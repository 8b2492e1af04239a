"""The compile cache (compile/cache.py) for a PyTorch model's trainer: which trainers it serves, the key of each
graph, and what an entry holds.

Graphs stored, each under the key of the batch it serves (`CachedBuild.key`: the trainer's shared key material and
the dataflow digest and shape signature of that batch):
- `first`: the first training graph (with its state contract), the eval graph ('ort' route; the torch route
  exports its eval graphs when first needed), the builder and why, and the trainable and frozen lists;
- `torch`: the torch builder's graph for another batch's shapes (`compile/compiler.TorchShapeGraphs`), also a
  dynamic-dims graph under each signature it served: a cached graph serves the signature it is stored under,
  never others (the shape guards that said which shapes it serves are not stored);
- `specialised`: the 'ort' builder's graph specialised to a signature (runtime/static_graphs.py), under the first
  graph's key and the signature (it is a function of those);
- `eval`: the torch route's eval graph traced for a batch's shapes (build/torch_route.TorchEvalGraphs), under the
  dataflow digest of the module's eval-mode forward on that batch and its signature (the training digest cannot
  see what the module computes only in eval mode).

A lookup runs the dataflow digest (one forward of the model in PyTorch, and its backward too when Python code can run
in it) for every new batch signature the cache is asked about; a hit then skips export, tracing and compilation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import torch

from ..activations import ActivationStatistics
from ..compile.cache import CompileCache, TrainerKey, Uncacheable, cache_directory, dataflow, trainer_key
from ..config import TrainerConfig
from ..gradient.torch_trace import tracing_context
from ..runtime.session import shape_signature
from .export import TRACING
from .torch_route import eval_mode

_logger = logging.getLogger(__name__)

FIRST, TORCH_GRAPH, SPECIALISED, EVAL = "first", "torch", "specialised", "eval"


def not_cacheable(config: TrainerConfig, activations: ActivationStatistics) -> str | None:
    """Why the cache does not serve this trainer (module docstring of compile/cache.py), or None."""
    options = config.options
    if options._internal_use.extra_postprocess:
        return "_internal_use.extra_postprocess is a user function"
    if options.debug.check_model_export:
        return "debug.check_model_export compares the export with PyTorch"
    if any(options.debug.graph_save_paths._validated_opts.values()):
        return "debug.graph_save_paths writes the compilation's stages"
    if activations.subscribed:
        return "orttrainer.debug statistics are subscribed"
    if config.distributed is not None:
        return "data parallelism"
    return None


@dataclass
class CachedBuild:
    """The cache as one trainer uses it: its shared key, and the first batch's digest and signature."""

    key: TrainerKey
    module: torch.nn.Module
    config: TrainerConfig
    batch: str
    signature: Any

    @property
    def cache(self) -> CompileCache:
        return self.key.cache

    @property
    def first_key(self) -> str:
        return self.key.for_batch(FIRST, self.batch, self.signature)

    def digest(self, inputs: Sequence[torch.Tensor]) -> str:
        names = [d.name for d in self.config.model_desc.inputs]
        return dataflow(self.module, self.config.loss_fn, names, inputs, tracing_context)

    def load_first(self) -> tuple[dict[str, Any], onnx.ModelProto, onnx.ModelProto | None] | None:
        """(meta, training graph, eval graph or None) of the first graph, or None."""
        entry = self.cache.load(self.first_key)
        if entry is None:
            _logger.info("compile cache miss (%s): the graphs are built", self.cache.path(self.first_key))
            return None
        training = onnx.load_from_string(entry.blobs["training"])
        evaluation = onnx.load_from_string(entry.blobs["eval"]) if "eval" in entry.blobs else None
        return entry.meta, training, evaluation

    def store_first(self, meta: dict[str, Any], training: onnx.ModelProto, evaluation: onnx.ModelProto | None) -> None:
        blobs = {"training": training.SerializeToString()}
        if evaluation is not None and evaluation.graph.node:
            blobs["eval"] = evaluation.SerializeToString()
        self.cache.store(self.first_key, meta, blobs)

    def graphs(self) -> _ShapeGraphs:
        """The torch builder's graphs for other shapes (a compile/compiler.GraphCache)."""
        return _ShapeGraphs(self, TORCH_GRAPH, "training", contextlib.nullcontext)

    def eval_graphs(self) -> _ShapeGraphs:
        """The torch route's traced eval graphs (a compile/compiler.GraphCache; build/torch_route.py)."""
        return _ShapeGraphs(self, EVAL, "eval", lambda: eval_mode(self.module))

    def specialisations(self) -> Callable[[Specialize], Specialize]:
        """Wraps the 'ort' builder's specialiser (runtime/session.py) with the cache."""
        return lambda specialize: _CachedSpecialize(self, specialize)


def lookup(
    config: TrainerConfig, module: torch.nn.Module, inputs: Sequence[torch.Tensor], activations: ActivationStatistics
) -> CachedBuild | None:
    """The cache for this trainer and first batch, or None (off, or not for this trainer: logged at INFO)."""
    directory = cache_directory()
    if directory is None:
        return None
    reason = not_cacheable(config, activations)
    if reason is None:
        try:
            key = trainer_key(CompileCache(directory), config, module)
            names = [d.name for d in config.model_desc.inputs]
            batch = dataflow(module, config.loss_fn, names, inputs, tracing_context)
            return CachedBuild(key, module, config, batch, shape_signature(inputs))
        except Uncacheable as err:
            reason = str(err)
        except Exception as err:  # the model does not run this way: no cache, the build reports real errors
            reason = f"the model's dataflow could not be recorded ({type(err).__name__}: {err})"
    _logger.info("compile cache not used: %s", reason)
    return None


class _ShapeGraphs:
    """Graphs of `kind` for a batch, stored as the blob `blob` under the dataflow digest of the model in `mode()`
    on that batch and the batch's signature."""

    def __init__(
        self, build: CachedBuild, kind: str, blob: str, mode: Callable[[], contextlib.AbstractContextManager]
    ) -> None:
        self._build, self._kind, self._blob, self._mode = build, kind, blob, mode

    def _key(self, inputs: Sequence[torch.Tensor]) -> str | None:
        """The key for `inputs`, or None when the model does not run on them in PyTorch: then the cache is not
        used for them, and tracing reports the error as it would without the cache."""
        try:  # the digest runs the model under the tracers' context, which patches torch: one thread at a time
            with TRACING, self._mode():
                batch = self._build.digest(inputs)
        except Exception as err:
            _logger.info(
                "compile cache not used for input shapes %s (%s: %s)", _shapes(inputs), type(err).__name__, err
            )
            return None
        return self._build.key.for_batch(self._kind, batch, shape_signature(inputs))

    def slot(self, inputs: Sequence[torch.Tensor]) -> _Slot:
        return _Slot(self, inputs)

    def load(self, key: str | None) -> onnx.ModelProto | None:
        entry = self._build.cache.load(key) if key is not None else None
        return onnx.load_from_string(entry.blobs[self._blob]) if entry is not None else None

    def store(self, key: str | None, model: onnx.ModelProto) -> None:
        if key is not None:
            self._build.cache.store(key, {}, {self._blob: model.SerializeToString()})


class _Slot:
    """A batch's place among `_ShapeGraphs` (compile/compiler.GraphSlot): its key is computed when first used
    (a dataflow digest runs the model), then kept."""

    def __init__(self, graphs: _ShapeGraphs, inputs: Sequence[torch.Tensor]) -> None:
        self._graphs, self._inputs = graphs, list(inputs)

    @functools.cached_property
    def key(self) -> str | None:
        key = self._graphs._key(self._inputs)
        self._inputs = []  # keeps no batch alive
        return key

    def load(self) -> onnx.ModelProto | None:
        return self._graphs.load(self.key)

    def store(self, model: onnx.ModelProto) -> None:
        self._graphs.store(self.key, model)


def _shapes(inputs: Sequence[torch.Tensor]) -> list[list[int]]:
    return [list(t.shape) for t in inputs]


Specialize = Callable[[Any, dict[str, torch.Tensor]], Any]


class _CachedSpecialize:
    """`specialize(graph, data)` (runtime/static_graphs.specialized) with its results kept in the cache under the
    first graph's key and the data's signature; a refusal (None) is not kept."""

    def __init__(self, build: CachedBuild, specialize: Specialize) -> None:
        self._build, self._specialize = build, specialize

    def __call__(self, graph: Any, data: dict[str, torch.Tensor]) -> Any:
        signature = shape_signature([data[n] for n in graph.data_inputs])
        key = self._build.key.for_batch(SPECIALISED, self._build.first_key, signature)
        entry = self._build.cache.load(key)
        if entry is not None:
            return dataclasses.replace(graph, model=onnx.load_from_string(entry.blobs["model"]))
        result = self._specialize(graph, data)
        if result is not None:
            self._build.cache.store(key, {}, {"model": result.model.SerializeToString()})
        return result
