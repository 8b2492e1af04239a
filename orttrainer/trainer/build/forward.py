"""Stage 1 of building a trainer's model: the model -> its post-processed forward ONNX model and state (`Forward`).

A PyTorch model is built with its first batch; which route depends on the gradient builder (README § Gradient
builders): a dry run in PyTorch finds the custom autograd Functions and `choose_builder` decides (`prepare_torch`).
- The TorchScript route (`torchscript_forward`; 'ort', and 'auto' until it falls back): the module (+ loss) exported
  by the TorchScript exporter, post-processed (`postprocess`), its initializers split into trainable and frozen.
- The torch route (`torch_route_forward`; the torch builder): never the TorchScript exporter. The state comes from
  the module itself, the training graph from AOTAutograd with model_desc's string dims dynamic (compiled in stage
  2), and the forward model from torch.export when first needed (build/torch_route.py).
An ONNX model (`onnx_forward`) is post-processed and split at construction; for the torch builder it becomes an
`OnnxModule` that the builder traces with the first batch.

What building learns about the inputs and outputs (dtypes) is recorded in the model description the `Forward`
carries, a copy of the trainer's (`TrainerConfig.model_desc` stays as the user declared it).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import onnx
import torch

from ..._require import require
from ...debug.subscriber import no_increase_global_step
from ...dtypes import FLOAT_ONNX_TYPES, tensor_proto
from ...schema.model_desc import _ORTTrainerModelDesc
from ..activations import ActivationStatistics
from ..compile.compiler import GraphCache
from ..config import TrainerConfig, recompute_plan
from ..gradient import torch_private
from ..gradient.choice import BuilderChoice, choose_builder
from ..gradient.errors import GradientBuildError
from ..gradient.onnx_module import OnnxModule, running_statistics
from ..gradient.torch_builder import TraceFeatures
from ..gradient.torch_graphs import TorchSource
from ..graph.batch_norm_statistics import BatchNormStatistics, onnx_batch_norm_statistics
from ..graph.postprocess import run_postprocess
from ..inputs import check_inputs
from ..runtime.ort import has_training_build
from ..runtime.session import shape_signature
from . import export as export_mod
from .export import record_export_types, record_graph_types
from .onnx_float16 import float16_forward
from .torch_route import (
    ForwardSource,
    TorchEvalGraphs,
    export_forward,
    module_state,
    named_dims,
    same_size_groups,
    state_model,
)


@dataclass(frozen=True)
class TorchExportInfo:
    """What exporting the PyTorch module learned that later steps need (None for an ONNX model)."""

    state_dict_keys: list[str]  # the module's state_dict order, for `state_dict(pytorch_format=True)`
    aliases: dict[str, str]  # state_dict key -> initializer holding the same (tied) tensor
    unused_state: dict[str, torch.Tensor]  # state_dict entries the graph does not use (copies; they never change)
    sample_outputs: Callable[[], list[torch.Tensor]]  # PyTorch's outputs for the first batch (the dry run's)
    dropout_off: bool  # the module was in eval mode: it trains without dropout, BatchNorm on running statistics
    sample_shapes: tuple[tuple[int, ...], ...] = ()  # the first batch's input shapes


@dataclass(frozen=True)
class Forward:
    """What stage 1 produced and stage 2 (compile/) compiles: the post-processed forward model (for the torch route,
    only the state: its forward model is exported when first needed, `eval_graphs`), the parameter split, the
    gradient builder chosen and what the export learned."""

    model_desc: _ORTTrainerModelDesc  # with the dtypes building learned
    forward: onnx.ModelProto
    trainable: list[str]
    frozen: list[str]
    choice: BuilderChoice
    torch_export: TorchExportInfo | None = None
    source: TorchSource | None = None  # what the torch builder traces
    sample_inputs: Sequence[torch.Tensor] | None = None  # the first batch
    activations: ActivationStatistics | None = None  # orttrainer.debug statistics, when the export marked them
    eval_graphs: TorchEvalGraphs | None = None  # the torch route: its forward model and eval graphs
    batch_norms: list[BatchNormStatistics] = field(default_factory=list)  # updated by a graph pass ('ort')
    fixed_branches: list[str] = field(default_factory=list)  # the export fixed them (`warn_of_fixed_branches`)
    # 'ort' builder: each nn.Embedding weight with a padding_idx -> that index (graph/embedding_padding.py)
    embedding_padding: dict[str, int] = field(default_factory=dict)

    @property
    def state_names(self) -> list[str]:
        return self.trainable + self.frozen


@dataclass(frozen=True)
class TorchPlan:
    """A PyTorch model's dry run, its typed model description and the gradient builder chosen for it."""

    model_desc: _ORTTrainerModelDesc
    dry: export_mod.DryRun
    choice: BuilderChoice

    def falling_back(self, reason: str) -> TorchPlan:
        """'auto' after the TorchScript route failed: the torch route, for `reason`."""
        return replace(self, choice=BuilderChoice("torch", reason))


