"""The torch route's state and forward model, without the TorchScript exporter.

Rules:
- State, from the module itself (`module_state`): the trainable tensors are its `requires_grad` parameters (tied
  parameters once, under their first name) minus `utils.frozen_weights`; the frozen state is the listed frozen
  weights and the other state_dict entries its eval-mode dry run reads (`export.dry_run`); the other state_dict
  entries are aliases (a tied tensor's other names) or unused state. A trainable parameter that gets no gradient
  is frozen with a warning when the training graph is traced (`gradient/differentiate.py`): never silently.
- The eval graphs (`TorchEvalGraphs`): the module (+ loss) in eval mode, made when the first `eval_step` needs them
  (training never waits for them): traced for each input-shape signature and translated directly, as the training
  graphs are, for the first few signatures; else the forward model's.
- The forward model (`TorchEvalGraphs.forward_model`): the module (+ loss) in eval mode, traced with torch.export
  and written by torch.onnx (`dynamo=True`) when first needed — an `eval_step` past the traced signatures,
  `debug.check_model_export` or `save_as_onnx`. Data inputs are named as model_desc, outputs are the
  model_desc outputs (loss first), the trainer's state tensors are initializers named like the module's
  parameters and buffers (no `model.` prefix); other tensors (plain tensor attributes, the loss function's
  state, state the trainer does not hold) are constants. model_desc's string dims are dynamic where the trace
  allows it (torch.export's `Dim.AUTO`), within the ranges it found; for inputs outside them (a dim the model
  specialises) another eval graph is exported for their shapes.
- Mode: eval (dropout off, BatchNorm on running statistics), whatever mode the module trains in. The legacy
  `save_as_onnx` wrote the training-mode graph; see README § Gradient builders.
- Mixed precision (`ForwardSource.mixed_precision`): the module computes in float16 on the float32 state, as in
  training (build/export.py); the loss output is float32, the other float outputs the module's float16.
- `orttrainer.debug` (`ForwardSource.marking`, `TorchEvalGraphs(instrument=...)`): with a subscribed model the
  export marks the activations as the training trace does (trainer/activations.py); the eval graphs get their
  forward statistics, and `forward_model()` (what `save_as_onnx` writes) has the marks as Identity nodes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch

from ...debug.subscriber import no_increase_global_step
from ...dtypes import tensor_proto
from ..compile.compiler import GraphCache, GraphSlot
from ..gradient import torch_private
from ..gradient.eager_fallback import with_eager_translations
from ..gradient.torch_builder import MAX_ORT_OPSET, build_torch_forward_graph
from ..gradient.torch_graphs import STATIC_SIGNATURES, bind_foreign_state
from ..gradient.torch_private import DimSpec, ValueGuards
from ..gradient.torch_trace import attributes_restored, experts_in_static_shapes, flatten_tensors
from ..graph.class_labels import guard_pytorch_indices
from ..graph.passes import rewrite_enabled
from ..graph.pipeline import build_eval_model
from ..graph.statistics import marks_to_identity
from ..runtime.session import EvalGraph, GraphKeys, ShapeKeyedCache, ShapeSignature, shape_signature
from .export import MODEL_PREFIX, TRACING, DryRun, _ModelWithLoss, set_initializers, strip_prefix

_logger = logging.getLogger(__name__)


def module_state(module: torch.nn.Module, frozen_weights: list[str], dry: DryRun) -> tuple[list[str], list[str]]:
    """(trainable, frozen) state names by the rules above; RuntimeError naming a frozen weight the module lacks."""
    params = dict(module.named_parameters())  # tied parameters once, under their first name
    unknown = [name for name in frozen_weights if name not in params]
    if unknown:
        # the legacy text (docs/legacy_api.md §3.3), whichever builder: scripts match it
        raise RuntimeError(f"{unknown} params from 'frozen_weights' not found in the ONNX model.")
    listed = set(frozen_weights)
    trainable = [n for n, p in params.items() if p.requires_grad and n not in listed]
    canonical = {id(t): n for n, t in reversed([*module.named_parameters(), *module.named_buffers()])}
    state = module.state_dict(keep_vars=True)
    assert dry.read_state is not None, "the torch route's dry run records the state reads (build._torch_route)"
    read = [canonical[id(state[n])] for n in dry.read_state if id(state[n]) in canonical]
    frozen = list(dict.fromkeys([*frozen_weights, *(n for n in read if n not in trainable)]))
    return trainable, frozen


def named_dims(input_descs: Sequence) -> list[list[int]]:
    """For each model_desc input, the dims its shape names with a string (`['batch', 784]` -> `[0]`): the dims the
    torch path traces as dynamic."""
    return [[i for i, dim in enumerate(desc.shape) if isinstance(dim, str)] for desc in input_descs]


def same_size_groups(input_descs: Sequence) -> list[list[tuple[int, int]]]:
    """The (input, dim) pairs model_desc names with the same string, for each name used more than once (`batch` in
    `['batch', 'seq']` and `['batch']`): the torch path traces them as one size."""
    groups: dict[str, list[tuple[int, int]]] = {}
    for i, desc in enumerate(input_descs):
        for d, dim in enumerate(desc.shape):
            if isinstance(dim, str):
                groups.setdefault(dim, []).append((i, d))
    return [group for group in groups.values() if len(group) > 1]


def state_model(module: torch.nn.Module, names: list[str]) -> onnx.ModelProto:
    """A model holding only the named state tensors, as initializers: what the compiler reads the initial state
    from (the torch route has no forward graph before its first eval)."""
    state = {n: t.detach() for n, t in [*module.named_parameters(), *module.named_buffers()]}
    graph = onnx.helper.make_graph([], "state", [], [], [tensor_proto(state[n], n) for n in names])
    return onnx.helper.make_model(graph)


def module_values(module: torch.nn.Module, names: list[str]) -> dict[str, np.ndarray]:
    """The named state tensors of `module` as arrays sharing its memory (the session copies what it holds)."""
    state = {n: t for n, t in [*module.named_parameters(), *module.named_buffers()]}
    return {n: state[n].detach().cpu().numpy() for n in names}


@dataclass(frozen=True)
class ForwardSource:
    """What the eval-mode forward is traced from: `_ModelWithLoss(module, loss_fn, input_names)`, its first
    len(output_names) flattened outputs, the dims of each input that may stay dynamic, the ONNX opset."""

    module: torch.nn.Module
    loss_fn: Callable | None
    input_names: list[str]
    output_names: list[str]
    dynamic_dims: list[list[int]]
    opset_version: int
    mixed_precision: bool = False
    marking: Callable[[], contextlib.AbstractContextManager] | None = None  # orttrainer.debug marks (module doc)


class _EvalForward(_ModelWithLoss):
    """`_ModelWithLoss` returning its first `count` output tensors, flattened."""

    def __init__(self, source: ForwardSource) -> None:
        super().__init__(source.module, source.loss_fn, source.input_names, float16=source.mixed_precision)
        self.count = len(source.output_names)

    def forward(self, *inputs):
        with attributes_restored(self.model):  # each of the exporter's runs starts from the module as it is
            loss, *outputs = flatten_tensors(super().forward(*inputs))[: self.count]
        return (loss.float() if self.float16 else loss, *outputs)  # the loss is float32 under mixed precision


def export_forward(
    source: ForwardSource, inputs: Sequence[torch.Tensor], dynamic: bool = True, own_mode: bool = False
) -> tuple[onnx.ModelProto, list[list[DimSpec]]]:
    """The eval-mode forward model (`own_mode`: in the mode the module is in) for `inputs` (their shapes only,
    unless `dynamic`), with the module's current state values in its initializers, and its data inputs' dims (a
    size, or a dynamic dim's range). Raises RuntimeError naming the model when torch.export cannot trace it."""
    module = source.module
    opset = _opset(source)
    dims = source.dynamic_dims if dynamic else [[] for _ in inputs]
    mode = contextlib.nullcontext() if own_mode else eval_mode(module)
    marking = source.marking() if source.marking is not None else contextlib.nullcontext()
    try:  # orttrainer.debug hooks pass values through while tracing: no step counted, no file written
        with (
            mode,
            no_increase_global_step(),
            torch_private.causal_mask_detection_off(),
            experts_in_static_shapes(module),
            marking,
        ):
            model, specs = with_eager_translations(  # ops without an ONNX translation run in PyTorch (see there)
                lambda translations: torch_private.export_module_to_onnx(
                    _EvalForward(source),
                    [t.detach() for t in inputs],
                    source.input_names,
                    source.output_names,
                    opset,
                    dims,
                    translations,
                )
            )
    except Exception as err:
        what = (
            "forward (the graph _internal_use.extra_postprocess edits)"
            if own_mode
            else "eval-mode forward (the torch path's eval graph, also used by save_as_onnx and "
            "debug.check_model_export)"
        )
        raise RuntimeError(
            f"torch.export could not trace the {what} of {type(module).__name__}: {type(err).__name__}: {err}"
        ) from err
    model = first_names(strip_prefix(model, MODEL_PREFIX), module)
    state = {n: t.detach() for n, t in [*module.named_parameters(), *module.named_buffers()]}
    return set_initializers(model, state), specs


def _opset(source: ForwardSource) -> int:
    """The opset the forward is written in: the requested one within what torch.onnx writes and ONNX Runtime runs."""
    return min(max(source.opset_version, torch_private.MIN_DYNAMO_OPSET), MAX_ORT_OPSET)


def _tracing_switched_on() -> bool:
    """The rewrite switches of traced eval graphs (graph/passes.py): theirs, and the direct translation's."""
    return rewrite_enabled("traced_eval_graphs") and rewrite_enabled("aten_translation")


def first_names(model: onnx.ModelProto, module: torch.nn.Module) -> onnx.ModelProto:
    """Rule: an initializer named after another name of a tied tensor (torch.export names it as the forward reads
    it, `decoder.bias`) takes the tensor's first name (`bias`), under which the trainer holds it; two of them
    become one. `model` is modified and returned."""
    first: dict[int, str] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        first.setdefault(id(tensor), name)
    every = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    renamed = {name: first[id(tensor)] for name, tensor in every if first[id(tensor)] != name}
    if not any(init.name in renamed for init in model.graph.initializer):
        return model
    kept: dict[str, onnx.TensorProto] = {}
    for init in model.graph.initializer:
        name = renamed.get(init.name, init.name)
        if name not in kept:
            kept[name] = onnx.TensorProto()
            kept[name].CopyFrom(init)
            kept[name].name = name
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept.values())
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            node.input[k] = renamed.get(name, name)
    return model


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def accepts(dims: Sequence[Sequence[DimSpec]], dtypes: Sequence[torch.dtype], inputs: Sequence[torch.Tensor]) -> bool:
    """Rule: `inputs` fit a graph whose data inputs have `dims` (a size, or a dynamic dim's range) and `dtypes`."""
    if len(inputs) != len(dims):
        return False
    for shape, dtype, tensor in zip(dims, dtypes, inputs, strict=True):
        if tensor.dtype != dtype or len(shape) != tensor.dim():
            return False
        for spec, actual in zip(shape, tensor.shape, strict=True):
            low, high = (spec, spec) if isinstance(spec, int) else spec
            if actual < low or (high is not None and actual > high):
                return False
    return True


