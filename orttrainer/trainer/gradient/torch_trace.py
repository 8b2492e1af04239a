"""How the `torch` gradient builder traces a module: the joint forward+backward aten graph, with dynamic dims when
asked, and the errors that name what could not be traced.

Rules:
- Dynamic dims: `trace_joint(..., dynamic_dims)` traces with those dims symbolic (one graph for every size its
  guards accept); without them, with the sample's concrete shapes. Both use
  `torch_private.aot_export_joint_dynamic`, which also captures values read from tensors in a custom Function
  (`.item()` feeding tensor arithmetic) as graph computations; what its descriptor mapping does not support falls
  back to AOTAutograd's positional export (`torch_private.aot_export_joint`, concrete shapes). The builder falls
  back from a failed dynamic trace to a concrete-shape one.
- Plain tensor attributes (`self.offset = torch.tensor(...)`, neither a parameter nor a buffer) are constants of
  the graph, as PyTorch's own tracers treat them: their value when the graph is traced is baked in. So are
  tensors read from a global or a closure; only the positional fallback refuses those, with an error asking to
  register them as buffers.
- A forward that stores a tensor on its module (a causal mask cached in `self.mask` the first time a length is
  seen, as ONNX Runtime's transformer sample does; or in a dict, as transformers' LeViT does) leaves the module as
  it found it after each of the tracer's runs (`attributes_restored`, in `JointWrapper.forward`): every run
  computes what the forward computes from its inputs (AOTAutograd runs the forward more than once; a tensor kept
  from an earlier run would be a stray placeholder, "Unexpected fake buffer", or a constant), and no placeholder
  stays on the module afterwards.
- `torch.utils.checkpoint` traces with either implementation (`torch_private.reentrant_checkpoint_traceable`).
- Exactly the `trainable` parameters require grad while tracing; the flags are restored afterwards.
- Tracing leaves the model as it was, also when it fails: attributes, parameters, buffers and submodules a
  forward rebinds while traced are put back (`torch_private.module_state_kept`).
- Data-dependent Python (an `if` on a tensor's value, `.item()` feeding Python) is traced the way the batch takes
  it: a trace with placeholder values that fails on such a branch is traced again with the batch's and the
  state's real values (`torch_private.aot_export_joint_dynamic(real_values=True)`), for the batch's shapes, and
  the graph comes with `ValueGuards`: the ops that compute what the branches read, from the batch, and the way
  each went. A later batch whose values go another way gets a graph of its own (compile/compiler.py). A branch
  on a parameter's value or on a random draw cannot be guarded so: the error names the file and line and how to
  rewrite it. A Python `assert` on a value is assumed to hold (`torch_private.asserting_shape_env`).
  nn.Transformer* masks are taken as causal only by their `is_causal` hint
  (`torch_private.causal_mask_from_hint`), which computes the same attention.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

from ..build.export import _ModelWithLoss
from . import torch_private
from .errors import GradientBuildError

_T = TypeVar("_T")
_logger = logging.getLogger(__name__)


class UntraceableFunctionError(GradientBuildError):
    """A custom `torch.autograd.Function`'s forward or backward cannot be traced into a graph."""

    def __init__(self, function: str, phase: str, location: str, reason: str) -> None:
        self.function, self.phase, self.location = function, phase, location
        advice = next((text for name, text in _LIBRARY_FUNCTIONS.items() if name in function), None)
        super().__init__(
            f"The {phase} of the custom torch.autograd.Function '{function}' cannot be traced into the ONNX "
            f"training graph: {reason} (at {location}). The torch gradient builder records {function}.{phase} "
            "once, with placeholder tensors that have no values, so it must compute with tensor operations only: "
            "a value read from a tensor (.item()) may feed tensor arithmetic, but no Python if/while, float() or "
            "Python math on it (use torch.where or masks), no .numpy() or .tolist(), no outputs whose shape "
            "depends on values (torch.nonzero). "
            + (advice or f"Rewrite {function}.{phase} that way, or train this model with plain PyTorch.")
        )