def prepare_torch(config: TrainerConfig, module: torch.nn.Module, sample_inputs: list) -> TorchPlan:
    """The dry run (no debug step counted, no file written) and the builder `choose_builder` picks for it."""
    desc, options = copy.deepcopy(config.model_desc), config.options
    check_inputs(sample_inputs, desc.inputs)
    with no_increase_global_step():
        reads = options._internal_use.gradient_builder == "torch" or not has_training_build()
        dry = export_mod.dry_run(module, config.loss_fn, desc, sample_inputs, record_reads=reads)
    _refuse_post_accumulate_hooks(module)
    choice = choose_builder(
        options._internal_use.gradient_builder,
        custom_functions=dry.custom_functions,
        training_build=has_training_build(),
        edits_forward=options._internal_use.extra_postprocess is not None,
        recurrent_layers=[type(m).__name__ for m in module.modules() if isinstance(m, torch.nn.RNNBase)],
        cpu=config.device.type == "cpu",
        gradient_edits=[*dry.gradient_edits, *_parameter_hooks(module)],
    )
    record_export_types(desc, dry)
    return TorchPlan(desc, dry, choice)


def _parameter_hooks(module: torch.nn.Module) -> list[str]:
    """The parameters that carry gradient hooks (`p.register_hook`), as `gradient_edits` places."""
    return [f"a gradient hook on parameter {names[0]}" for names in torch_private.parameter_hooks(module)]