class TorchEvalGraphs:
    """The torch route's forward model and eval graphs (`runtime.session.EvalGraphs`), made when first needed.

    `self(inputs)` is the eval graph for `inputs`:
    - Traced: each of the first STATIC_SIGNATURES input-shape signatures gets a graph traced for its shapes by
      AOTAutograd and translated directly (gradient/torch_builder.build_torch_forward_graph), as the training
      graphs are. Not post-processed, as the training graphs are not (the legacy post-processing options act on
      exports). Off with `traced=False` (`_internal_use.extra_postprocess`, which edits the exported forward; an
      `orttrainer.debug` subscriber, whose statistics instrument exports) or the rewrite switches
      `traced_eval_graphs` and `aten_translation` (graph/passes.py). A trace that fails (an op the direct
      translation lacks) is logged at INFO, and every later graph is exported.
    - Exported, for inputs of any other signature: the first one exported (dynamic) serves every input it accepts,
      else one is exported for their shapes (logged at INFO, kept).
    Traced graphs are kept in the compile cache (`cache`, build/cached.py) for the next process. A forward that
    branches on tensor values (gradient/torch_trace.py) gets a traced graph for each way its branches go, for each
    signature, kept in this process only; `keys` (runtime/session.GraphKeys) tells the session which graph serves a
    batch.
    Why both: on the benchmark transformer a trace takes 0.45 s and an export 2.5 s (docs/engine.md §29), but the
    exported graph's dynamic dims serve the shapes to come (STATIC_SIGNATURES: gradient/torch_graphs.py).

    `forward_model()` is the post-processed forward model (`save_as_onnx`): the first exported one, exported for
    the first batch's shapes unless one exists. Traces and exports hold `TRACING` (build/export.py): one thread at
    a time."""

    def __init__(
        self,
        source: ForwardSource,
        sample: ShapeSignature,
        postprocess: Callable[[onnx.ModelProto], onnx.ModelProto],
        state: list[str],
        instrument: Callable[[onnx.ModelProto, str], onnx.ModelProto] | None = None,
        traced: bool = True,
        cache: GraphCache | None = None,
    ) -> None:
        self.data_inputs = list(source.input_names)
        self._source, self._sample, self._postprocess, self._state = source, sample, postprocess, list(state)
        self._instrument = instrument  # orttrainer.debug: the eval graphs' statistics (module docstring)
        self._dtypes = [_torch_dtype(dtype) for _, dtype in sample]
        self._forward: onnx.ModelProto | None = None
        self._tracing = traced and instrument is None
        self._traced: dict[ShapeSignature, EvalGraph] = {}
        # traced for the way a forward's branches on values went: the signature, the graph, its value guards
        self._on_values: list[tuple[ShapeSignature, EvalGraph, ValueGuards]] = []
        self.keys = GraphKeys()
        self._cache = cache  # the compile cache's traced eval graphs (build/cached.py)
        self._first: tuple[EvalGraph, list[list[DimSpec]]] | None = None  # the first exported graph
        self._others: ShapeKeyedCache[EvalGraph] = ShapeKeyedCache(16)

    def forward_model(self) -> onnx.ModelProto:
        if self._forward is None:
            self._export_first(self._sample_inputs())
        assert self._forward is not None  # set by the first export
        return self._forward

    def __call__(self, inputs: Sequence[torch.Tensor]) -> EvalGraph:
        signature = shape_signature(inputs)
        for traced_for, graph, guards in self._on_values:
            if traced_for == signature and guards.hold(inputs):
                return graph
        if signature in self._traced:
            return self._traced[signature]
        if self._first is not None and accepts(self._first[1], self._dtypes, inputs):
            return self._first[0]
        if self._tracing and len(self._traced) < STATIC_SIGNATURES and _tracing_switched_on():
            slot = self._cache.slot(inputs) if self._cache is not None and not self._on_values else None
            traced = self._load(slot, inputs) or self._trace(inputs, slot)
            if traced is not None:
                if all(graph is not traced for _, graph, _ in self._on_values):  # else it serves its values only
                    self._traced[signature] = traced
                return traced
        if self._first is None:
            return self._export_first(inputs)
        return self._others.get_or_build(inputs, lambda: self._build(inputs))

    def serving(self, given: dict[str, torch.Tensor]) -> EvalGraph:
        """The eval graph for data that lacks some inputs (an eval step with the inputs alone): the first exported
        one, exported for the first batch's shapes if none exists yet, when it accepts the given inputs; else
        ValueError (another graph would be exported with every input)."""
        if self._first is None:
            self._export_first(self._sample_inputs())
        assert self._first is not None  # set by the first export
        first, dims = self._first
        positions = [k for k, name in enumerate(self.data_inputs) if name in given]
        tensors = [given[self.data_inputs[k]] for k in positions]
        if not accepts([dims[k] for k in positions], [self._dtypes[k] for k in positions], tensors):
            missing = [name for name in self.data_inputs if name not in given]
            raise ValueError(
                f"eval_step without {missing}: the eval graph does not serve the shapes "
                f"{[list(t.shape) for t in tensors]} of the given inputs, and exporting one for them needs every "
                f"input; pass {missing} too"
            )
        return first

    def _load(self, slot: GraphSlot | None, inputs: Sequence[torch.Tensor]) -> EvalGraph | None:
        """The traced eval graph for `inputs` from the compile cache (their `slot`), or None."""
        stored = slot.load() if slot is not None else None
        if stored is None:
            return None
        _logger.info("input shapes %s: the eval graph comes from the compile cache", [list(t.shape) for t in inputs])
        return EvalGraph(stored, self.data_inputs)

    def _trace(self, inputs: Sequence[torch.Tensor], slot: GraphSlot | None) -> EvalGraph | None:
        """The traced eval graph for `inputs`' shapes (kept in the compile cache: their `slot`), or None when the
        trace or its translation fails (tracing then stops: the class docstring). A graph traced for branches on
        values joins `_on_values`, and stays out of the cache."""
        source = self._source
        try:
            with TRACING, eval_mode(source.module), no_increase_global_step():
                model, guards = build_torch_forward_graph(
                    _EvalForward(source),
                    source.module,
                    source.input_names,
                    inputs,
                    source.output_names,
                    _opset(source),
                    source.mixed_precision,
                )
        except Exception as err:
            if torch_private.raised_by_model(err):  # the model refuses this batch (its own raise), as it would eagerly
                raise
            self._tracing = False
            reason = str(err).strip().split("\n")[0]
            _logger.info(
                "the eval graph for the input shapes %s is exported, as every later one: its trace failed (%s: %s)",
                [list(t.shape) for t in inputs],
                type(err).__name__,
                reason,
            )
            return None
        values = {n: t.detach() for n, t in [*source.module.named_parameters(), *source.module.named_buffers()]}
        graph = self._eval_graph(bind_foreign_state(model, len(inputs), self._state, values))
        if guards is not None:
            signature = shape_signature(inputs)
            self._on_values.append((signature, graph, guards))
            self.keys.on_values.append(lambda batch: shape_signature(batch) == signature and guards.hold(batch))
        elif slot is not None:
            slot.store(graph.model)
        return graph

    def _export_first(self, inputs: Sequence[torch.Tensor]) -> EvalGraph:
        with TRACING:
            model, dims = export_forward(self._source, inputs)
        marked = self._postprocess(model)
        self._forward = marks_to_identity(marked)[0]
        self._first = (self._eval_graph(marked), dims)
        return self._first[0]

    def _build(self, inputs: Sequence[torch.Tensor]) -> EvalGraph:
        _logger.info(
            "exporting an eval graph for the input shapes %s (the first one's trace specialised a dim of model_desc)",
            [list(t.shape) for t in inputs],
        )
        with TRACING:
            model, _ = export_forward(self._source, inputs, dynamic=False)
        return self._eval_graph(self._postprocess(model))

    def _eval_graph(self, forward: onnx.ModelProto) -> EvalGraph:
        model = guard_pytorch_indices(build_eval_model(forward, self._state, self._source.output_names))
        if self._instrument is not None:
            model = self._instrument(model, "eval")
        return EvalGraph(model, self.data_inputs)  # indices range-checked as PyTorch does: graph/class_labels.py

    def _sample_inputs(self) -> list[torch.Tensor]:
        """Tensors of the first batch's shapes and dtypes: the exporter traces shapes, never values."""
        return [torch.zeros(shape, dtype=dtype) for (shape, _), dtype in zip(self._sample, self._dtypes, strict=True)]


def _torch_dtype(name: str) -> torch.dtype:
    """`str(dtype)` ('torch.float32', as in a ShapeSignature) back to the dtype."""
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype), name
    return dtype