# Custom Functions of libraries, which their users cannot rewrite, by a part of their name: what to do instead
_LIBRARY_FUNCTIONS = {
    "transformers_grouped_mm": "This is transformers' mixture-of-experts layer (Mixtral, Qwen-MoE...), which "
    "groups the tokens by expert, in shapes that depend on the routing. Load the model with "
    'experts_implementation="batched_mm" (from_pretrained or from_config): it computes each token\'s experts in '
    "static shapes, which the builder traces.",
}


@contextlib.contextmanager
def experts_in_static_shapes(root: torch.nn.Module) -> Iterator[None]:
    """Within the block, the mixture-of-experts layers of transformers' models under `root` compute with the
    experts implementation 'batched_mm' where they had 'grouped_mm' (their default); on exit each model has the
    implementation it had.

    Why: 'grouped_mm' groups the tokens by expert in shapes the routing decides, in a custom Function whose backward
    no trace records (`_LIBRARY_FUNCTIONS`); 'batched_mm' computes the same values in static shapes. transformers
    switches between the two itself (its `generate` does, for decoding), through the models'
    `set_experts_implementation`, which this uses."""
    switched: list[tuple[Callable[[dict], None], dict]] = []
    configs: set[int] = set()
    for module in root.modules():
        config = getattr(module, "config", None)
        current, choose = (getattr(module, f"{verb}_experts_implementation", None) for verb in ("get", "set"))
        if not callable(current) or not callable(choose) or id(config) in configs:
            continue
        configs.add(id(config))
        original = current()
        if "grouped_mm" in original.values():
            choose({k: "batched_mm" if v == "grouped_mm" else v for k, v in original.items()})
            switched.append((choose, original))
    if switched:
        _logger.info("transformers' experts are traced with experts_implementation 'batched_mm' (for 'grouped_mm')")
    try:
        yield
    finally:
        for choose, original in reversed(switched):
            choose(original)


class JointWrapper(torch.nn.Module):
    """`(loss, *outputs)` of `_ModelWithLoss`, flattened to tensors, with the outputs detached: AOTAutograd
    differentiates the loss only and rejects other outputs that require grad.

    With `mixed_precision`: the model computes in float16 on float32 state (build/export.py), and the result
    is `(loss · loss_scale, loss, *outputs)` with the loss float32 and `loss_scale` a float32 scalar buffer (the
    builder makes it a graph input, `LOSS_SCALE_BUFFER`): the backward starts from the scaled loss, so its seed
    d(loss · s)/d loss = s enters where the backward starts, as the 'ort' path's `append_loss_scale` does.

    `float16` False (mixed precision for a module that computes in float16 itself, an ONNX model's converted graph,
    build/onnx_float16.py): the loss scale without the float16 casts.

    The gradient hooks on the module's parameters (`p.register_hook`) act on the traced gradients
    (`torch_private.parameter_hooks_applied`).

    `hooks`, when given, makes a context each forward runs in (a fresh one per call: a trace may call forward
    more than once): the trainer's tracing features (activation marks, layer boundaries, invertible layer norms;
    gradient/torch_builder.py)."""

    def __init__(
        self,
        module: torch.nn.Module,
        loss_fn: Callable | None,
        input_names: Sequence[str],
        mixed_precision: bool = False,
        hooks: Callable[[], contextlib.AbstractContextManager] | None = None,
        float16: bool = True,
    ) -> None:
        super().__init__()
        self.inner = _ModelWithLoss(module, loss_fn, list(input_names), float16=mixed_precision and float16)
        self.mixed_precision = mixed_precision
        self.hooks = hooks
        self.parameter_hooks = torch_private.parameter_hooks(module)  # kept: the trace swaps the parameters
        if mixed_precision:
            self.register_buffer(LOSS_SCALE_BUFFER, torch.ones((), dtype=torch.float32))

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hooks = self.hooks() if self.hooks is not None else contextlib.nullcontext()
        with (
            attributes_restored(self.inner),  # each of the tracer's runs starts from the module as it is
            hooks,
            torch_private.parameter_hooks_applied(self.inner.model, self.parameter_hooks),
        ):
            loss, *outputs = flatten_tensors(self.inner(*inputs))
        detached = tuple(t.detach() for t in outputs)
        if not self.mixed_precision:
            return (loss, *detached)
        loss = loss.float()
        return (loss * getattr(self, LOSS_SCALE_BUFFER), loss.detach(), *detached)