def _refuse_post_accumulate_hooks(module: torch.nn.Module) -> None:
    """A hook that runs after `.grad` is accumulated (`register_post_accumulate_grad_hook`: an optimizer step in the
    backward) is a ValueError naming the parameters: the trainer keeps no `.grad` and updates the weights in its
    own graph, so no such hook could ever run."""
    after = [name for name, p in module.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
    if after:
        raise ValueError(
            f"parameters {after} have hooks that run after PyTorch accumulates their .grad "
            "(register_post_accumulate_grad_hook); ORTTrainer keeps no .grad and updates the weights in its training "
            "graph, so they would never run. Remove them (the trainer's optimizer config does the update), or use "
            "p.register_hook to act on the gradient itself"
        )


def prepare_cached(
    config: TrainerConfig, module: torch.nn.Module, sample_inputs: list, output_dtypes: list, choice: BuilderChoice
) -> TorchPlan:
    """`prepare_torch` for a build from the compile cache: the output dtypes and the builder come from the entry,
    and the dry run's eval-mode run is deferred until its outputs are read (`export.deferred_dry_run`)."""
    desc = copy.deepcopy(config.model_desc)
    check_inputs(sample_inputs, desc.inputs)
    dry = export_mod.deferred_dry_run(module, config.loss_fn, desc, sample_inputs, output_dtypes)
    record_export_types(desc, dry)
    return TorchPlan(desc, dry, choice)


def auto_fallback(choice: BuilderChoice, err: Exception) -> str | None:
    """Why 'auto' switches to the torch builder after `err` on the TorchScript route, or None (no switch).

    Any failure of the route is a reason — the TorchScript export, ONNX Runtime's gradient build, the compile
    passes, the training session ONNX Runtime opens (a kernel its CPU build lacks, such as `ConvTransposeGrad`) —
    but three: an operator the exporter has at an opset the option can name (the error says which opset works,
    `export.OpsetTooLowError`, and the legacy option asked for that opset); an error in the user's input or options
    (ValueError, TypeError), which the torch route would meet as well; and running out of memory."""
    if choice.builder != "auto":
        return None
    if isinstance(err, export_mod.OpsetTooLowError) and err.works is not None:
        return None
    if isinstance(err, (ValueError, TypeError, MemoryError)):
        return None
    text = str(err).strip()
    first_line = text.splitlines()[0] if text else type(err).__name__
    if isinstance(err, export_mod.TorchScriptExportError):
        return f"auto: the TorchScript exporter failed ({first_line})"
    if isinstance(err, GradientBuildError) and err.op_type is not None:
        return f"auto: ONNX Runtime's gradient builder cannot differentiate op '{err.op_type}'"
    if isinstance(err, GradientBuildError):
        return f"auto: ONNX Runtime's gradient builder failed ({first_line})"
    return f"auto: the 'ort' builder's graph failed to compile or open ({type(err).__name__}: {first_line})"


class NoBuilderTrainsError(RuntimeError):
    """'auto' tried both gradient builders and neither built the model: the message names both reasons."""


def warn_of_fixed_branches(model: str, branches: list[str]) -> None:
    """Warn (UserWarning) where the TorchScript export fixed a branch on a tensor's value to the first batch's way
    for every batch (`export.ExportedModel.fixed_branches`), once the TorchScript route trains the model. Not an
    error: a branch every batch takes alike (a check for inf, say) trains right, and only the user knows."""
    if branches:
        more = f" (and {len(branches) - 1} more)" if len(branches) > 1 else ""
        warnings.warn(
            f"the forward of {model} takes the truth value of a tensor at {branches[0]}{more}: the TorchScript export "
            "(the 'ort' gradient builder's route) records the way the first batch takes it for every batch, so a "
            "batch whose values take another way trains on the first batch's branch. If yours can, use the torch "
            "gradient builder (options _internal_use.gradient_builder='torch'), which traces each way the batches "
            "take, or compute the branch with tensor operations (torch.where, masks).",
            UserWarning,
            stacklevel=5,
        )


def torchscript_forward(
    config: TrainerConfig,
    module: torch.nn.Module,
    sample_inputs: list,
    activations: ActivationStatistics,
    plan: TorchPlan,
) -> Forward:
    """The TorchScript route: export, mark the subscribed activations, post-process, split the parameters."""
    desc, internal = plan.model_desc, config.options._internal_use
    _refuse_untracked_batch_norms(module)
    with activations.marking():  # counts no debug step; marks subscribed activations
        exported = export_mod.export_model(
            module,
            config.loss_fn,
            desc,
            sample_inputs,
            opset_version=internal.onnx_opset_version,
            enable_contrib_ops=internal.enable_onnx_contrib_ops,
            dry=plan.dry,
        )
    if exported.overwrites_repeated_indices:  # a routed mixture of experts adds each token's experts into its row
        overwrites = (
            "the TorchScript exporter wrote an index_add as a scatter that keeps one of the values added to a "
            "repeated index, where PyTorch adds them all"
        )
        if plan.choice.builder == "auto":
            raise export_mod.TorchScriptExportError(overwrites)
        warnings.warn(
            f"{overwrites}: the 'ort' gradient builder trains {type(module).__name__} right only where the indices "
            "never repeat; the torch gradient builder (options _internal_use.gradient_builder='torch') adds them",
            UserWarning,
            stacklevel=4,
        )
    batch_norms = _batch_norm_statistics(module) if exported.was_training else []
    if exported.was_training:  # in eval mode PyTorch updates no buffer either
        _refuse_dropped_updates(module, exported.mutated, batch_norms)
    counters = {s.counter: module.get_buffer(s.counter) for s in batch_norms if s.counter}
    forward = activations.prepare(exported.model, config.loss_fn, desc, sample_inputs)
    forward = postprocess(config, _with_initializers(forward, counters))
    frozen_weights = list(config.options.utils.frozen_weights)
    buffers = exported.buffers + sorted(counters)
    trainable, frozen = split_parameters(forward, frozen_weights, exported.parameters, buffers)
    trainable, frozen, dropped = read_state(forward, trainable, frozen)
    state = module.state_dict()
    info = TorchExportInfo(
        list(state.keys()),
        exported.aliases,
        {**exported.unused_state, **{name: state[name].detach().clone() for name in dropped if name in state}},
        lambda: exported.sample_outputs,
        not exported.was_training,
        tuple(tuple(t.shape) for t in sample_inputs),
    )
    statistics = activations if activations.instrumented else None
    return Forward(
        desc,
        forward,
        trainable,
        frozen,
        plan.choice,
        info,
        None,
        sample_inputs,
        statistics,
        batch_norms=batch_norms,
        fixed_branches=exported.fixed_branches,
        embedding_padding=_embedding_padding(module, exported.aliases, trainable),
    )


def _embedding_padding(module: torch.nn.Module, aliases: dict[str, str], trainable: list[str]) -> dict[str, int]:
    """The trained weight of each `nn.Embedding` with a `padding_idx` -> that index (graph/embedding_padding.py).
    A tied weight that embeddings with different padding indices share has no single answer: a warning names it,
    and it trains as the graph computes it."""
    found: dict[str, set[int]] = {}
    for path, child in module.named_modules():
        if isinstance(child, torch.nn.Embedding) and child.padding_idx is not None:
            key = f"{path}.weight" if path else "weight"
            found.setdefault(aliases.get(key, key), set()).add(int(child.padding_idx))
    conflicting = sorted(name for name, indices in found.items() if len(indices) > 1)
    if conflicting:
        warnings.warn(
            f"embeddings with different padding_idx share the weights {conflicting}: the 'ort' gradient builder "
            "updates their padding rows from every lookup (PyTorch from none of each embedding's own); the torch "
            "gradient builder (options _internal_use.gradient_builder='torch') trains them as PyTorch does",
            UserWarning,
            stacklevel=4,
        )
    return {name: indices.pop() for name, indices in found.items() if name in trainable and len(indices) == 1}


def _batch_norm_statistics(module: torch.nn.Module) -> list[BatchNormStatistics]:
    """PyTorch's semantics for each BatchNorm of `module` that updates its running statistics in training."""
    found = []
    for path, sub in module.named_modules():
        if (
            isinstance(sub, export_mod.BATCH_NORMS)
            and sub.training
            and sub.track_running_stats
            and sub.running_mean is not None
        ):
            prefix = f"{path}." if path else ""
            counter = f"{prefix}num_batches_tracked"
            found.append(
                BatchNormStatistics(f"{prefix}running_mean", f"{prefix}running_var", counter, sub.momentum, True)
            )
    return found


def _refuse_untracked_batch_norms(module: torch.nn.Module) -> None:
    """A BatchNorm without running statistics normalizes by the batch's own: the TorchScript exporter cannot
    export it (it asks for fixed batch and channel sizes), so it is an error naming the layer ('auto' then trains
    with the torch builder, which exports it)."""
    untracked = [
        path
        for path, sub in module.named_modules()
        if isinstance(sub, export_mod.BATCH_NORMS) and sub.running_mean is None
    ]
    if untracked:
        raise export_mod.TorchScriptExportError(
            f"the BatchNorm layers {untracked} keep no running statistics (track_running_stats=False), which the "
            "TorchScript export that ONNX Runtime's gradient builder trains from cannot export; train it with "
            "options _internal_use.gradient_builder='torch' (or 'auto')"
        )


def _refuse_dropped_updates(
    module: torch.nn.Module, mutated: list[str], batch_norms: list[BatchNormStatistics]
) -> None:
    """A buffer the forward updates in place, whose update the TorchScript export dropped and no pass restores, is
    an error naming it ('auto' then trains with the torch builder, which keeps every such update): never a buffer
    silently left unchanged."""
    restored = {n for s in batch_norms for n in (s.mean, s.var, s.counter) if n}
    dropped = [name for name in mutated if name not in restored]
    if dropped:
        raise export_mod.TorchScriptExportError(
            f"the forward of {type(module).__name__} updates the buffers {dropped} in place, and the TorchScript "
            "export that ONNX Runtime's gradient builder trains from drops such updates; train it with options "
            "_internal_use.gradient_builder='torch', which keeps them"
        )


def _with_initializers(model: onnx.ModelProto, values: dict[str, torch.Tensor]) -> onnx.ModelProto:
    """`model` with `values` added as initializers (the batch counters the running-statistics pass reads)."""
    if not values:
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    result.graph.initializer.extend(tensor_proto(value, name) for name, value in values.items())
    return result


def torch_route_forward(
    config: TrainerConfig,
    module: torch.nn.Module,
    sample_inputs: list,
    plan: TorchPlan,
    activations: ActivationStatistics | None = None,
    split: tuple[list[str], list[str]] | None = None,
    eval_cache: GraphCache | None = None,
) -> Forward:
    """The torch route (build/torch_route.py): state from the module, the training graph from AOTAutograd with
    model_desc's string dims dynamic, the forward model from torch.export when first needed. With a subscribed
    model (`activations`), the trace marks its activations (trainer/activations.py). With
    `_internal_use.extra_postprocess`, the edited forward instead (`edited_torch_forward`). `split`: the
    (trainable, frozen) lists an earlier build found (the compile cache), instead of the dry run's reads;
    `eval_cache`: where the compile cache keeps the traced eval graphs."""
    desc, options, dry = plan.model_desc, config.options, plan.dry
    if dry.read_state is None and split is None:  # 'auto' came from the TorchScript route: the reads are recorded now
        with no_increase_global_step():
            dry = export_mod.dry_run(module, config.loss_fn, desc, sample_inputs)
    names, opset = [d.name for d in desc.inputs], options._internal_use.onnx_opset_version
    dims, outputs, amp = named_dims(desc.inputs), [d.name for d in desc.outputs], options.mixed_precision.enabled
    trainable, frozen = split or module_state(module, list(options.utils.frozen_weights), dry)
    marking = activations.prepare_traced(config.loss_fn, desc, sample_inputs) if activations is not None else None
    features = trace_features(config, marking)
    groups = same_size_groups(desc.inputs)
    source = TorchSource(module, config.loss_fn, names, opset, dry.was_training, dims, groups, features=features)
    forward = ForwardSource(module, config.loss_fn, names, outputs, dims, opset, bool(amp), marking)
    instrument = activations.instrument if activations is not None and marking is not None else None
    traced = options._internal_use.extra_postprocess is None  # the function edits exported forward models
    evals = TorchEvalGraphs(
        forward,
        shape_signature(sample_inputs),
        lambda m: postprocess(config, m),
        trainable + frozen,
        instrument,
        traced,
        eval_cache,
    )
    if options._internal_use.extra_postprocess is not None:
        return edited_torch_forward(config, module, sample_inputs, replace(plan, dry=dry), evals)
    aliases, unused = export_mod.state_outside_graph(module, set(trainable + frozen))
    info = TorchExportInfo(list(module.state_dict()), aliases, unused, lambda: dry.sample_outputs, not dry.was_training)
    weights = state_model(module, trainable + frozen)
    statistics = activations if marking is not None else None
    return Forward(desc, weights, trainable, frozen, plan.choice, info, source, sample_inputs, statistics, evals)


def trace_features(config: TrainerConfig, marking=None) -> TraceFeatures:
    """What acts on the torch builder's traces: the recompute options, memory-efficient gradients, and the
    `orttrainer.debug` marks (`marking`, a context factory; None: no subscriber)."""
    options = config.options
    return TraceFeatures(recompute_plan(options), bool(options.utils.memory_efficient_gradient), marking)


def edited_torch_forward(
    config: TrainerConfig, module: torch.nn.Module, sample_inputs: list, plan: TorchPlan, evals: TorchEvalGraphs
) -> Forward:
    """The torch builder with `_internal_use.extra_postprocess` (README § Gradient builders): the function receives
    the forward ONNX model, as in the legacy API, and the gradient is built from the graph it returns.

    Rules: the module (+ loss) is exported by torch.export in the mode it trains in (dropout as ONNX Dropout in
    training mode), float32, with model_desc's string dims dynamic where the trace allows it; post-processed
    (`postprocess`: the internal passes, the user's function, symbolic shape inference); then trained as an ONNX
    model is on the torch builder: PyTorch's autograd differentiates an `OnnxModule` of the edited graph, so what
    the edited graph computes is what trains. The state is the module's (`module_state`), holding the edited
    graph's initializer values; a parameter the edited graph no longer reads is not trained (a warning names it)
    and stays in `state_dict(pytorch_format=True)` as it was. Eval graphs and `save_as_onnx` use the torch route's
    eval-mode exports (`evals`), which the function edits too. A custom `torch.autograd.Function` is refused at
    the builder choice: the exported graph holds its forward only (gradient/choice.py)."""
    desc, options, dry = plan.model_desc, config.options, plan.dry
    names, outputs = [d.name for d in desc.inputs], [d.name for d in desc.outputs]
    opset = options._internal_use.onnx_opset_version
    source = ForwardSource(module, config.loss_fn, names, outputs, named_dims(desc.inputs), opset)
    exported, _ = export_forward(source, sample_inputs, own_mode=True)
    forward = postprocess(config, exported)
    trainable, frozen = module_state(module, list(options.utils.frozen_weights), dry)
    trainable, frozen, _ = read_state(forward, trainable, frozen)
    onnx_module = OnnxModule(forward, names, outputs, trainable, frozen)
    names_back, features = onnx_module.state_names, trace_features(config)
    traced = TorchSource(onnx_module, None, names, opset, True, state_names=names_back, features=features)
    aliases, unused = export_mod.state_outside_graph(module, set(trainable + frozen))
    info = TorchExportInfo(list(module.state_dict()), aliases, unused, lambda: dry.sample_outputs, not dry.was_training)
    return Forward(desc, forward, trainable, frozen, plan.choice, info, traced, sample_inputs, None, evals)


def onnx_forward(config: TrainerConfig, model: onnx.ModelProto, choice: BuilderChoice | None = None) -> Forward:
    """An ONNX model with a loss output, at construction: choose the builder (unless `choice` is given: 'auto'
    falling back to the torch builder), post-process, record dtypes and split the parameters. With the torch
    builder, also the `OnnxModule` the builder traces (an op it cannot run is an error now); the trainer compiles it
    on its first step (the torch builder traces with a batch)."""
    options = config.options
    choice = choice or choose_builder(
        options._internal_use.gradient_builder,
        onnx_model=True,
        training_build=has_training_build(),
    )
    desc = copy.deepcopy(config.model_desc)
    forward = postprocess(config, model)
    record_graph_types(desc, forward)
    statistics = running_statistics(forward)  # BatchNormalization's, which its forward updates: frozen state
    trainable, frozen = split_parameters(forward, [*options.utils.frozen_weights, *statistics], None, None)
    if choice.builder == "torch":  # OnnxModule updates them as buffers, the trace keeps the updates
        return Forward(
            desc, forward, trainable, frozen, choice, source=_onnx_source(config, forward, trainable, frozen)
        )
    return Forward(
        desc, forward, trainable, frozen, choice, batch_norms=onnx_batch_norm_statistics(forward, trainable + frozen)
    )


def _onnx_source(
    config: TrainerConfig, forward: onnx.ModelProto, trainable: list[str], frozen: list[str]
) -> TorchSource:
    """The torch builder's source for an ONNX model: an OnnxModule of the post-processed forward model, its state
    renamed back to initializer names (gradient/onnx_module/). The torch builder takes output 0 as the loss.
    Under mixed precision the OnnxModule runs the forward converted to float16 (build/onnx_float16.py), and the
    trace adds only the loss scale."""
    desc = config.model_desc
    inputs, outputs = [d.name for d in desc.inputs], [d.name for d in desc.outputs]
    if not desc.outputs[0].is_loss:
        raise ValueError(f"the 'torch' gradient builder needs the loss as the first model_desc output: {outputs}")
    amp = bool(config.options.mixed_precision.enabled)
    graph = float16_forward(forward, [*trainable, *frozen], inputs, outputs[0]) if amp else forward
    module = OnnxModule(graph, inputs, outputs, trainable, frozen)
    opset = config.options._internal_use.onnx_opset_version
    names, features = module.state_names, trace_features(config)
    return TorchSource(module, None, inputs, opset, True, state_names=names, features=features, float16_casts=not amp)


def read_state(
    forward: onnx.ModelProto, trainable: list[str], frozen: list[str]
) -> tuple[list[str], list[str], list[str]]:
    """(trainable, frozen, dropped): the state tensors the post-processed `forward` holds as initializers, and the
    others. Rule: a tensor an `extra_postprocess` edit removed from the graph is neither trained nor fed (it keeps
    its value in `state_dict(pytorch_format=True)`); a warning names the parameters among them."""
    initializers = {i.name for i in forward.graph.initializer}
    dropped = [name for name in [*trainable, *frozen] if name not in initializers]
    lost = [name for name in trainable if name in dropped]
    if lost:
        warnings.warn(
            f"parameters {lost} are not in the graph _internal_use.extra_postprocess returned; they are not trained",
            stacklevel=5,
        )
    return [n for n in trainable if n in initializers], [n for n in frozen if n in initializers], dropped


def split_parameters(
    model: onnx.ModelProto, frozen_weights: list[str], torch_params: list[str] | None, torch_state: list[str] | None
) -> tuple[list[str], list[str]]:
    """(trainable, frozen) initializer names.

    PyTorch model: its `requires_grad` parameters minus `utils.frozen_weights` are trained; buffers, other
    parameters and the listed frozen weights are frozen state. ONNX model: every floating-point initializer not in
    `frozen_weights` is trained; other initializers stay constants of the graph.
    """
    initializers = {i.name: i for i in model.graph.initializer}
    unknown = [name for name in frozen_weights if name not in initializers]
    if unknown:
        raise RuntimeError(f"{unknown} params from 'frozen_weights' not found in the ONNX model.")
    frozen_set = set(frozen_weights)
    if torch_params is not None:
        trainable = [n for n in torch_params if n not in frozen_set]
        frozen = [n for n in (torch_state or []) if n in initializers] + [n for n in torch_params if n in frozen_set]
        return trainable, frozen
    trainable = [n for n, i in initializers.items() if n not in frozen_set and i.data_type in FLOAT_ONNX_TYPES]
    return trainable, list(frozen_weights)


def postprocess(config: TrainerConfig, model: onnx.ModelProto) -> onnx.ModelProto:
    """The legacy post-processing options: internal passes, `extra_postprocess`, symbolic shape inference."""
    options = config.options
    internal = options._internal_use
    if internal.enable_internal_postprocess:
        model = run_postprocess(model)
    if internal.extra_postprocess:
        model = internal.extra_postprocess(model)
        require(
            isinstance(model, onnx.ModelProto),
            f"'extra_postprocess' must return a ONNX model (options _internal_use.extra_postprocess returned "
            f"{type(model).__name__})",
        )
    if options.utils.run_symbolic_shape_infer:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        model = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
    return model
