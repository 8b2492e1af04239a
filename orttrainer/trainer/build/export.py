"""Export a PyTorch model (plus loss function) to the forward ONNX model the training graph is compiled from.

Contract (docs/legacy_api.md §3.2): `_ModelWithLoss(model, loss_fn)` takes model_desc inputs positionally, passes them
to `model.forward` by parameter name (positionally to a `forward(*inputs)`), and — with a loss function — uses the
last input as the label and returns `(loss, *model_outputs)`. The export runs in `TrainingMode.TRAINING` (EVAL
exports merge equal-valued parameters, docs/engine.md §1.3), without constant folding, with dynamic axes named by
the string dims of model_desc.

Mixed precision on the torch route (`_ModelWithLoss(..., float16=True)`): the PyTorch module computes in float16 on
the float32 master state, by these rules (docs/engine.md §15):
- every float32 parameter and buffer is cast to float16 where the module reads it (`float16_state`, through
  `torch.func.functional_call`): the graph's state inputs stay the float32 master copy, and each parameter's
  gradient comes back through the cast's gradient as float32;
- but BatchNorm and InstanceNorm layers compute in float32, as AMP keeps them (`float32_norms`): their input is cast
  to float32 and their output back to float16, and their parameters and running statistics stay the float32 state,
  so the running statistics they update are the trainer's own;
- the float32 data inputs the module reads are cast to float16 (`float16_inputs`); a loss function's label is not;
- float16 module outputs are cast to float32 before the loss function (`float32_values`), so the loss and the
  start of its backward (where the loss scale enters) run in float32, as the 'ort' path keeps its loss subgraph
  float32 (graph/mixed_precision.py); the loss itself is float32, the other outputs keep the module's float16.
Inside the module PyTorch's own half-precision rules hold: its decompositions of softmax, log-softmax and layer norm
compute in float32 internally, as its eager kernels do.

What the export learns is written into model_desc as the original did (docs/legacy_api.md §3.4): the input and
output dtypes (`record_export_types`, for an ONNX model `record_graph_types`); `check_model_export` is
`debug.check_model_export`.

Exporting and tracing hold `TRACING`, a process-wide lock: torch's exporters and AOTAutograd keep process-global
state while they run (`GLOBALS.in_onnx_export`, the tracing mode), so two threads exporting at once fail
("GLOBALS.in_onnx_export must be True"). Training steps do not hold it, so trainers in different threads train
concurrently once built.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx
import torch

from ..._require import require
from ...debug.subscriber import no_increase_global_step
from ...dtypes import onnx_to_torch
from ...schema.model_desc import _ORTTrainerModelDesc
from ..gradient import torch_private
from ..graph.editor import copy_model, tensor_elem_type
from ..graph.fixups import restore_dropout_training_mode

MODEL_PREFIX = "model."
TRACING = threading.RLock()  # held while exporting or tracing a PyTorch module (module docstring)


class _ModelWithLoss(torch.nn.Module):
    """`forward(*inputs)`: model outputs, or `(loss_fn(preds, inputs[-1]), *preds)` when a loss function is set."""

    def __init__(self, model: torch.nn.Module, loss_fn, input_names: list[str], float16: bool = False) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.input_names = list(input_names)
        parameters = inspect.signature(model.forward).parameters
        self.forward_params = list(parameters)
        # a forward that takes only `*inputs` (gradient/onnx_module.OnnxModule) has no names to pass inputs by
        self.positional = [p.kind for p in parameters.values()] == [inspect.Parameter.VAR_POSITIONAL]
        self.float16 = float16  # mixed precision on the torch route: the model computes in float16 (module docstring)

    def forward(self, *inputs):
        label = inputs[-1] if self.loss_fn is not None else None
        if self.float16:
            inputs = tuple(float16_inputs(inputs, label=self.loss_fn is not None))
        if self.positional:  # forward(*inputs): all model_desc inputs but a loss_fn's label, in order
            args, kwargs = (inputs[:-1] if self.loss_fn is not None else inputs), {}
        else:
            args, kwargs = (), self.model_kwargs(inputs)
        if self.float16:
            with float32_norms(self.model):
                preds = torch.func.functional_call(self.model, float16_state(self.model), args, kwargs)
        else:
            preds = self.model(*args, **kwargs)
        if self.loss_fn is None:
            return preds
        loss = self.loss_fn(float32_values(preds) if self.float16 else preds, label)
        return (loss, *preds) if isinstance(preds, (tuple, list)) else (loss, preds)

    def model_kwargs(self, inputs) -> dict:
        """The keyword arguments `model.forward` gets for the model_desc inputs `inputs`."""
        return {name: inputs[self.input_names.index(name)] for name in self.forward_params if name in self.input_names}


@dataclass(frozen=True)
class EvalRun:
    """What the eval-mode run itself gave."""

    sample_outputs: list[torch.Tensor]  # flattened (loss, *outputs) with a loss_fn, else the model's outputs
    custom_functions: list[str]  # custom torch.autograd.Functions in the outputs' autograd graph
    # where the forward took a tensor's truth value (`if mask.any():`), asserts left out (torch_private.truth_reads)
    value_branches: list[str]
    # where the forward stopped or hooked a gradient that reaches a loss output (`.detach()`, `torch.no_grad()`,
    # `register_hook`): torch_private.gradient_edits
    gradient_edits: list[str]


@dataclass(frozen=True)
class DryRun:
    """What running the model once in PyTorch (an eval-mode copy, `dry_run`) learned. `evaluated` gives the run's
    own results; a build from the compile cache knows the rest from the entry and runs the model only when they
    are first read (`deferred_dry_run`)."""

    evaluated: Callable[[], EvalRun]
    input_dtypes: list[torch.dtype]
    output_dtypes: list[torch.dtype]  # of the model_desc outputs
    was_training: bool  # the model's train/eval mode when it was handed over (eval: dropout off in training)
    # state_dict entries the eval-mode forward reads (state_dict order; tied names too); None: not recorded
    read_state: list[str] | None

    @property
    def sample_outputs(self) -> list[torch.Tensor]:
        return self.evaluated().sample_outputs

    @property
    def custom_functions(self) -> list[str]:
        return self.evaluated().custom_functions

    @property
    def value_branches(self) -> list[str]:
        return self.evaluated().value_branches

    @property
    def gradient_edits(self) -> list[str]:
        return self.evaluated().gradient_edits


@dataclass
class ExportedModel:
    """The forward ONNX model and what the dry run learned about the model's inputs and outputs."""

    model: onnx.ModelProto
    sample_outputs: list[torch.Tensor]
    input_dtypes: list[torch.dtype]
    output_dtypes: list[torch.dtype]
    parameters: list[str]  # trainable (requires_grad) parameters, ONNX initializer names
    buffers: list[str]  # buffers and requires_grad=False parameters: frozen state
    was_training: bool  # the model's train/eval mode when it was handed over (eval: dropout off in training)
    custom_functions: list[str]  # custom torch.autograd.Functions met in the dry run
    aliases: dict[str, str]  # state_dict key -> initializer holding the same (tied) tensor
    unused_state: dict[str, torch.Tensor]  # state_dict entries the graph does not use (copies; they never change)
    mutated: list[str]  # buffers the forward updates in place: the TorchScript export drops their updates
    # branches on a tensor's value that the export fixed to the sample's way: "file:line (`source`)"
    fixed_branches: list[str] = field(default_factory=list)
    # the exporter wrote an `index_add` as a scatter that overwrites where indices repeat (it warned)
    overwrites_repeated_indices: bool = False