LOSS_SCALE_BUFFER = "orttrainer_loss_scale"  # JointWrapper's own buffer: the qualified name is unique


def flatten_tensors(value) -> list[torch.Tensor]:
    """The tensors in nested tuples/lists, in order (other values are dropped)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in flatten_tensors(item)]
    return []


TraceResult = tuple[
    torch.fx.GraphModule,
    torch_private.JointSignature,
    torch_private.ShapeGuards | None,
    torch_private.ValueGuards | None,
]


def trace_joint(
    wrapper: JointWrapper,
    inputs: Sequence[torch.Tensor],
    trainable: Sequence[str],
    dynamic_dims: Sequence[Sequence[int]] | None = None,
    same_sizes: Sequence[Sequence[tuple[int, int]]] = (),
    for_torch_onnx: bool = True,
) -> TraceResult:
    """The joint graph of `wrapper` on `inputs` (module docstring): (graph, signature, guards, value guards);
    guards are None for a graph valid for the inputs' own shapes only (no dynamic dims), value guards None for a
    graph that took no branch on a value. `for_torch_onnx`: also decomposed for torch.onnx
    (`torch_private.trace_decompositions`); else for the direct translation. Raises GradientBuildError naming the
    parameters without gradient; with dynamic dims, PyTorch's error for any other failure (the builder then traces
    with concrete shapes); without, GradientBuildError naming what cannot be traced."""
    dims = [list(d) for d in dynamic_dims] if dynamic_dims is not None else [[] for _ in inputs]
    dynamic = any(dims)
    with (
        translated_directly(not for_torch_onnx),
        torch_private.module_state_kept(wrapper),  # a failed (or any) trace leaves no traced tensor in the model
        experts_in_static_shapes(wrapper),
        _requires_grad_only(wrapper, wrapper.inner.model, set(trainable)),
        tensor_attributes_as_buffers(wrapper),
    ):
        on_values: Exception | None = None  # the trace failed on a branch on a value: traced again with values
        try:
            groups = same_sizes if dynamic else ()
            graph, sig, guards, _ = traced(
                lambda: torch_private.aot_export_joint_dynamic(
                    wrapper, inputs, dims, groups, float16=wrapper.mixed_precision, for_torch_onnx=for_torch_onnx
                )
            )
            return graph, sig, guards if dynamic else None, None
        except GradientBuildError:
            raise  # the model's own (OnnxModule names its node); with dynamic dims the builder then tries concrete ones
        except Exception as err:
            if _refused_by_model(err, wrapper, inputs):
                raise
            if not dynamic and _branches_on_values(err):
                on_values = err
            else:
                explained = _specific_error(err, wrapper, inputs, trainable)
                if explained is not None and (explained.unreachable or not dynamic):
                    raise explained from err
                if dynamic:
                    raise
        if on_values is not None:  # outside the handler: the second trace's errors do not chain to the first's
            return _trace_with_values(wrapper, inputs, trainable, for_torch_onnx, on_values)
        try:  # what the descriptor-based trace does not map: AOTAutograd's positional joint export
            graph, sig = traced(
                lambda: torch_private.aot_export_joint(
                    wrapper, inputs, 0, float16=wrapper.mixed_precision, for_torch_onnx=for_torch_onnx
                )
            )
            return graph, sig, None, None
        except GradientBuildError:
            raise
        except Exception as err:
            raise _explain_trace_error(err, wrapper, inputs, trainable) from err


def _branches_on_values(err: Exception) -> bool:
    """Whether a trace failed on Python reading a tensor's value that is not a random draw's."""
    return torch_private.is_data_dependent_error(err) and torch_private.random_branch(err) is None


def _trace_with_values(
    wrapper: JointWrapper,
    inputs: Sequence[torch.Tensor],
    trainable: Sequence[str],
    for_torch_onnx: bool,
    failure: Exception,
) -> TraceResult:
    """The joint graph traced with the real values of `inputs` and of the state, for their shapes, with its value
    guards (module docstring). Raises the error that explains `failure` (the trace without values) when this
    trace fails too or its branches cannot be guarded, with the reason."""
    try:  # with the real values a random draw has one too: the branches every draw takes alike are decided first
        with tracing_context(), value_reads_avoided():
            graph, sig, _, values = torch_private.aot_export_joint_dynamic(
                wrapper,
                inputs,
                [[] for _ in inputs],
                float16=wrapper.mixed_precision,
                for_torch_onnx=for_torch_onnx,
                real_values=True,
            )
    except GradientBuildError:
        raise
    except Exception as err:
        if _refused_by_model(err, wrapper, inputs):
            raise
        unguarded = isinstance(err, torch_private.ValueBranchError)  # the trace ran; its branches were the problem
        specific = None if unguarded else _specific_error(err, wrapper, inputs, trainable)
        if specific is not None:  # what stopped the trace past the branches: parameters without gradient, LayerDrop
            raise specific from err
        explained = _specific_error(failure, wrapper, inputs, trainable)
        if explained is None:
            raise
        if isinstance(err, torch_private.ValueBranchError) and err.state is not None:
            state = err.state.removeprefix("inner.model.")  # the wrapper's name for the model's state (JointWrapper)
            reason = f"the branch reads the model's state ({state}), not only the batch"
        elif unguarded:
            reason = str(err)
        else:
            reason = f"{type(err).__name__}: {_first_line(err)}"
        retried = f"Traced with the batch's values, it failed too: {reason}."
        if type(explained) is not GradientBuildError:  # a more specific error (a custom Function's) keeps its type
            explained.add_note(retried)
            raise explained from err
        raise GradientBuildError(f"{explained} ({retried})") from err
    where = torch_private.user_frame(failure)
    _logger.info(
        "%s branches on tensor values%s: its graph is traced with this batch's values, and serves the batches "
        "whose values branch the same way (conditions: %s)",
        type(wrapper.inner.model).__name__,
        f" at {where[0]}:{where[1]} (`{where[2]}`)" if where else "",
        ", ".join(map(str, values.conditions)) if values is not None else "none",
    )
    return graph, sig, None, values


def trace_forward(
    module: torch.nn.Module, inputs: Sequence[torch.Tensor], float16: bool = False, for_torch_onnx: bool = False
) -> tuple[torch.fx.GraphModule, torch_private.JointSignature, torch_private.ValueGuards | None]:
    """The forward-only graph of `module` (returning a tuple of tensors) on `inputs`, for their shapes, without
    gradients, for the direct translation (an eval graph: build/torch_route.py) or, `for_torch_onnx`, for
    torch.onnx, and its value guards (None: no branch on a value). The module is traced as it is, in its mode,
    under the rules of `trace_joint` (state kept, tensor attributes as constants, the same tracing context, a branch
    on a value traced with the real values); PyTorch's error propagates unexplained (the caller falls back to
    torch.export)."""
    detached = [t.detach() for t in inputs]
    with (
        translated_directly(not for_torch_onnx),
        torch_private.module_state_kept(module),
        tensor_attributes_as_buffers(module),
        experts_in_static_shapes(module),
    ):
        try:
            return traced(
                lambda: torch_private.aot_export_forward(module, detached, float16, for_torch_onnx=for_torch_onnx)
            )
        except Exception as err:
            if not _branches_on_values(err):
                raise
        with tracing_context(), torch_private.random_branches_decided():  # as in `_trace_with_values`
            return torch_private.aot_export_forward(module, detached, float16, True, for_torch_onnx)


_trace = threading.local()


@contextlib.contextmanager
def translated_directly(direct: bool) -> Iterator[None]:
    """Within the block (this thread), traces are for the direct translation (gradient/aten_onnx.py) when `direct`,
    else for torch.onnx: decompositions may then use ops only the direct translation knows (the recurrences of
    gradient/recurrent_ops.py)."""
    previous = getattr(_trace, "direct", False)
    _trace.direct = direct
    try:
        yield
    finally:
        _trace.direct = previous


def for_direct_translation() -> bool:
    """Whether the trace running in this thread is for the direct translation (`translated_directly`)."""
    return getattr(_trace, "direct", False)


@contextlib.contextmanager
def tracing_context() -> Iterator[None]:
    """What the traces run under: scaled-dot-product attention on its math backend, checkpoints in their
    traceable form, and the flags torch.export sets (`torch_private`)."""
    with (
        torch_private.math_sdpa(),
        torch_private.no_mkldnn(),
        torch_private.causal_mask_from_hint(),  # nn.Transformer* with a mask
        torch_private.traceable_cumulative_batch_norm(),  # BatchNorm(momentum=None)
        torch_private.autograd_decompositions(),  # torch_private/decompositions.py, stage "autograd"
        torch_private.reentrant_checkpoint_traceable(),
        torch_private.export_tracing_flags(),  # the model sees what torch.export shows it
        torch_private.linalg_checks_untraced(),  # torch.linalg.inv, solve, cholesky...
        torch_private.causal_mask_detection_off(),
    ):
        yield


def traced(trace: Callable[[], _T]) -> _T:
    """`trace()` under `tracing_context`; where it fails on reading a traced tensor's value, once more under
    `value_reads_avoided`. The retry's error is the one raised. Only the models that read a value pay for those
    modes, which see every torch call of the trace (about a tenth more time)."""
    try:
        with tracing_context():
            return trace()
    except Exception as err:
        if not torch_private.is_data_dependent_error(err):
            raise
    with tracing_context(), value_reads_avoided():
        return trace()


@contextlib.contextmanager
def value_reads_avoided() -> Iterator[None]:
    """The two reads of a tensor's value that a trace can do without: a branch on a random draw that every draw
    takes alike (`torch_private.random_branches_decided`: transformers' LayerDrop at probability 0, BART's
    default) and indexing by a 0-dim integer tensor, traced as a select by that tensor
    (`torch_private.tensor_indices_selected`: Autoformer's top-k delays)."""
    with torch_private.random_branches_decided(), torch_private.tensor_indices_selected():
        yield


@contextlib.contextmanager
def attributes_restored(root: torch.nn.Module) -> Iterator[None]:
    """Within the block the forward may set plain attributes of `root`'s submodules; on exit every submodule's
    plain attributes are what they were (added ones removed, changed ones set back), and so are the entries of a
    plain dict attribute the forward filled in place (transformers' LeViT caches its attention biases in eval mode
    in `self.attention_bias_cache[device]`: a later run of the tracer would read the earlier run's traced tensor as
    a constant). Parameters, buffers and submodules are not plain attributes and are left alone."""
    registries = ("_parameters", "_buffers", "_modules")
    saved = [
        (module, dict(vars(module)), {n: dict(v) for n, v in vars(module).items() if type(v) is dict})
        for module in root.modules()
    ]
    try:
        yield
    finally:
        for module, before, entries in saved:
            now = vars(module)
            for name in [n for n in now if n not in before and n not in registries]:
                del now[name]
            for name, value in before.items():
                if name not in registries and now.get(name, _ABSENT) is not value:
                    now[name] = value
            for name, content in entries.items():
                table = now[name]
                if table.keys() != content.keys() or any(table[k] is not v for k, v in content.items()):
                    table.clear()
                    table.update(content)


_ABSENT = object()


@contextlib.contextmanager
def tensor_attributes_as_buffers(root: torch.nn.Module) -> Iterator[list[str]]:
    """Within the block, every plain tensor attribute of `root`'s submodules is a non-persistent buffer, so the
    tracers see it as module state (the torch builder then bakes it in as a constant: it is not trainer state).
    Yields their qualified names. Why: AOTAutograd refuses a real tensor met during its fake-tensor trace ("Please
    convert all Tensors to FakeTensors first"), which names neither the tensor nor a fix."""
    moved: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    names: list[str] = []
    for prefix, module in root.named_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                moved.append((module, attr, value))
                names.append(f"{prefix}.{attr}" if prefix else attr)
    try:
        for module, attr, value in moved:
            delattr(module, attr)
            module.register_buffer(attr, value, persistent=False)
        yield names
    finally:
        for module, attr, value in moved:
            module._buffers.pop(attr, None)
            setattr(module, attr, value)


class _requires_grad_only:
    """Within the block exactly the module parameters named in `trainable` require grad (AOTAutograd emits
    gradients for those); parameters of the loss function never do. Restores the flags on exit."""

    def __init__(self, wrapper: torch.nn.Module, module: torch.nn.Module, trainable: set[str]) -> None:
        wanted = {id(p) for n, p in module.named_parameters() if n in trainable}
        self._params = list(wrapper.parameters())
        self._saved = [p.requires_grad for p in self._params]
        self._wanted = [id(p) in wanted for p in self._params]

    def __enter__(self) -> None:
        for p, flag in zip(self._params, self._wanted, strict=True):
            p.requires_grad_(flag)

    def __exit__(self, *exc) -> None:
        for p, flag in zip(self._params, self._saved, strict=True):
            p.requires_grad_(flag)


def _explain_trace_error(
    err: Exception, wrapper: JointWrapper, inputs: Sequence[torch.Tensor], trainable: Sequence[str]
) -> GradientBuildError:
    """Name the custom Function, the parameters without gradient, or the foreign tensor behind a failed trace."""
    explained = _specific_error(err, wrapper, inputs, trainable)
    if explained is not None:
        return explained
    model_name = type(wrapper.inner.model).__name__
    message = (
        f"PyTorch could not trace the forward and backward of {model_name} into a graph: {type(err).__name__}: {err}"
    )
    if _fails_eagerly(wrapper, inputs, type(err), compiling=True):
        message += (
            f". {model_name} raises {type(err).__name__} in eager PyTorch too when torch.compiler.is_compiling() is "
            "True, as it is under torch.compile and torch.export and in this trace: its code takes another path "
            "then (transformers' models, for one, then leave a missing attention_mask missing). Give the model the "
            "inputs that path needs (an attention_mask, in model_desc and each step's inputs), or the model's "
            "maintainers the failure"
        )
    return GradientBuildError(message)


def _refused_by_model(err: Exception, wrapper: JointWrapper, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether a trace failed because the model refuses these inputs (a shape it does not take), as it does eagerly:
    its own `raise` (`torch_private.raised_by_model`), which it also raises run eagerly without torch.compile's
    flags. Such an error goes to the caller as it is."""
    return torch_private.raised_by_model(err) and _fails_eagerly(wrapper, inputs, type(err), compiling=False)


def _fails_eagerly(
    wrapper: JointWrapper, inputs: Sequence[torch.Tensor], error: type[Exception], compiling: bool
) -> bool:
    """Whether the model (+ loss_fn), run eagerly on `inputs`, raises `error`; `compiling`: with the flags
    torch.export sets (`torch_private.export_tracing_flags`). The trainer's dry run ran the model on the first
    batch without the flags, so a failure with them is the model's path under those flags, not the trace's; one
    without them is the model's own refusal of these inputs. The run leaves the model as it was: no autograd graph
    (`no_grad`), its buffers' values put back (a BatchNorm in training mode updates its statistics), the user's
    random stream forked, and its attributes restored by the caller's `torch_private.module_state_kept`. No copy of
    the model: a large model that fails to trace must not need twice its memory to say why."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in wrapper.inner.buffers()]
    flags = torch_private.export_tracing_flags() if compiling else contextlib.nullcontext()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), flags:
            wrapper.inner(*inputs)
    except error:
        return True
    except Exception:  # another failure: nothing to say about the flags
        return False
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    return False


def _specific_error(
    err: Exception, wrapper: JointWrapper, inputs: Sequence[torch.Tensor], trainable: Sequence[str]
) -> GradientBuildError | None:
    found = _failing_function(err)
    if found is not None:
        cls, phase, location = found
        return UntraceableFunctionError(cls.__qualname__, phase, location, f"{type(err).__name__}: {_first_line(err)}")
    model_name = type(wrapper.inner.model).__name__
    if torch_private.is_missing_gradient_error(err):
        unused = _parameters_without_gradient(wrapper, inputs, trainable)
        return GradientBuildError(
            f"PyTorch produced no gradient for {unused or 'some trainable parameters'} of "
            f"{model_name}: these parameters do not influence the loss. Freeze them with "
            "options utils.frozen_weights.",
            unreachable=unused,
        )
    comparison = torch_private.random_branch(err)
    if comparison is not None or torch_private.is_data_dependent_error(err):
        where = torch_private.user_frame(err)
        place = f" at {where[0]}:{where[1]} (`{where[2]}`)" if where else ""
        if comparison is not None:
            return GradientBuildError(
                f"the forward of {model_name} (or its loss_fn) branches in Python{place} on a random draw, "
                f"{comparison}, whose outcome changes from step to step; one training graph holds one outcome. "
                "This is LayerDrop in transformers' models: set the model config's layerdrop (encoder_layerdrop, "
                "decoder_layerdrop) to 0, or hand the model over in eval mode. A comparison that every draw decides "
                "the same way (a probability of 0 or 1) is traced."
            )
        return GradientBuildError(
            f"the forward of {model_name} (or its loss_fn) reads the value of a tensor in Python{place}: an if/while "
            "on a tensor, bool(), float(), .item() or .tolist(). The torch gradient builder traces the model once "
            "with placeholder tensors that have no values, as torch.export does, so such a branch cannot be "
            "recorded. Compute it with tensor operations instead (torch.where, masks, clamp), or move the check "
            "out of forward (validate the data before train_step)."
        )
    if torch_private.is_real_tensor_in_trace_error(err):
        return GradientBuildError(
            f"the forward of {model_name} (or its loss_fn) reads a tensor that is neither an input, a parameter, a "
            "buffer nor a tensor attribute of a torch.nn.Module (a global, a closure variable, or a tensor inside "
            "a list or dict attribute), which the torch gradient builder cannot trace. Register it as a buffer in "
            "the module that uses it: self.register_buffer('name', tensor) (persistent=False keeps it out of the "
            f"state_dict). {_first_line(err)}"
        )
    return None


def _failing_function(err: BaseException) -> tuple[type, str, str] | None:
    """(class, phase, "file:line") of the innermost custom Function forward/backward on the failing stack,
    following chained exceptions."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for frame, line in reversed(list(traceback.walk_tb(current.__traceback__))):
            found = torch_private.autograd_function_of_frame(frame)
            if found is not None:
                return (*found, f"{frame.f_code.co_filename}:{line}")
        current = current.__cause__ or current.__context__
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _parameters_without_gradient(
    wrapper: JointWrapper, inputs: Sequence[torch.Tensor], trainable: Sequence[str]
) -> list[str]:
    """Eager check on a copy (the forward may update buffers): trainable parameters whose gradient is None."""
    try:
        runner = copy.deepcopy(wrapper)
        params = dict(runner.inner.model.named_parameters())
        with torch_private.reentrant_checkpoint_traceable():  # the reentrant form refuses autograd.grad
            loss = runner(*inputs)[0]
            grads = torch.autograd.grad(loss, [params[n] for n in trainable], allow_unused=True)
    except Exception:
        return []
    return [n for n, g in zip(trainable, grads, strict=True) if g is None]