def check_forward_accepts(model: torch.nn.Module, input_names: list[str], has_loss_fn: bool) -> None:
    """Every model_desc input must be a parameter of `model.forward` (the label too when there is no loss_fn)."""
    signature = inspect.signature(model.forward)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return
    checked = input_names[:-1] if has_loss_fn else input_names
    unknown = [name for name in checked if name not in signature.parameters]
    if unknown:
        raise ValueError(
            f"model_desc inputs {unknown} are not parameters of {type(model).__name__}.forward{signature}; inputs are "
            "passed to forward by name" + (" (with a loss_fn, the last input is the label)" if has_loss_fn else "")
        )


def custom_autograd_functions(outputs) -> list[str]:
    """Names of the custom `torch.autograd.Function`s in the autograd graph behind `outputs`."""
    found: set[str] = set()
    seen: set[int] = set()
    stack = [t.grad_fn for t in flatten_outputs(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        forward_cls = getattr(node, "_forward_cls", None)  # only Python-defined Functions have one
        if forward_cls is not None:
            found.add(forward_cls.__qualname__)
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return sorted(found)


def dry_run(
    model: torch.nn.Module, loss_fn, model_desc, sample_inputs: list[torch.Tensor], record_reads: bool = True
) -> DryRun:
    """Check that `model.forward` takes the model_desc inputs, run an eval-mode copy of `model` (+ `loss_fn`) on
    `sample_inputs` and check that it returns at least the model_desc outputs. `record_reads`: also record the state
    the forward reads (the torch route's frozen state). Why optional: the recording mode makes PyTorch import
    torch._dynamo (~40 MB resident, measured on torch 2.13), which the TorchScript route never needs."""
    input_names = [d.name for d in model_desc.inputs]
    output_names = [d.name for d in model_desc.outputs]
    check_forward_accepts(model, input_names, loss_fn is not None)
    wrapper = _ModelWithLoss(model, loss_fn, input_names)
    sample_outputs, functions, read, branches, edits = _dry_run(wrapper, sample_inputs, record_reads)
    if len(sample_outputs) < len(output_names):
        raise ValueError(
            f"model_desc describes {len(output_names)} outputs {output_names}, but the model"
            f"{' with its loss_fn' if loss_fn else ''} returns {len(sample_outputs)}"
        )
    for output, value in zip(model_desc.outputs, sample_outputs, strict=False):
        if output.is_loss and isinstance(value, torch.Tensor) and value.dim() != 0:
            raise ValueError(
                f"the loss output {output.name!r} must be a scalar (shape []), but the model returns "
                f"shape {list(value.shape)}; reduce it (e.g. mean) in the model or loss_fn"
            )
    input_dtypes = [t.dtype for t in sample_inputs]
    output_dtypes = [t.dtype for t in sample_outputs[: len(output_names)]]
    read_state = [name for name in model.state_dict() if name in read] if read is not None else None
    evaluated = EvalRun(sample_outputs, functions, branches, _reaching_losses(model_desc, edits))
    return DryRun(lambda: evaluated, input_dtypes, output_dtypes, model.training, read_state)


def _reaching_losses(model_desc, edits: list[list[str]]) -> list[str]:
    """The gradient edits that reach a loss output (model_desc `is_loss`), each once."""
    losses = [places for output, places in zip(model_desc.outputs, edits, strict=False) if output.is_loss]
    return list(dict.fromkeys(place for places in losses for place in places))


def deferred_dry_run(
    model: torch.nn.Module, loss_fn, model_desc, sample_inputs: list[torch.Tensor], output_dtypes: list[torch.dtype]
) -> DryRun:
    """The dry run of a build from the compile cache: the output dtypes are the entry's (its key covers the model,
    its loss and the inputs, so the checks `dry_run` makes held when it was built); the eval-mode run happens when
    its outputs are first read (the legacy `torch_sample_outputs`, a lazy TorchScript export), on the first batch.
    Why deferred: it is a forward of the model, about a tenth of a cached first step (docs/engine.md §22)."""
    input_names = [d.name for d in model_desc.inputs]

    @functools.cache
    def evaluated() -> EvalRun:
        with TRACING, no_increase_global_step():
            outputs, functions, _, branches, edits = _dry_run(
                _ModelWithLoss(model, loss_fn, input_names), sample_inputs, False
            )
        return EvalRun(outputs, functions, branches, _reaching_losses(model_desc, edits))

    input_dtypes = [t.dtype for t in sample_inputs]
    return DryRun(evaluated, input_dtypes, list(output_dtypes), model.training, None)


def export_model(
    model: torch.nn.Module,
    loss_fn,
    model_desc,
    sample_inputs: list[torch.Tensor],
    *,
    opset_version: int,
    enable_contrib_ops: bool,
    dry: DryRun | None = None,
) -> ExportedModel:
    """Export `model` (+ `loss_fn`) with the TorchScript exporter; returns the forward ONNX model with the `model.`
    prefix removed. `dry`: the `dry_run` already made (else it runs here)."""
    input_names = [d.name for d in model_desc.inputs]
    output_names = [d.name for d in model_desc.outputs]
    dry = dry or dry_run(model, loss_fn, model_desc, sample_inputs)
    wrapper = _ModelWithLoss(model, loss_fn, input_names)
    _register_contrib_ops(enable_contrib_ops)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    names = (input_names, output_names, _dynamic_axes(model_desc))
    from ..gradient.torch_trace import attributes_restored  # it imports this module

    try:
        # the tracer's sizes are tensors: a forward that keeps one in a plain attribute (Funnel's `self.seq_len`)
        # would leave it there for the torch builder, should 'auto' fall back to it
        with attributes_restored(model):
            exported, mutated, traced_truths, overwrites = _torchscript_export(
                wrapper, sample_inputs, names, opset_version
            )
    except Exception as err:
        unsupported = torch_private.unsupported_at_opset(err)
        if unsupported is not None and unsupported[2] > opset_version:
            _restore_buffers(model, buffers)
            works = _first_opset_that_exports(wrapper, sample_inputs, names, unsupported[2])
            raise OpsetTooLowError(type(model).__name__, *unsupported, works) from err
        raise TorchScriptExportError(f"exporting {type(model).__name__} to ONNX failed: {err}") from err
    finally:
        model.train(dry.was_training)
        _restore_buffers(model, buffers)
    onnx_model = set_initializers(strip_prefix(onnx.load_from_string(exported), MODEL_PREFIX), buffers)
    if dry.was_training:
        onnx_model = restore_dropout_training_mode(onnx_model)
    # a value the tracer turned into a Python bool where the eager dry run took a tensor's truth value: the
    # tracer also warns for branches on sizes (traced as tensors there), and the eager run also sees branches the
    # exporter does not meet (library code taking another path while tracing)
    fixed = [place for place in dry.value_branches if place.split(" ", 1)[0] in traced_truths]
    found = exported_model(onnx_model, model, dry)
    return replace(found, mutated=mutated, fixed_branches=fixed, overwrites_repeated_indices=overwrites)


_DROPPED_MUTATION = re.compile(r"Removing mutation from node \S+ on block input: '([^']+)'")


def _passed_on(caught: list[warnings.WarningMessage], padding_kept: bool) -> list[str]:
    """The buffers whose in-place updates the TorchScript exporter said it dropped (without `model.`); every other
    warning is shown, but the exporter's deprecation notices: torch deprecates the TorchScript exporter and its
    `training` argument, both chosen on purpose (docs/design.md: dynamo=False, TrainingMode.TRAINING), when the
    model's `nn.Embedding`s have a padding index (`padding_kept`), its notice that ONNX updates the padding row
    (the 'ort' builder's graph does not: graph/embedding_padding.py), and its notice about an index_add's repeated
    indices, which `build/forward.torchscript_forward` turns into its own error or warning."""
    mutated = []
    for warning in caught:
        found = _DROPPED_MUTATION.search(str(warning.message))
        if found:
            mutated.append(found.group(1).removeprefix(MODEL_PREFIX))
        elif (padding_kept and _PADDING_UPDATED in str(warning.message)) or _REPEATED_INDICES in str(warning.message):
            continue  # the padding row: graph/embedding_padding.py; repeated indices: build/forward.py says it
        elif not issubclass(warning.category, DeprecationWarning):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return sorted(set(mutated))


def _torchscript_export(
    wrapper: torch.nn.Module, sample_inputs: list[torch.Tensor], names: tuple, opset_version: int
) -> tuple[bytes, list[str], set[str], bool]:
    """`torch.onnx.export` as the module docstring says; `names`: (input names, output names, dynamic axes).
    Returns the model's bytes, the buffers whose in-place updates the exporter dropped (`_passed_on`), the
    places ("file:line") where the tracer warned that it turned a traced value into a Python bool, and whether the
    exporter warned that an index_add it wrote overwrites where its indices repeat."""
    input_names, output_names, dynamic_axes = names
    buffer = io.BytesIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.onnx.export(
            wrapper,
            tuple(sample_inputs),
            buffer,  # type: ignore[arg-type]  # the TorchScript exporter writes to file objects too
            input_names=input_names,
            output_names=output_names,
            opset_version=opset_version,
            dynamic_axes=dynamic_axes,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            dynamo=False,
        )
    truths = {
        f"{w.filename}:{w.lineno}"
        for w in caught
        if issubclass(w.category, torch.jit.TracerWarning) and _TRUTH_VALUE in str(w.message)
    }
    padded = any(isinstance(m, torch.nn.Embedding) and m.padding_idx is not None for m in wrapper.modules())
    overwrites = any(_REPEATED_INDICES in str(w.message) for w in caught)
    return buffer.getvalue(), _passed_on(caught, padded), truths, overwrites


_PADDING_UPDATED = "ONNX export of embedding with padding_idx >= 0 for training mode"  # the exporter's notice
_REPEATED_INDICES = "does not support duplicated values in 'index' field"  # index_add written as an overwrite
_TRUTH_VALUE = "Converting a tensor to a Python boolean"  # the tracer's TracerWarning for bool() of a traced value


def _first_opset_that_exports(
    wrapper: torch.nn.Module, sample_inputs: list[torch.Tensor], names: tuple, start: int
) -> int | None:
    """The lowest opset from `start` within the option's range at which the export succeeds; None if none does
    (another op needs a later opset, or the export fails otherwise). Each try restores the module's buffers."""
    model = wrapper.model if isinstance(wrapper, _ModelWithLoss) else wrapper
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    opset: int | None = start
    while opset is not None and opset_option_allows(opset):
        try:
            _torchscript_export(wrapper, sample_inputs, names, opset)
            return opset
        except Exception as err:
            unsupported = torch_private.unsupported_at_opset(err)
            opset = unsupported[2] if unsupported is not None and unsupported[2] > opset else None
        finally:
            _restore_buffers(model, buffers)
    return None


class TorchScriptExportError(RuntimeError):
    """The TorchScript exporter failed on the model ('auto' then trains it with the torch builder)."""


class OpsetTooLowError(TorchScriptExportError):
    """The TorchScript exporter has `op` only from opset `needed` on, and the model was exported at `opset`.

    `works`: the lowest opset the option allows at which the model exports (None: none). 'auto' does not switch
    builders when there is one: the opset is the user's choice, and the error says which one works."""

    def __init__(self, model: str, op: str, opset: int, needed: int, works: int | None = None) -> None:
        self.op, self.opset, self.needed, self.works = op, opset, needed, works
        found = f"; the model exports at opset {works}" if works is not None and works != needed else ""
        remedy = (
            f"set options _internal_use.onnx_opset_version={works} (the capi API's _opset_version={works}), or "
            if works is not None
            else ""
        )
        none_works = (
            "" if works is not None else " (no opset that options _internal_use.onnx_opset_version allows exports it)"
        )
        super().__init__(
            f"exporting {model} to ONNX opset {opset} failed: the TorchScript exporter has no translation of "
            f"'{op}' at opset {opset}; it has one from opset {needed}{found}. To train it, {remedy}use the torch "
            "gradient builder (options _internal_use.gradient_builder='torch'), whose exporter writes opset 18 or "
            f"later{none_works}."
        )


def opset_option_allows(opset: int) -> bool:
    """Whether options `_internal_use.onnx_opset_version` accepts `opset` (its schema's range)."""
    from ...schema.options import _ORTTRAINER_OPTIONS_SCHEMA

    rule = _ORTTRAINER_OPTIONS_SCHEMA["_internal_use"]["schema"]["onnx_opset_version"]
    return int(rule.get("min", opset)) <= opset <= int(rule.get("max", opset))


def exported_model(onnx_model: onnx.ModelProto, model: torch.nn.Module, dry: DryRun) -> ExportedModel:
    """Rule: the trainable parameters are `model`'s requires_grad parameters that are initializers of
    `onnx_model`; the frozen state is its other state_dict entries that are initializers; state_dict entries
    that are not initializers are aliases (a tied tensor's other names) or unused state."""
    initializers = {i.name for i in onnx_model.graph.initializer}
    params = [n for n, p in model.named_parameters() if p.requires_grad and n in initializers]
    state = [n for n in model.state_dict() if n in initializers and n not in params]
    aliases, unused = state_outside_graph(model, initializers)
    return ExportedModel(
        onnx_model,
        dry.sample_outputs,
        dry.input_dtypes,
        dry.output_dtypes,
        params,
        state,
        dry.was_training,
        dry.custom_functions,
        aliases,
        unused,
        [],
    )


def _restore_buffers(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Undo the export's forward run: in training mode it updates BatchNorm's running statistics in place."""
    with torch.no_grad():
        for name, value in model.named_buffers():
            if name in saved:
                value.copy_(saved[name])


def set_initializers(model: onnx.ModelProto, values: dict[str, torch.Tensor]) -> onnx.ModelProto:
    """Rule: each initializer named in `values` gets that value (same name; `model` is modified and returned).

    Why: the exporter records buffers after its training-mode forward run, i.e. with BatchNorm statistics already
    moved by the sample batch; the trainer must start from the module's own values."""
    from onnx import numpy_helper

    for i, init in enumerate(model.graph.initializer):
        if init.name in values:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(values[init.name].cpu().numpy(), init.name))
    return model


def state_outside_graph(
    model: torch.nn.Module, initializers: set[str]
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """state_dict keys that are not graph initializers: tied names of an exported tensor, or tensors the graph does
    not use. Both are needed to give `torch.nn.Module.load_state_dict` a complete state_dict later."""
    state = model.state_dict(keep_vars=True)
    by_storage = {(t.data_ptr(), tuple(t.shape)): name for name, t in state.items() if name in initializers}
    aliases, unused = {}, {}
    for name, tensor in state.items():
        if name in initializers:
            continue
        canonical = by_storage.get((tensor.data_ptr(), tuple(tensor.shape)))
        if canonical is not None:
            aliases[name] = canonical
        else:
            unused[name] = tensor.detach().clone()
    return aliases, unused


def strip_prefix(model: onnx.ModelProto, prefix: str) -> onnx.ModelProto:
    """Rule: initializers named `<prefix><name>` are renamed `<name>`, and so are their uses by nodes."""
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


def _dry_run(
    wrapper: _ModelWithLoss, inputs: list[torch.Tensor], record_reads: bool
) -> tuple[list[torch.Tensor], list[str], set[str] | None, list[str], list[list[str]]]:
    """Run an eval-mode copy of the wrapper: its outputs give the output dtypes, its autograd graph shows the
    custom autograd Functions (which the TorchScript exporter would silently inline, dropping their backward),
    the state it reads is the torch route's frozen state (build/torch_route.module_state), and the places where
    it took a tensor's truth value are branches the TorchScript export would fix (`torch_private.truth_reads`), and
    for each output, the places where the forward stopped or hooked a gradient that reaches it, which the
    TorchScript export writes as plain ops (`torch_private.gradient_edits`)."""
    try:
        runner = copy.deepcopy(wrapper)
    except Exception:
        warnings.warn(
            "This model cannot be deep copied (or pickled), which is a required step for stateful models "
            "to be properly exported to ONNX. Compute will continue, but unexpected results may occur!",
            stacklevel=2,
        )
        runner = wrapper
    was_training = runner.training
    runner.eval()
    state = runner.model.state_dict(keep_vars=True)

    def run() -> tuple[object, set[str] | None]:
        if record_reads:
            return _run_recording_reads(runner, inputs, state)
        with torch.enable_grad():
            return runner(*[copy.deepcopy(t) for t in inputs]), None

    try:
        try:  # the autograd graph is walked, never run: it need not hold the activations
            with (  # truth_reads innermost: it reads the model's frame right above its own
                torch_private.saved_tensors_dropped(),
                torch_private.gradient_edits() as edits_reaching,
                torch_private.truth_reads() as branches,
            ):
                outputs, read = run()
        except Exception:  # e.g. the forward runs a backward of its own (SavedTensorDroppedError, maybe wrapped)
            with torch_private.gradient_edits() as edits_reaching, torch_private.truth_reads() as branches:
                outputs, read = run()
    finally:
        runner.train(was_training)
    functions = custom_autograd_functions(outputs)
    edits = [edits_reaching(t) for t in flatten_outputs(outputs)]
    flat = [t.detach() if isinstance(t, torch.Tensor) else t for t in flatten_outputs(outputs)]
    return flat, functions, read, branches, edits


def _run_recording_reads(runner: torch.nn.Module, inputs: list[torch.Tensor], state: dict) -> tuple[object, set[str]]:
    """The runner's outputs, and the state entries it read. A model the recording mode breaks (an op without
    Python dispatch support) runs again without it, and then every state entry counts as read."""
    try:
        with torch.enable_grad(), torch_private.storage_reads(state) as read:
            return runner(*[copy.deepcopy(t) for t in inputs]), read
    except torch_private.SavedTensorDroppedError:  # not the recording's fault: `_dry_run` runs it again
        raise
    except Exception:
        with torch.enable_grad():
            return runner(*[copy.deepcopy(t) for t in inputs]), set(state)


def flatten_outputs(outputs: object) -> list:
    """Nested tuples/lists of outputs as one flat list, in order."""
    if isinstance(outputs, (tuple, list)):
        return [leaf for item in outputs for leaf in flatten_outputs(item)]
    return [outputs]


def _dynamic_axes(model_desc) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for desc in list(model_desc.inputs) + list(model_desc.outputs):
        named = {i: dim for i, dim in enumerate(desc.shape) if isinstance(dim, str)}
        if named:
            axes[desc.name] = named
    return axes


def _register_contrib_ops(enabled: bool) -> None:
    """`_internal_use.enable_onnx_contrib_ops`: ORT's extra exporter symbolics (GridSample, Inverse, ...)."""
    from onnxruntime.tools import pytorch_export_contrib_ops

    if enabled:
        pytorch_export_contrib_ops.register()
    else:
        pytorch_export_contrib_ops.unregister()


def float16_inputs(inputs: Sequence[Any], label: bool) -> list[Any]:
    """`inputs` with each float32 tensor cast to float16, except the last one when it is a loss function's
    `label`."""
    cast = [_half(v) for v in inputs]
    if label and inputs:
        cast[-1] = inputs[-1]
    return cast


BATCH_NORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
    torch.nn.LazyBatchNorm1d,
    torch.nn.LazyBatchNorm2d,
    torch.nn.LazyBatchNorm3d,
)
RUNNING_STATISTICS_NORMS = (
    *BATCH_NORMS,
    torch.nn.InstanceNorm1d,
    torch.nn.InstanceNorm2d,
    torch.nn.InstanceNorm3d,
    torch.nn.LazyInstanceNorm1d,
    torch.nn.LazyInstanceNorm2d,
    torch.nn.LazyInstanceNorm3d,
)  # the norm layers with running statistics


def float16_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every name of `module`'s parameters and buffers (tied names too, one cast per tensor) -> a float16 cast of
    each float32 one, but those of the norm layers `float32_norms` keeps in float32; for
    `torch.func.functional_call`."""
    norms = [m for m in module.modules() if isinstance(m, RUNNING_STATISTICS_NORMS)]
    kept = {id(t) for m in norms for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    casts: dict[int, torch.Tensor] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    state = {}
    for name, tensor in named:
        if tensor.dtype == torch.float32 and id(tensor) not in kept:
            state[name] = casts.setdefault(id(tensor), tensor.half())
    return state


@contextlib.contextmanager
def float32_norms(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, the BatchNorm and InstanceNorm layers of `module` compute in float32: a float16 input is cast
    to float32 and their output back to float16 (their state stays float32: `float16_state`)."""

    def to_float32(norm: torch.nn.Module, args: tuple) -> tuple:
        return tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.float16 else a for a in args)

    def to_float16(norm: torch.nn.Module, args: tuple, output: Any) -> Any:
        return output.half() if isinstance(output, torch.Tensor) and output.dtype == torch.float32 else output

    handles = []
    for norm in module.modules():
        if isinstance(norm, RUNNING_STATISTICS_NORMS):
            handles += [norm.register_forward_pre_hook(to_float32), norm.register_forward_hook(to_float16)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def float32_values(value: Any) -> Any:
    """`value` (a tensor, or nested tuples/lists of them) with float16 tensors cast to float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype == torch.float16 else value
    if isinstance(value, (tuple, list)):
        items = [float32_values(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple, or not
    return value


def _half(value: Any) -> Any:
    return value.half() if isinstance(value, torch.Tensor) and value.dtype == torch.float32 else value


def record_export_types(desc: _ORTTrainerModelDesc, exported: DryRun) -> None:
    """PyTorch model: input and output dtypes from the first batch and the dry run."""
    for i, dtype in enumerate(exported.input_dtypes):
        desc.add_type_to_input_description(i, dtype)
    for i, dtype in enumerate(exported.output_dtypes):
        desc.add_type_to_output_description(i, dtype)


def record_graph_types(desc: _ORTTrainerModelDesc, model: onnx.ModelProto) -> None:
    """ONNX model: input and output dtypes come from the graph; every model_desc name must be in it."""
    graph = model.graph
    known = {v.name for v in list(graph.input) + list(graph.output)}
    for i, input_desc in enumerate(desc.inputs):
        require(input_desc.name in known, f"ONNX model with unknown input type ({input_desc.name})")
        desc.add_type_to_input_description(i, onnx_to_torch(tensor_elem_type(model, input_desc.name)))
    for i, output_desc in enumerate(desc.outputs):
        require(output_desc.name in known, f"ONNX model with unknown output type ({output_desc.name})")
        desc.add_type_to_output_description(i, onnx_to_torch(tensor_elem_type(model, output_desc.name)))


def check_model_export(output_names: list[str], results: dict[str, torch.Tensor], expected: list[torch.Tensor]) -> None:
    """debug.check_model_export: the exported graph (eval mode) must reproduce PyTorch's outputs."""
    for name, value in zip(output_names, expected, strict=False):
        try:
            np.testing.assert_allclose(results[name].cpu().numpy(), value.cpu().numpy(), rtol=1e-2, atol=1e-6)
        except AssertionError as err:
            raise AssertionError(
                f"Mismatch between outputs of PyTorch model and exported ONNX model for output {name!r}. Note "
                "that different backends may exhibit small computational differences. If this is within "
                "acceptable margin, or if there is random generator in the model causing inevitable mismatch, "
                f"you can proceed training by setting the flag debug.check_model_export to False.\n{err}"
            ) from err
