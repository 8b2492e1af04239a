"""torch's tracers: AOTAutograd's joint forward+backward graphs, decompositions, and what their errors mean.

Part of `torch_private` (see its docstring for the rule); verified on torch 2.13.0 (CPU).
"""

from __future__ import annotations

import bisect
import contextlib
import dis
import functools
import linecache
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .decompositions import forward_decompositions, trace_decompositions


@contextlib.contextmanager
def no_mkldnn() -> Iterator[None]:
    """oneDNN (mkldnn) off while tracing.

    Why: PyTorch's decomposition of `aten.lstm` picks `mkldnn_rnn_layer`, which has no ONNX translation, when
    oneDNN is on and the LSTM's input does not require grad (an LSTM reading the data directly); with it off the
    LSTM is traced as its cell arithmetic, as it is when the input requires grad."""
    enabled = torch._C._get_mkldnn_enabled()  # not mkldnn.flags(): it also sets TF32 and warns about it
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@contextlib.contextmanager
def causal_mask_from_hint() -> Iterator[None]:
    """Within the block, nn.TransformerEncoder/Decoder (and nn.Transformer) take an attention mask as causal only
    when the caller says so (`is_causal=True`), never by comparing its values with a causal mask.

    Why: PyTorch's `_detect_is_causal_mask` reads the mask's values (`bool((mask == causal).all())`), which a
    traced tensor does not have (DataDependentOutputException: aten._local_scalar_dense). Either answer computes
    the same attention: with is_causal False the layers apply the mask itself, which is exactly what a causal mask
    does; only a fused kernel's speed-up depends on the hint, and the traced graph has none."""
    from torch.nn.modules import transformer

    detect = transformer._detect_is_causal_mask

    def from_hint(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
        return is_causal is True

    transformer._detect_is_causal_mask = from_hint
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


class RandomBranchError(RuntimeError):
    """Python branched on a comparison of a uniform random draw with a bound that some draws pass and others do
    not (`random_branches_decided`): `comparison` says which, as `torch.rand(...) < 0.1`."""

    def __init__(self, comparison: str) -> None:
        super().__init__(f"a branch on {comparison}, whose outcome changes from draw to draw")
        self.comparison = comparison


@contextlib.contextmanager
def random_branches_decided() -> Iterator[None]:
    """Within the block (this thread), Python's truth value of a comparison of a uniform random draw
    (`torch.rand`, `torch.rand_like`) with a number is the one every draw gives, where every draw gives the same:
    a draw is in [0, 1), so `draw < p` is False for p <= 0 and True for p >= 1, and likewise for <=, > and >=. The
    comparison is still traced as it is; only `bool()` / `.item()` of its one-element result is answered without
    its value. Where draws differ (0 < p < 1), such a read fails, as a `RandomBranchError` naming the comparison.

    Why: transformers' LayerDrop (BART, mBART, Marian, Pegasus, Whisper, OPT, wav2vec2 and more) runs, in
    training mode, `if torch.rand([]) < self.layerdrop: skip the layer` before every layer, and most of these
    models' layerdrop is 0 by default. A traced tensor has no value (DataDependentOutputException), so every such
    model failed to trace, though at 0 its branch never depends on the draw."""
    from torch.overrides import TorchFunctionMode

    draws: dict[int, torch.Tensor] = {}  # id -> the draw, held so that ids stay unique within the block
    compared: dict[int, tuple[torch.Tensor, bool | None, str]] = {}  # id -> (result, outcome or None, text)

    class DecidedDraws(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
            kwargs = kwargs or {}
            if func in _TRUTH_READS and args and id(args[0]) in compared:
                result, outcome, text = compared[id(args[0])]
                if result is args[0] and result.numel() == 1:
                    if outcome is not None:
                        return outcome
                    try:
                        value = func(*args, **kwargs)
                    except Exception as err:
                        if is_data_dependent_error(err):
                            raise RandomBranchError(text) from err
                        raise
                    if not isinstance(value, (bool, int, float)):  # a symbol for the traced value: no outcome
                        raise RandomBranchError(text)
                    return value
            out = func(*args, **kwargs)
            if func in _UNIFORM_DRAWS and isinstance(out, torch.Tensor):
                draws[id(out)] = out
            elif func in _COMPARISONS and len(args) == 2 and isinstance(out, torch.Tensor):
                draw, bound = args
                if id(draw) in draws and draws[id(draw)] is draw and _is_number(bound):
                    op = _COMPARISONS[func]
                    text = f"torch.rand(...) {op} {bound!r}"
                    compared[id(out)] = (out, _every_draw(op, float(bound)), text)
            return out

    with DecidedDraws():
        yield


@contextlib.contextmanager
def tensor_indices_selected() -> Iterator[None]:
    """Within the block (this thread), indexing by a 0-dim integer tensor `t` (neither bool nor uint8:
    `x[:, t]`) is traced as the select it is: `x.index_select(d, t)` of the dim `d` that `t` indexes (`t` wrapped
    into `[0, x.size(d))` as a negative index is), then the int 0 in `t`'s place. Values and gradients are
    eager's: PyTorch's indexing reads such a `t` as the Python int `t.item()` and selects (docs/engine.md §43),
    which a traced tensor cannot answer (it has no value: DataDependentOutputException).

    Why: transformers' Autoformer picks its top-k delays in training mode by `x[:, top_k_delays_index[i]]`.
    Only an index that is a tuple (or a bare tensor) of None, Ellipsis, bools, ints, slices and tensors is
    rewritten (`_selected_dims`); a list inside it (PyTorch's rules for sequences) is left as it is."""
    from torch.overrides import TorchFunctionMode

    class SelectedIndices(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
            kwargs = kwargs or {}
            if func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
                tensor, index = args
                items = list(index) if isinstance(index, tuple) else [index]
                selected = _selected_dims(items, tensor.dim())
                if selected:
                    for at, dim in selected:
                        position = items[at].long()
                        position = torch.where(position < 0, position + tensor.size(dim), position)
                        tensor = tensor.index_select(dim, position.reshape(1))
                        items[at] = 0
                    return tensor[tuple(items)]
            return func(*args, **kwargs)

    with SelectedIndices():
        yield


def _selected_dims(items: list[Any], ndim: int) -> list[tuple[int, int]] | None:
    """For an index's items (PyTorch's tuple index), the (item position, dim of the indexed tensor) of each 0-dim
    integer tensor among them; None when an item is of a kind not listed in `tensor_indices_selected`. Rule, as
    PyTorch's indexing counts dims: None and a Python bool take no dim, a bool or uint8 tensor takes as many as it
    has, any other tensor, an int and a slice one; Ellipsis takes the dims the others leave."""

    def taken(item: Any) -> int | None:
        if item is None or item is Ellipsis or isinstance(item, bool):
            return 0
        if isinstance(item, (int, slice, torch.SymInt)):
            return 1
        if isinstance(item, torch.Tensor):
            return item.dim() if item.dtype in (torch.bool, torch.uint8) else 1
        return None

    counts = [taken(item) for item in items]
    if any(count is None for count in counts) or sum(item is Ellipsis for item in items) > 1:
        return None
    sizes = [count or 0 for count in counts]
    if Ellipsis in items:
        sizes[items.index(Ellipsis)] = ndim - sum(sizes)
    selected, dim = [], 0
    for at, item in enumerate(items):
        if _is_integer_scalar_tensor(item):
            selected.append((at, dim))
        dim += sizes[at]
    return selected


def _is_integer_scalar_tensor(item: Any) -> bool:
    return (
        isinstance(item, torch.Tensor)
        and item.dim() == 0
        and not item.dtype.is_floating_point
        and not item.dtype.is_complex
        and item.dtype not in (torch.bool, torch.uint8)
    )


@contextlib.contextmanager
def truth_reads() -> Iterator[list[str]]:
    """Within the block (this thread), each place where Python takes a tensor's truth value (`if mask.any():`,
    `bool(t)`, `and`/`or`/`not` on a tensor) is appended to the yielded list, once, as "file:line (`source`)"; a
    check (`_in_check`: an `assert`, or an `if` that raises at once) is left out, since every batch that trains
    takes it the same way. Run eagerly, where sizes are Python numbers, these are branches on values, never on
    shapes.

    Why: the TorchScript exporter records the way its sample takes such a branch for every later input, with only
    a TracerWarning, which it also gives for branches on sizes (traced as tensors there)."""
    from torch.overrides import TorchFunctionMode

    found: list[str] = []

    class TruthReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
            if func in _TRUTH_READS and func is not torch.Tensor.item:
                frame = sys._getframe(1)
                while frame.f_back is not None and frame.f_code.co_filename == torch.overrides.__file__:
                    frame = frame.f_back
                if not _in_check(frame):
                    place = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                    source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                    if not any(entry.startswith(place + " ") for entry in found):
                        found.append(f"{place} (`{source}`)")
            return func(*args, **(kwargs or {}))

    with TruthReads():
        yield found


@contextlib.contextmanager
def gradient_edits() -> Iterator[Callable[[Any], list[str]]]:
    """Within the block (this thread, grad mode on), a detach (`.detach()`, `.data`) of a floating-point tensor
    requiring grad is a stop, and so is each op under `torch.no_grad()` that takes one, but those that read only
    its shape (`zeros_like`, `new_empty`, ...); each `Tensor.register_hook` on such a tensor rewrites its gradient.
    Every floating-point result computed from a stopped or hooked tensor carries the place on; integer and boolean
    results carry nothing (a comparison or an index computes no gradient in any graph). The yielded function
    gives, for a tensor the block computed, the places it carries: "file:line (`source`)" of the innermost calling
    frame outside torch and orttrainer, each once. With grad on, a result that does not require grad although an
    input does is no stop unless it is a detach: `type_as(h)`, `expand_as(h)` read only h's metadata.

    Why: the TorchScript exporter writes `.detach()` and the ops under `torch.no_grad()` as plain ops and drops the
    hooks, so ONNX Runtime's gradient builder differentiates through them: a silently wrong gradient wherever such
    a value reaches the loss."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    carried: dict[int, tuple[weakref.ref, tuple[str, ...]]] = {}
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    ours = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))) + os.sep

    def places_of(value: Any) -> tuple[str, ...]:
        entry = carried.get(id(value))
        return entry[1] if entry is not None and entry[0]() is value else ()

    def caller() -> str:
        frame: Any = sys._getframe(2)
        while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith((torch_dir, ours)):
            frame = frame.f_back
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        return f"{frame.f_code.co_filename}:{frame.f_lineno} (`{source}`)"

    class GradientEdits(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
            out = func(*args, **(kwargs or {}))
            if func is torch.Tensor.register_hook and args and isinstance(args[0], torch.Tensor):
                hooked = args[0]
                if hooked.requires_grad and _differentiable(hooked):
                    places = (*places_of(hooked), caller())
                    carried[id(hooked)] = (weakref.ref(hooked), tuple(dict.fromkeys(places)))
                return out
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and _differentiable(t)]
            if not outputs:
                return out
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and _differentiable(t)]
            inherited = tuple(dict.fromkeys(p for t in inputs for p in places_of(t)))
            if torch.is_grad_enabled():  # only a detach stops; `type_as(h)` and `expand_as(h)` read h's metadata
                reads = [args[0]] if _detaches(func) and args and isinstance(args[0], torch.Tensor) else []
            else:  # every op under `torch.no_grad()`, but those that read only shapes
                name = getattr(func, "__name__", "")
                reads = [] if name.endswith("_like") or name.startswith("new_") else inputs
            stops = any(t.requires_grad for t in reads) and not all(t.requires_grad for t in outputs)
            here = caller() if stops else None
            for t in outputs:
                places = (*inherited, here) if here is not None and not t.requires_grad else inherited
                if places:
                    carried[id(t)] = (weakref.ref(t), tuple(dict.fromkeys(places)))
            return out

    def reaching(value: Any) -> list[str]:
        return list(dict.fromkeys(p for t in tree_leaves(value) for p in places_of(t)))

    with GradientEdits():
        yield reaching


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _detaches(func: Any) -> bool:
    """`Tensor.detach`, `torch.detach`, `Tensor.detach_` or the `.data` getter, as a torch function mode sees it."""
    return (
        getattr(func, "__name__", "") in ("detach", "detach_") or getattr(func, "__self__", None) is torch.Tensor.data
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _every_draw(op: str, bound: float) -> bool | None:
    """What `draw <op> bound` gives for every draw in [0, 1), or None where draws differ."""
    if op in ("<", "<="):
        return True if bound >= 1 else False if bound < 0 or (op == "<" and bound == 0) else None
    return True if bound < 0 or (op == ">=" and bound == 0) else False if bound >= 1 else None


_UNIFORM_DRAWS = frozenset({torch.rand, torch.rand_like})
_COMPARISONS = {
    **dict.fromkeys((torch.lt, torch.Tensor.lt, torch.Tensor.__lt__), "<"),
    **dict.fromkeys((torch.le, torch.Tensor.le, torch.Tensor.__le__), "<="),
    **dict.fromkeys((torch.gt, torch.Tensor.gt, torch.Tensor.__gt__), ">"),
    **dict.fromkeys((torch.ge, torch.Tensor.ge, torch.Tensor.__ge__), ">="),
}
_TRUTH_READS = frozenset({torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.is_nonzero})


@contextlib.contextmanager
def traceable_cumulative_batch_norm() -> Iterator[None]:
    """Within the block, a BatchNorm with `momentum=None` (the cumulative average) in training mode updates its
    running statistics with tensor operations: the same values, traceable.

    Why: PyTorch's `_BatchNorm.forward` computes that average's factor in Python, `1.0 /
    float(self.num_batches_tracked)`, a value a traced tensor does not have (DataDependentOutputException). Rule,
    as PyTorch's: `num_batches_tracked += 1`, `f = 1 / num_batches_tracked`, `running_mean = (1 - f) ·
    running_mean + f · mean`, `running_var = (1 - f) · running_var + f · unbiased var`, both over the batch and
    every spatial position of a channel; the output normalises with the batch statistics. Other BatchNorms run
    PyTorch's own forward."""
    from torch.nn.modules.batchnorm import _BatchNorm

    forward = _BatchNorm.forward

    def cumulative(self: Any, input: torch.Tensor) -> torch.Tensor:
        if self.momentum is not None or not self.training or not self.track_running_stats:
            return forward(self, input)
        self._check_input_dim(input)
        self.num_batches_tracked.add_(1)
        output = torch.nn.functional.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        dims = [0, *range(2, input.dim())]
        with torch.no_grad():
            factor = 1.0 / self.num_batches_tracked.to(self.running_mean.dtype)
            mean = input.mean(dims).to(self.running_mean.dtype)
            var = input.var(dims, unbiased=True).to(self.running_var.dtype)
            self.running_mean.mul_(1.0 - factor).add_(factor * mean)
            self.running_var.mul_(1.0 - factor).add_(factor * var)
        return output

    _BatchNorm.forward = cumulative  # type: ignore[method-assign]
    try:
        yield
    finally:
        _BatchNorm.forward = forward  # type: ignore[method-assign]


@contextlib.contextmanager
def module_state_kept(root: torch.nn.Module) -> Iterator[None]:
    """Every submodule of `root` has exactly its attributes, parameters, buffers and children of before the block
    when the block ends, whether it succeeded or raised.

    Why: a forward that stores a tensor on the module (`self.cache = h`, a buffer rebound with `self.pe = ...`)
    stores a traced (functional or fake) tensor while PyTorch traces it; left there, the module's next eager use
    or trace fails on it (a FunctionalTensor where a tensor was expected). Tracing must not change the model."""
    saved = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in root.modules()]
    try:
        yield
    finally:
        for module, attributes, parameters, buffers, children in saved:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            pairs: tuple[tuple[dict, dict], ...] = (
                (module._parameters, parameters),
                (module._buffers, buffers),
                (module._modules, children),
            )
            for now, before in pairs:
                now.clear()
                now.update(before)


def is_data_dependent_error(err: BaseException) -> bool:
    """True for the tracers' refusal to read a traced tensor's value (Python control flow on a tensor,
    `.item()`, `.tolist()`): it has none while tracing."""
    names = {type(e).__name__ for e in _chain(err)}
    return bool(names & {"DataDependentOutputException", "GuardOnDataDependentSymNode", "UserError"}) and any(
        "data-dependent" in str(e).lower() or "_local_scalar_dense" in str(e) or "aten.equal" in str(e)
        for e in _chain(err)
    )


def random_branch(err: BaseException) -> str | None:
    """The comparison of a random draw that a failed trace branched on (`RandomBranchError`), or None."""
    found = [e for e in _chain(err) if isinstance(e, RandomBranchError)]
    return found[0].comparison if found else None


def user_frame(err: BaseException) -> tuple[str, int, str] | None:
    """(file, line, source) of the innermost frame of the failing stack that is not PyTorch's tracing machinery
    (torch/_*, torch/fx, torch/utils, torch/overrides.py): the model code (or the torch.nn function) whose
    Python reads a tensor's value."""
    import traceback

    found = None
    for e in _chain(err):
        for frame, line in traceback.walk_tb(e.__traceback__):
            path = frame.f_code.co_filename
            if _model_code(path):
                found = (path, line, linecache.getline(path, line).strip())
    return found


def raised_by_model(err: BaseException) -> bool:
    """Whether `err` comes from a `raise` statement of model code (`_model_code`): the model refusing the inputs it
    is traced on (`if x.shape[0] > 8: raise ValueError(...)`), as it would eagerly. An error of orttrainer's own
    types never is, wherever it was raised."""
    tb = err.__traceback__
    if tb is None or type(err).__module__.split(".")[0] == __name__.split(".")[0]:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if not _model_code(code.co_filename):
        return False
    instructions, offsets = _instructions(code)
    at = bisect.bisect_left(offsets, tb.tb_lasti)
    return at < len(offsets) and offsets[at] == tb.tb_lasti and instructions[at].opname == "RAISE_VARARGS"


def _model_code(path: str) -> bool:
    """Whether a source file is model code (or a torch.nn function): neither PyTorch's tracing machinery nor
    orttrainer's."""
    ours = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    return not _tracing_machinery(path) and not os.path.abspath(path).startswith(ours + os.sep)


def _tracing_machinery(path: str) -> bool:
    """Whether a source file is PyTorch's tracing machinery (torch/_*, torch/fx, torch/utils, torch/overrides.py),
    not model code or a torch.nn function."""
    posix = path.replace(os.sep, "/")
    return any(part in posix for part in ("/torch/_", "/torch/fx/", "/torch/utils/", "/torch/overrides.py"))


def _chain(err: BaseException) -> list[BaseException]:
    seen, out = set(), []
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


@contextlib.contextmanager
def math_sdpa() -> Iterator[None]:
    """Force `scaled_dot_product_attention` onto its math backend while tracing.

    Why: the fused CPU/CUDA kernels (flash, memory-efficient) appear in the traced graph as opaque ops with
    opaque backward ops that have no ONNX translation; the math backend traces into matmul/softmax."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


@contextlib.contextmanager
def linalg_checks_untraced() -> Iterator[None]:
    """Within the block, `aten._linalg_check_errors` (which `torch.linalg.inv`, `solve`, `cholesky`, `lu_factor`
    and `eig`'s backward call to raise on a singular or non-definite input) is not an effectful op.

    Why: AOTAutograd threads an effect token through the joint graph for it, and then mismatches its own
    tangents ("IndexError: tuple index out of range" in aot_export_module, torch 2.13, with no orttrainer code
    involved). A fake-tensor trace cannot read the `info` value it checks anyway: the traced graph leaves the
    check out, as it does with the `_ex` variants (`linalg.inv_ex`), so a singular input gives inf/nan instead
    of PyTorch's error."""
    entry = torch._library.simple_registry.singleton.find("aten::_linalg_check_errors")
    previous = entry.effect.effect
    handle = entry.effect.register(None)
    try:
        yield
    finally:
        handle.destroy()
        if previous is not None and entry.effect.effect != previous:
            entry.effect.register(previous)


@contextlib.contextmanager
def export_tracing_flags() -> Iterator[None]:
    """Within the block, `torch.compiler.is_compiling()` and `torch.compiler.is_exporting()` are True, as they are
    while torch.export traces a module (non-strict mode, the same make_fx tracer as AOTAutograd).

    Why: library code reads these flags to leave eager-only steps out of a traced graph. transformers' attention
    masks (5.x) otherwise branch in Python on `padding_mask.all()`, a value no fake-tensor trace has
    (DataDependentOutputException); the eval-mode forward, exported with torch.export, already sees them set."""
    from torch._export.utils import _compiling_state_context

    with _compiling_state_context():
        yield


@contextlib.contextmanager
def causal_mask_detection_off() -> Iterator[None]:
    """Within the block, `torch.nn.TransformerEncoder` (and the decoder) take `is_causal` as given — None and
    False mean "not known to be causal" — instead of comparing the attention mask with a causal one.

    Why: with `is_causal=None` they test `bool((mask == causal).all())`, a value no fake-tensor trace has
    (DataDependentOutputException; PyTorch's transformer tutorial and ONNX Runtime's transformer sample pass their
    mask so). The flag is only a hint for a fused kernel: the mask itself is applied either way, so the traced
    graph computes the same values (the trace runs attention on the math backend, `math_sdpa`)."""
    from torch.nn.modules import transformer

    detect = transformer._detect_is_causal_mask

    def as_given(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
        return bool(is_causal)

    transformer._detect_is_causal_mask = as_given
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


@dataclass(frozen=True)
class JointSignature:
    """What each placeholder and output of a joint forward+backward graph is, in graph order.

    inputs: one `(kind, name)` per placeholder; kind is "parameter" or "buffer" (name = the wrapper's qualified
    name, tied parameters appear once per name) or "user" (name = the placeholder name).
    outputs: one `(kind, name)` per graph output; kind is "mutation" (name = mutated buffer or placeholder),
    "user" (name = the output node name; the loss is the one at `loss_index` among the user outputs) or
    "gradient" (name = qualified parameter name).
    """

    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]


def aot_export_joint(
    module: torch.nn.Module,
    args: Sequence[Any],
    loss_index: int = 0,
    float16: bool = False,
    for_torch_onnx: bool = True,
) -> tuple[torch.fx.GraphModule, JointSignature]:
    """Trace `module(*args)` and PyTorch's backward of its output `loss_index` into one functional aten graph.

    Decompositions: `trace_decompositions(float16, for_torch_onnx)` (`float16`: the module computes in float16).
    Placeholders
    are (parameters, buffers, user inputs); outputs are (mutated inputs, user outputs, parameter gradients), as
    `JointSignature` spells out. Custom
    `torch.autograd.Function`s contribute their own forward and backward. `module` must return a tuple; every
    non-loss output must not require grad (detach it); every parameter that requires grad must receive a
    gradient (see `is_missing_gradient_error`)."""
    from torch._functorch.aot_autograd import aot_export_module

    with torch.enable_grad(), warnings.catch_warnings():
        # anomaly-mode and pytree deprecation warnings fire on every trace; failures raise instead
        warnings.simplefilter("ignore")
        graph, sig = aot_export_module(
            module,
            list(args),
            trace_joint=True,
            output_loss_index=loss_index,
            decompositions=trace_decompositions(float16, for_torch_onnx),
        )
    if not isinstance(graph, torch.fx.GraphModule):  # the joint trace always returns one
        raise TypeError(f"aot_export_module returned {type(graph).__name__}, not a GraphModule")
    return _assertions_removed(graph), _joint_signature(graph, sig)


def aot_export_forward(
    module: torch.nn.Module,
    args: Sequence[Any],
    float16: bool = False,
    real_values: bool = False,
    for_torch_onnx: bool = False,
) -> tuple[torch.fx.GraphModule, JointSignature, ValueGuards | None]:
    """Trace `module(*args)` without a backward into one functional aten graph for the input shapes of `args`,
    decomposed for the direct translation or, `for_torch_onnx`, for torch.onnx (`forward_decompositions`). Placeholders
    are (parameters, buffers, user inputs); outputs are (mutated inputs, user outputs): a `JointSignature` without
    gradients. `module` must return a tuple of tensors. The inputs are fake tensors of their own shapes in an
    `asserting_shape_env`, as the joint trace's are; the trace's checks are removed (`_assertions_removed`).
    `real_values`: as `aot_export_joint_dynamic`'s (the value guards, else None)."""
    from torch._functorch.aot_autograd import aot_export_module
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape_env = asserting_shape_env()
    with contextlib.ExitStack() as stack:
        if real_values:
            stack.enter_context(_real_values_propagated())
        mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t for t in args]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # as in `aot_export_joint`
            table = forward_decompositions(float16, for_torch_onnx)
            graph, sig = aot_export_module(module, fakes, trace_joint=False, decompositions=table)
    if not isinstance(graph, torch.fx.GraphModule):
        raise TypeError(f"aot_export_module returned {type(graph).__name__}, not a GraphModule")
    user_inputs = {str(name): k for k, name in enumerate(sig.user_inputs)}
    values = _value_guards(graph, shape_env, user_inputs) if real_values else None
    return _assertions_removed(graph), _joint_signature(graph, sig), values


def _assertions_removed(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rule: the checks a trace records are removed from `graph` (edited in place, returned): a tensor's dtype,
    shape and device (`aten._assert_tensor_metadata`, which `Tensor.to` records in forward traces), a tensor's
    truth (`torch._assert_async`, in transformers' LongT5), a check on a traced value (`aten._assert_scalar`:
    `torch._check`) and a traced size's range. They return nothing and
    ONNX has no assertion op; torch.onnx drops the same ops. The trace is for the checked shapes and dtypes; a
    value check does not run in the graph, as it would not in a model exported to ONNX."""
    aten = torch.ops.aten
    checks = {
        aten._assert_tensor_metadata.default,
        aten._assert_async.default,
        aten._assert_async.msg,
        aten._assert_scalar.default,
        aten.sym_constrain_range_for_size.default,
    }
    for node in list(graph.graph.nodes):
        if node.op == "call_function" and node.target in checks and not node.users:
            graph.graph.erase_node(node)
    return graph


@dataclass(frozen=True)
class ShapeGuards:
    """The input shapes a graph traced with dynamic dims is valid for: `accepts(inputs)` evaluates every guard
    the trace recorded on the user inputs' sizes (PyTorch's own guard expression, as torch.compile checks before
    reusing a graph), including that a dynamic dim is >= 2 (sizes 0 and 1 are specialised by PyTorch's tracer)."""

    shape_env: Any
    code: str | None  # None: no guard at all
    dynamic_dims: list[list[int]]  # the requested dims the trace kept symbolic (others were specialised)

    def accepts(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Rule: the guards hold for contiguous tensors of the inputs' shapes (the trainer feeds ONNX Runtime
        contiguous copies, so the strides and storage offsets the guards also mention are those)."""
        if self.code is None:
            return True
        proxies = [torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for t in inputs]
        return bool(self.shape_env.evaluate_guards_expression(self.code, proxies))


def asserting_shape_env() -> Any:
    """A ShapeEnv in which a check on a traced value is assumed to pass: an `assert` statement, or an `if` one of
    whose ways raises at once (`if torch.any(var < 0): raise ValueError(...)`, `_passing_way`). Where a condition
    on a value the trace does not know (a symbol `.item()`, `bool()` or a data-dependent size made) is asked for at
    a check, the ShapeEnv answers the way that passes, as PyTorch's `guard_or_false` answers: no guard, no check
    in the graph. Values read from tensors become unbacked symbols.

    Why: models check their inputs so (transformers' XLM and FlauBERT: `assert lengths.max().item() <= slen`;
    ProphetNet: `assert torch.all(ids >= 0).item(), "..."`; the CTC heads: `if labels.max() >= vocab_size:
    raise`), torch.nn's Gaussian NLL loss checks an activation (a predicted variance), and a traced tensor has no
    value to check. Such a branch decides whether the model stops, not what it computes. The trainer's dry run runs
    the forward eagerly on the first batch, so a check that fails there still raises; later batches are not
    checked, as in a model exported to ONNX. Any other branch on a value fails, unless the fake tensors carry real
    values (`_real_values_propagated`): the ShapeEnv then takes the condition's value from them, silently
    (`_value_guards` reads the conditions back)."""
    return _asserting_shape_env_class()()


@functools.cache
def _asserting_shape_env_class() -> type:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

    class AssertingShapeEnv(ShapeEnv):
        def evaluate_expr(
            self,
            orig_expr: Any,
            hint: Any = None,
            fx_node: Any = None,
            size_oblivious: bool = False,
            fallback_value: bool | None = None,
            *,
            forcing_spec: bool = False,
        ) -> Any:
            if fallback_value is None and free_unbacked_symbols(orig_expr):  # a value the trace may not know
                frame = _asking_frame(sys._getframe(1))
                fallback_value = _passing_way(frame) if frame is not None else None
            return super().evaluate_expr(
                orig_expr, hint, fx_node, size_oblivious, fallback_value, forcing_spec=forcing_spec
            )

        def _log_real_tensor_propagation(self, orig_expr: Any, unsound_result: Any) -> None:
            # a condition taken from a real value is what a trace with real values is for (`_value_guards` reads
            # each one back); PyTorch warns of each, as its draft export reports them as findings
            return None

        def _log_suppressed_dde(self, a: Any, assumed_value: bool) -> None:
            # a check assumed to pass (`evaluate_expr`) is this ShapeEnv's rule, not a finding; PyTorch logs each
            return None

    return AssertingShapeEnv


def _asking_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The frame that asked the ShapeEnv for a value, from `frame` outwards: the first outside PyTorch's tracing
    machinery (its list, and `_tracing_machinery`: a FunctionalTensor's `__bool__` is Python) and this file (whose
    torch function modes, `random_branches_decided`, pass the question on)."""
    from torch.fx.experimental.symbolic_shapes import uninteresting_files

    while frame is not None and (
        frame.f_code.co_filename in uninteresting_files()
        or frame.f_code.co_filename == __file__
        or _tracing_machinery(frame.f_code.co_filename)
    ):
        frame = frame.f_back
    return frame


def _passing_way(frame: types.FrameType) -> bool | None:
    """Rule: where `frame` stands at a check — a conditional jump one of whose ways raises at once — the truth value
    that takes the other way; None elsewhere. A way raises at once when it runs straight (no jump, store or
    return) into RAISE_VARARGS: it may build the error and its message, f-strings without conditions included; a
    raise inside a `try` block with an `except` clause is none, since the clause may turn it into a way of
    computing.
    So `if cond: raise` passes on False, `if not cond: raise` and `assert cond` (the jump over
    LOAD_ASSERTION_ERROR ... RAISE_VARARGS) on True, as does each operand of `and` in an assert (its jump goes to
    the raise). An operand of `or` in an assert jumps on true to the statement after and goes on to the next
    operand on false: neither way raises at once, so it is no check."""
    found = _jump_at(frame)
    if found is None:
        return None
    instructions, at, target = found
    jumps_on = instructions[at].opname.endswith("IF_TRUE")
    if not jumps_on and not instructions[at].opname.endswith("IF_FALSE"):
        return None  # POP_JUMP_IF_NONE and the like: no truth value
    handled = _handled_ranges(frame.f_code)
    if _raises_at_once(instructions, at + 1, handled):
        return jumps_on  # the jump passes
    if target is not None and _raises_at_once(instructions, target, handled):
        return not jumps_on  # going on passes
    return None


def _in_check(frame: types.FrameType) -> bool:
    """Whether `frame` stands at a check (`_passing_way`)."""
    return _passing_way(frame) is not None


def _jump_at(frame: types.FrameType) -> tuple[list[dis.Instruction], int, int | None] | None:
    """The instructions of `frame`'s code, the index of the conditional jump at which it asks for a truth value
    (past Python 3.13's TO_BOOL, or a COMPARE_OP), and the index of the jump's target; None when it stands at
    none."""
    instructions, offsets = _instructions(frame.f_code)
    at = bisect.bisect_left(offsets, frame.f_lasti)
    while at < len(instructions) and instructions[at].opname in ("TO_BOOL", "COMPARE_OP"):
        at += 1
    if at >= len(instructions) or not instructions[at].opname.startswith("POP_JUMP"):
        return None
    target = next((k for k, i in enumerate(instructions) if i.offset == instructions[at].argval), None)
    return instructions, at, target


@functools.lru_cache(maxsize=256)
def _instructions(code: types.CodeType) -> tuple[list[dis.Instruction], list[int]]:
    """`code`'s instructions and their offsets (a trace asks at the same few places many times)."""
    instructions = list(dis.get_instructions(code))
    return instructions, [i.offset for i in instructions]


@functools.lru_cache(maxsize=256)
def _handled_ranges(code: types.CodeType) -> tuple[range, ...]:
    """The offsets of `code` whose exceptions an `except` clause may catch: the ranges of Python 3.11's exception
    table whose handler tests the exception's type (CHECK_EXC_MATCH). A `with` block's handler (WITH_EXCEPT_START)
    and a `finally` raise again."""
    instructions, offsets = _instructions(code)
    ranges = []
    for entry in dis.Bytecode(code).exception_entries:  # type: ignore[attr-defined]  # Python 3.11's, untyped
        at = bisect.bisect_left(offsets, entry.target)
        if any(i.opname in ("CHECK_EXC_MATCH", "CHECK_EG_MATCH") for i in instructions[at : at + 8]):
            ranges.append(range(entry.start, entry.end))
    return tuple(ranges)


# what ends a way that raises at once before its RAISE_VARARGS: control flow, a store, an exception handler's ops
_NOT_STRAIGHT = ("JUMP", "RETURN", "STORE", "DELETE", "YIELD", "FOR_ITER", "SEND", "SETUP", "WITH", "RERAISE", "EXC")


def _raises_at_once(instructions: list[dis.Instruction], start: int, handled: tuple[range, ...]) -> bool:
    """Whether the code from `instructions[start]` runs straight into a RAISE_VARARGS that no `except` clause
    around it may catch (`handled`: a raise caught so is control flow, not a check)."""
    for instruction in instructions[start : start + 64]:
        if instruction.opname == "RAISE_VARARGS":
            return not any(instruction.offset in covered for covered in handled)
        if any(word in instruction.opname for word in _NOT_STRAIGHT):
            return False
    return False


def aot_export_joint_dynamic(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    dynamic_dims: Sequence[Sequence[int]],
    same_sizes: Sequence[Sequence[tuple[int, int]]] = (),
    float16: bool = False,
    for_torch_onnx: bool = True,
    real_values: bool = False,
) -> tuple[torch.fx.GraphModule, JointSignature, ShapeGuards, ValueGuards | None]:
    """`aot_export_joint` with the dims `dynamic_dims[i]` of `args[i]` symbolic: one graph for every size of
    those dims that satisfies the returned guards. Each group of `same_sizes` ((input, dim) pairs) is one size
    (model_desc names them alike): one symbol, which keeps the symbolic arithmetic small. `float16`,
    `for_torch_onnx`: as `aot_export_joint`'s.

    How: the user inputs become fake tensors with symbolic sizes in a ShapeEnv, and
    `aot_export_joint_with_descriptors` traces the joint graph (aot_export_module re-traces its joint without
    symbolic shapes: "SymIntArrayRef expected to contain only concrete integers", verified on 2.13). `module`
    must return `(loss, *outputs not requiring grad)`; the loss's tangent input becomes the constant 1 and the
    placeholders and outputs are described by a `JointSignature` as `aot_export_joint`'s are. Values read from
    tensors (`.item()`) become graph computations; tensors the forward reads that are neither parameters,
    buffers nor inputs become constants of the graph (as torch.export treats them). Raises NotImplementedError
    for a graph feature this mapping does not know, and `MissingGradientError` when a parameter requiring grad
    gets no gradient.

    `real_values` (no dynamic dims): the fake tensors carry the values of `args` and of the module's state, so a
    branch on a value (`if mask.any():`) takes the way these inputs take, and the graph comes with the
    `ValueGuards` that say which inputs it is valid for (else None). Every op then also runs on the real values:
    a slower trace, for the models that need it."""
    from torch._dynamo.source import ConstantSource
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    if real_values and any(dynamic_dims):
        raise ValueError("a trace with real values has no dynamic dims")
    shape_env = asserting_shape_env()
    with contextlib.ExitStack() as stack:
        if real_values:
            stack.enter_context(_real_values_propagated())
        mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
        fakes = []
        for i, (tensor, dims) in enumerate(zip(args, dynamic_dims, strict=True)):
            sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(tensor.dim())]
            context: Any = StatelessSymbolicContext(dynamic_sizes=sizes)
            # a fresh contiguous tensor: the guards must not pin the sample's strides or storage offset (a shard of
            # a batch is a view with an offset), since `ShapeGuards.accepts` checks contiguous inputs
            base = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
            if real_values:
                base.copy_(tensor.detach())
            fakes.append(mode.from_tensor(base, symbolic_context=context, source=ConstantSource(f"input{i}")))
        for group in same_sizes:
            (first, first_dim), *others = group
            for i, d in others:  # a guard: the ShapeEnv replaces the second symbol by the first
                torch._check(fakes[i].shape[d] == fakes[first].shape[first_dim])
        with contextlib.ExitStack() as trace, torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = trace_decompositions(float16, for_torch_onnx)
            joint = aot_export_joint_with_descriptors(trace, module, tuple(fakes), decompositions=table)
    values = _value_guards(joint.graph_module, shape_env, _plain_inputs(joint.graph_module)) if real_values else None
    graph = _assertions_removed(joint.graph_module)
    tied: dict[int, list[str]] = {}  # a parameter's names (several when tied), in module order
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            tied.setdefault(id(param), []).append(name)
    sig = _descriptor_signature(graph, list(tied.values()))
    pairs = zip(fakes, dynamic_dims, strict=True)
    kept = [[d for d in dims if _still_symbolic(shape_env, fake.shape[d])] for fake, dims in pairs]
    guards = ShapeGuards(shape_env, shape_env.produce_guards_expression(fakes, ignore_static=False), kept)
    return graph, sig, guards, values


class ValueBranchError(RuntimeError):
    """A branch on a value that a graph cannot be guarded by: what it reads is not only the batch. `state`: the
    qualified name of the parameter or buffer it reads (of the traced module), if that is why."""

    def __init__(self, message: str, state: str | None = None) -> None:
        super().__init__(message)
        self.state = state


# The ShapeEnv's message for a condition it took from a real value (`fake_tensor_propagate_real_tensors`)
_REAL_VALUE_MESSAGE = "propagate_real_tensors"
_VALUE_READ = torch.ops.aten._local_scalar_dense.default  # what bool(), .item() and .tolist() of a tensor lower to


@dataclass(frozen=True)
class ValueGuards:
    """The way each branch on a tensor's value went when a graph was traced with real values
    (`aot_export_joint_dynamic(real_values=True)`): the graph is valid for the inputs whose values go the same way.

    `program` holds the ops of the trace that compute the values read (from the user inputs at positions
    `inputs`); `bindings` says, per output of the program, which symbol of the trace it gives and where in the
    output it is (PyTorch's key path); `conditions` are the trace's assumptions about those symbols
    (`u0 == 1`: `mask.any()` was true). `hold(inputs)` runs the program on the batch in PyTorch and checks them."""

    program: torch.fx.GraphModule
    inputs: tuple[int, ...]
    bindings: tuple[tuple[Any, Any], ...]
    conditions: tuple[Any, ...]

    def hold(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Rule: every condition is true for the values `program` computes from `inputs` (the user inputs, in
        trace order)."""
        import sympy
        from torch.utils._pytree import key_get

        with torch.no_grad():
            outputs = self.program(*(inputs[i] for i in self.inputs))
        bound = zip(outputs, self.bindings, strict=True)
        values = {symbol: sympy.sympify(key_get(out, path)) for out, (symbol, path) in bound}
        return all(bool(condition.xreplace(values)) for condition in self.conditions)


@contextlib.contextmanager
def _real_values_propagated() -> Iterator[None]:
    """Within the block, fake tensors made from real ones carry their values and every traced op also runs on
    them (PyTorch's `fake_tensor_propagate_real_tensors`, the mechanism of its draft export), and the trace keeps
    the ops that read a value (`aten._local_scalar_dense`) although their results only steered Python, so that
    `_value_guards` finds them.

    A parameter's values are copied too (`_parameters_copied`)."""
    import torch._functorch.config
    import torch.fx.node

    _parameters_copied()
    kept = torch.fx.node._side_effectful_functions
    added = _VALUE_READ not in kept
    kept.add(_VALUE_READ)
    try:
        with torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True):
            yield
    finally:
        if added:
            kept.discard(_VALUE_READ)


@functools.cache
def _parameters_copied() -> None:
    """PyTorch's converter, asked to copy a real tensor's data into its fake (only when real values propagate),
    copies a plain `torch.Tensor`'s only (`meta_utils._safe_copy` tests `type(src) is torch.Tensor`): a fake
    parameter's real values were uninitialised memory (verified on 2.13: the `real_tensor` of
    `from_tensor(nn.Linear(4, 2).weight)` held 6e-38 and 0). Installed once for the process, not per trace, so that
    traces in two threads cannot undo each other's: it changes nothing but what such a copy reads."""
    from torch._subclasses import meta_utils

    plain_copy = meta_utils._safe_copy

    def copy_with_parameters(dst: torch.Tensor, src: torch.Tensor | None) -> None:
        plain_copy(dst, src.detach() if type(src) is torch.nn.Parameter else src)

    meta_utils._safe_copy = copy_with_parameters


def _plain_inputs(graph: torch.fx.GraphModule) -> dict[str, int]:
    """The position among the user inputs of each placeholder of a descriptor-annotated joint graph that is one."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput

    return {
        node.name: node.meta["desc"].idx
        for node in graph.graph.nodes
        if node.op == "placeholder" and isinstance(node.meta.get("desc"), PlainAOTInput)
    }


def _value_guards(graph: torch.fx.GraphModule, shape_env: Any, user_inputs: dict[str, int]) -> ValueGuards | None:
    """The `ValueGuards` of a graph traced with real values, which are cut out of `graph` (edited in place);
    `user_inputs`: the position among the user inputs of each placeholder that is one.

    Rule: a condition the ShapeEnv took from a real value is kept when every symbol it names is bound by a node of
    the final graph (AOTAutograd runs the forward once more to collect metadata; that run's symbols are bound
    nowhere, and its conditions repeat the final run's). The program is those nodes and everything they read; it
    may read the user inputs only (a check is no condition: `asserting_shape_env` assumes it passes). Raises
    ValueBranchError when it reads a parameter or buffer or a condition cannot be computed from the graph,
    RandomBranchError when it reads a random draw (LayerDrop at a probability `random_branches_decided` cannot
    decide). None when the trace took no branch on a value."""
    recorded = [
        ra.expr
        for assertions in shape_env.deferred_runtime_asserts.values()
        for ra in assertions
        if ra.msg.startswith(_REAL_VALUE_MESSAGE)
    ]
    binders = {
        symbol: (node, path)
        for node in graph.graph.nodes
        for symbol, path in (node.meta.get("unbacked_bindings") or {}).items()
    }
    conditions = tuple(dict.fromkeys(c for c in recorded if c.free_symbols <= binders.keys()))
    if recorded and not conditions:
        listed = ", ".join(map(str, recorded))
        raise ValueBranchError(f"the branches on values ({listed}) read no value the graph computes")
    if not conditions:
        _erase_unread(graph)
        return None
    symbols = sorted({s for c in conditions for s in c.free_symbols}, key=str)
    needed: set[torch.fx.Node] = set()
    stack = [binders[s][0] for s in symbols]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    program, inputs = torch.fx.Graph(), []
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            if node.name not in user_inputs:
                state = str(getattr(node.meta.get("desc"), "target", node.name))
                raise ValueBranchError(f"a branch on a value reads {state}, not only the batch", state)
            inputs.append(user_inputs[node.name])
        elif node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            raise RandomBranchError(_compared_draw(node, needed))
        copies[node] = program.node_copy(node, lambda n: copies[n])
    program.output(tuple(copies[binders[s][0]] for s in symbols))
    runnable = torch.fx.GraphModule(graph, program)  # with the constants it reads (`get_attr`), copied from `graph`
    _erase_unread(graph)
    bindings = tuple((s, binders[s][1]) for s in symbols)
    return ValueGuards(runnable, tuple(inputs), bindings, conditions)


def _compared_draw(draw: torch.fx.Node, nodes: set[torch.fx.Node]) -> str:
    """How a branch compares a random `draw` (a node of the graph), for `RandomBranchError`: `torch.rand(...) <
    0.1` where one of `nodes` compares it with a number, else the draw's op."""
    aten = torch.ops.aten
    ops = {aten.lt.Scalar: "<", aten.le.Scalar: "<=", aten.gt.Scalar: ">", aten.ge.Scalar: ">="}
    for user in draw.users:
        if user in nodes and user.target in ops and user.args[0] is draw and _is_number(user.args[1]):
            return f"torch.rand(...) {ops[user.target]} {user.args[1]!r}"
    return f"a draw of {draw.target}"


def _erase_unread(graph: torch.fx.GraphModule) -> None:
    """Erase the value reads (`_VALUE_READ`) nothing reads (a value read only to steer Python), then what only
    they read."""
    for node in list(graph.graph.nodes):
        if node.op == "call_function" and node.target is _VALUE_READ and not node.users:
            graph.graph.erase_node(node)
    graph.graph.eliminate_dead_code()


def _still_symbolic(shape_env: Any, size: Any) -> bool:
    """Whether a traced size is still a symbol (a guard may have pinned it to a number: specialised)."""
    return isinstance(size, torch.SymInt) and not shape_env.replace(size.node.expr).is_number


def _descriptor_signature(graph: torch.fx.GraphModule, requiring_grad: list[list[str]]) -> JointSignature:
    """Rewrite a descriptor-annotated joint graph to `aot_export_joint`'s form, in place, and describe it.
    `requiring_grad`: the names of each parameter that requires grad; a tied parameter has several, one
    placeholder each, and has a gradient when the forward reads it under any of them (the others get None)."""
    from torch._functorch._aot_autograd import descriptors as d

    fx = graph.graph
    inputs: list[tuple[str, str]] = []
    plain: dict[int, str] = {}  # a user input's position -> its placeholder's name
    for node in [n for n in fx.nodes if n.op == "placeholder"]:
        desc = node.meta.get("desc")
        if isinstance(desc, d.TangentAOTInput):  # the loss's incoming gradient: d loss / d loss = 1
            value = node.meta["val"]
            options = {"dtype": value.dtype, "device": value.device}
            with fx.inserting_before(node):
                one = fx.call_function(torch.ops.aten.full.default, ([], 1.0), options)
            one.meta["val"] = value  # the translator reads each node's shape and dtype from its value
            node.replace_all_uses_with(one)
            fx.erase_node(node)
        elif isinstance(desc, d.ParamAOTInput):
            inputs.append(("parameter", desc.target))
        elif isinstance(desc, d.BufferAOTInput):
            inputs.append(("buffer", desc.target))
        elif isinstance(desc, d.PlainAOTInput):
            inputs.append(("user", node.name))
            plain[desc.idx] = node.name
        else:
            raise NotImplementedError(f"dynamic-shape trace: unsupported graph input {desc}")
    kept, outputs = [], []
    out = fx.output_node()
    for value, desc in zip(out.args[0], out.meta["desc"], strict=True):  # type: ignore[arg-type]
        if value is None:
            continue  # the gradients of the (detached) data inputs
        if isinstance(desc, d.PlainAOTOutput):
            outputs.append(("user", value.name))
        elif isinstance(desc, d.GradAOTOutput) and isinstance(desc.grad_of, d.ParamAOTInput):
            outputs.append(("gradient", desc.grad_of.target))
        elif isinstance(desc, d.InputMutationAOTOutput) and isinstance(desc.mutated_input, d.BufferAOTInput):
            outputs.append(("mutation", desc.mutated_input.target))
        elif isinstance(desc, d.InputMutationAOTOutput) and isinstance(desc.mutated_input, d.PlainAOTInput):
            # a forward writing into its input in place (FSMT: `labels.masked_fill_(labels == -100, pad)`): the
            # graph computes with the new value; the input's new value is an output, as `aot_export_joint` gives it
            outputs.append(("mutation", plain[desc.mutated_input.idx]))
        else:
            raise NotImplementedError(f"dynamic-shape trace: unsupported graph output {desc}")
        kept.append(value)
    missing = [names[0] for names in requiring_grad if not any(("gradient", n) in outputs for n in names)]
    if missing:
        raise MissingGradientError(f"parameters {missing} did not receive a gradient")
    out.args = (tuple(kept),)
    fx._codegen = torch.fx.graph.CodeGen()  # flat placeholders instead of the (primals, tangents) pytree
    graph.recompile()
    return JointSignature(tuple(inputs), tuple(outputs))


def _joint_signature(graph: torch.fx.GraphModule, sig: Any) -> JointSignature:
    if sig.input_tokens or sig.output_tokens:
        raise NotImplementedError(
            "the traced graph threads effect tokens (side-effecting ops such as print or "
            "custom ops with effects); the torch gradient builder does not support them"
        )
    placeholders = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
    inputs = []
    for name in placeholders:
        if name in sig.inputs_to_parameters:
            inputs.append(("parameter", sig.inputs_to_parameters[name]))
        elif name in sig.inputs_to_buffers:
            inputs.append(("buffer", sig.inputs_to_buffers[name]))
        else:
            inputs.append(("user", name))
    # outputs are positional: (mutated inputs, user outputs, gradients of the parameters that require grad; none in
    # a forward-only trace)
    mutations = {**sig.buffers_to_mutate, **sig.user_inputs_to_mutate, **sig.parameters_to_mutate}
    gradients = sig.backward_signature.gradients_to_parameters if sig.backward_signature is not None else {}
    names = [n.name if isinstance(n, torch.fx.Node) else str(n) for n in output_values(graph.graph)]
    n_mut, n_user = len(mutations), len(sig.user_outputs)
    outputs = [("mutation", mutations[n]) for n in names[:n_mut]]
    outputs += [("user", n) for n in names[n_mut : n_mut + n_user]]
    outputs += [("gradient", gradients[n]) for n in names[n_mut + n_user :]]
    return JointSignature(tuple(inputs), tuple(outputs))


@contextlib.contextmanager
def storage_reads(named: dict[str, torch.Tensor]) -> Iterator[set[str]]:
    """Within the block, collect the names in `named` whose storage an aten op reads (through a view too).

    How: a TorchDispatchMode sees every aten op's tensor arguments, below autograd and inside TorchScript code."""
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    by_storage: dict[int, list[str]] = {}
    for name, tensor in named.items():
        key = _storage_key(tensor)
        if key:
            by_storage.setdefault(key, []).append(name)
    found: set[str] = set()

    class Reads(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # see `_Recorder`: entering the mode then imports no torch._dynamo

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for leaf in pytree.tree_leaves((args, kwargs or {})):
                if isinstance(leaf, torch.Tensor):
                    found.update(by_storage.get(_storage_key(leaf), ()))
            return func(*args, **(kwargs or {}))

    with Reads():
        yield found


def dataflow_digest(
    forward: Callable[[], torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    state: dict[str, torch.Tensor],
    parameters: Sequence[torch.Tensor] = (),
    salt: str = "",
    python_backward: bool = False,
) -> str:
    """A sha256 hex digest of the aten-level dataflow of `forward()` and of the backward from the tensor it returns
    to `parameters`: each op's name, and each argument as what it is — `inputs[i]` (with its shape and dtype), a
    `state` tensor by name (shape and dtype), the k-th output of an earlier op, a constant tensor by its dtype, shape
    and bytes, or a Python value by its `repr`. Two runs have the same digest when they run the same ops in the same
    order on the same kinds of values wired the same way, whatever the values of inputs and state.

    The backward is digested without running it when no Python code can run in it: then each of its ops is the
    fixed derivative (for this torch version) of a forward op, and its autograd graph — every node's name, its
    edges, the state each gradient accumulates into — says which derivatives run on what (it also sees what the
    forward's op list cannot: an op run under `no_grad`, a `detach`ed branch). Python can run in the backward
    through a custom autograd.Function (module backward hooks and reentrant checkpoints are ones), a tensor hook
    on a tensor the forward uses or keeps (`Tensor.register_hook`), saved-tensor hooks active in the forward
    (non-reentrant checkpoints, `save_on_cpu`), or hooks outside the graph that the caller knows of
    (`python_backward`: module and parameter hooks, `backward_hooks_outside`); then the backward runs, recorded
    like the forward: the costlier way, as the backward is about two thirds of a training step's work.
    Not seen: a hook put on a node directly (`grad_fn.register_hook`) inside the forward, or on a tensor after its
    last use by an op that no one keeps.

    The forward runs with the tensors autograd saves for the backward dropped (`saved_tensors_dropped`: the graph
    is walked, never run), unless the backward will run: then, or when that is found only after the forward (a
    custom Function, a tensor hook), the forward runs again keeping them.

    How: a TorchDispatchMode sees every aten op below autograd; tensors are recognised by identity (weakly held,
    so an id is never confused with a freed tensor's). Its `_should_skip_dynamo` is False: PyTorch otherwise wraps
    the handler to disable torch.compile, which imports torch._dynamo when the mode is first entered (1-5 s and
    ~40 MB, measured on torch 2.13; nothing here compiles)."""
    keep_saved = python_backward or _saved_tensor_hooks_active()
    if not keep_saved:
        try:
            with saved_tensors_dropped():
                digest = _dataflow_digest(forward, inputs, state, parameters, salt, python_backward, False)
            if digest is not None:
                return digest
        except Exception:  # e.g. the forward runs a backward of its own (SavedTensorDroppedError, maybe wrapped)
            pass  # a forward that fails for another reason fails again below, with its saved tensors
    digest = _dataflow_digest(forward, inputs, state, parameters, salt, python_backward, True)
    assert digest is not None
    return digest


def _dataflow_digest(
    forward: Callable[[], torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    state: dict[str, torch.Tensor],
    parameters: Sequence[torch.Tensor],
    salt: str,
    python_backward: bool,
    backward_can_run: bool,
) -> str | None:
    """`dataflow_digest`, or None when the backward has to run and `backward_can_run` is False (its saved
    tensors were dropped)."""
    import hashlib
    import weakref

    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    digest = hashlib.sha256(salt.encode())
    names: dict[int, tuple[Any, str]] = {}

    def remember(tensor: torch.Tensor, name: str) -> None:
        key = id(tensor)

        def forget(_: Any) -> None:
            names.pop(key, None)

        names[key] = (weakref.ref(tensor, forget), name)

    def describe(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            known = names.get(id(value))
            if known is not None and known[0]() is value:
                return known[1]
            return f"const:{_tensor_digest(value)}"
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(describe(v) for v in value) + "]"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}={describe(v)}" for k, v in sorted(value.items())) + "}"
        return repr(value)

    for i, tensor in enumerate(inputs):
        remember(tensor, f"input{i}:{tuple(tensor.shape)}:{tensor.dtype}")
    for name, tensor in state.items():
        if id(tensor) not in names:  # a tied tensor keeps its first name
            remember(tensor, f"state:{name}:{tuple(tensor.shape)}:{tensor.dtype}")
    count = [0]
    hooked = [python_backward]

    class _Recorder(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            line = f"{func}({describe(args)};{describe(kwargs)})"
            if not hooked[0]:
                hooked[0] = _saved_tensor_hooks_active() or any(
                    _has_tensor_hooks(leaf) for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)
                )
            result = func(*args, **kwargs)
            count[0] += 1
            for j, leaf in enumerate(pytree.tree_leaves(result)):
                if isinstance(leaf, torch.Tensor):
                    remember(leaf, f"v{count[0]}.{j}")
            digest.update(line.encode())
            digest.update(b"\n")
            return result

    with _Recorder():
        loss = forward()
    if loss is None or loss.grad_fn is None or not parameters:
        return digest.hexdigest()
    kept = (reference() for reference, _ in list(names.values()))
    hooked[0] = hooked[0] or any(t is not None and _has_tensor_hooks(t) for t in kept) or _has_tensor_hooks(loss)
    graph, python_nodes = _autograd_graph(loss.grad_fn, describe)
    if hooked[0] or python_nodes:
        if not backward_can_run:
            return None
        with _Recorder():
            torch.autograd.grad(loss, list(parameters), allow_unused=True)
    else:
        for line in graph:
            digest.update(line.encode())
            digest.update(b"\n")
    return digest.hexdigest()


def _autograd_graph(root: Any, describe: Callable[[Any], str]) -> tuple[list[str], bool]:
    """One line per node of the autograd graph behind `root`, breadth first in `next_functions` order: its name,
    its edges (the index of the node each leads to and the input it feeds) and, for a gradient accumulator, the
    tensor it accumulates into; and whether a node is a custom autograd.Function (Python code in the backward)."""
    order, index, lines = [root], {id(root): 0}, []
    python = False
    for node in order:  # grows while it is walked
        edges = []
        for following, input_nr in node.next_functions:
            if following is None:
                edges.append("-")
                continue
            if id(following) not in index:
                index[id(following)] = len(order)
                order.append(following)
            edges.append(f"{index[id(following)]}:{input_nr}")
        python = python or getattr(node, "_forward_cls", None) is not None  # only Python-defined Functions have one
        variable = getattr(node, "variable", None)  # AccumulateGrad's leaf
        target = "" if variable is None else f"->{describe(variable)}"
        lines.append(f"{node.name()}[{','.join(edges)}]{target}")
    return lines, python


def _has_tensor_hooks(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, "_backward_hooks", None))


def parameter_hooks(module: torch.nn.Module) -> dict[tuple[str, ...], list[Callable]]:
    """The gradient hooks registered on `module`'s parameters (`p.register_hook`), in registration order, keyed
    by every name the parameter has (tied parameters: one entry)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
        tensors[id(parameter)] = parameter
    return {
        tuple(names[key]): list(tensor._backward_hooks.values())  # type: ignore[union-attr]
        for key, tensor in tensors.items()
        if _has_tensor_hooks(tensor)
    }


@contextlib.contextmanager
def parameter_hooks_applied(module: torch.nn.Module, hooks: dict[tuple[str, ...], list[Callable]]) -> Iterator[None]:
    """Within the block, `module` reads each hooked parameter (`parameter_hooks`, taken from the module before a
    trace put placeholders in) through a view of it that carries its hooks, so that a backward traced from the
    block's forward passes the parameter's gradient through them, summed over its uses first, as PyTorch does.

    Why: a tracer lifts the parameters into placeholders of its own, and the hooks stay on the module's tensors,
    where no traced backward meets them."""
    if not hooks:
        yield
        return
    from torch.nn.utils.stateless import _reparametrize_module

    aliases: dict[str, torch.Tensor] = {}
    for names, functions in hooks.items():
        owner, _, attribute = names[0].rpartition(".")
        parameter = getattr(module.get_submodule(owner), attribute)  # a tracer's placeholder is no nn.Parameter
        alias = parameter.view_as(parameter)
        for function in functions:
            alias.register_hook(function)
        aliases.update(dict.fromkeys(names, alias))
    with _reparametrize_module(module, aliases):
        yield


def _saved_tensor_hooks_active() -> bool:
    """Saved-tensor hooks other than `saved_tensors_dropped`'s are in force."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and top[0] is not _drop_saved


class SavedTensorDroppedError(RuntimeError):
    """A backward needed a tensor that `saved_tensors_dropped` did not keep."""


def _drop_saved(tensor: torch.Tensor) -> None:
    return None


def _dropped_saved(_: None) -> torch.Tensor:
    raise SavedTensorDroppedError("a backward ran inside a forward whose saved tensors were dropped")


@contextlib.contextmanager
def saved_tensors_dropped() -> Iterator[None]:
    """Within the block, autograd keeps none of the tensors it saves for a backward (its graph is built, but a
    backward through it raises `SavedTensorDroppedError`); saved-tensor hooks already in force stay in charge.

    Why: a forward run only to read its ops, outputs or autograd graph (the compile cache's key, the build's dry
    run) otherwise holds every activation to its end, as a training step does: ~130 MB on the README's
    transformer, memory the allocator then keeps for the rest of the process."""
    if _saved_tensor_hooks_active():
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_drop_saved, _dropped_saved):
        yield


def backward_hooks_outside(module: torch.nn.Module) -> bool:
    """True when a backward through `module` can run Python hooks that its autograd graph does not show: hooks on
    its parameters or buffers, a module's `register_backward_hook` (the non-full form hooks the output's node), or
    a global module backward hook."""
    from torch.nn.modules import module as module_module

    if module_module._global_backward_hooks or module_module._global_backward_pre_hooks:
        return True
    if any(m._backward_hooks or m._backward_pre_hooks for m in module.modules()):
        return True
    tensors = [*module.parameters(), *module.buffers()]
    return any(_has_tensor_hooks(t) or getattr(t, "_post_accumulate_grad_hooks", None) for t in tensors)


def _tensor_digest(tensor: torch.Tensor) -> str:
    import hashlib

    value = tensor.detach()
    head = f"{value.dtype}:{tuple(value.shape)}:"
    try:
        data = value.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):  # tensors without plain storage (sparse, meta, nested)
        return head + repr(value)
    return head + hashlib.sha256(data).hexdigest()


def _storage_key(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, nested)
        return 0


def output_values(graph: torch.fx.Graph) -> list:
    """The values the graph's output node returns (an fx graph returns one tuple)."""
    values = graph.output_node().args[0]
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"the traced graph returns {type(values).__name__}, not a tuple")
    return list(values)


class MissingGradientError(AssertionError):
    """The dynamic-shape trace's form of AOTAutograd's "did not receive a gradient" assertion."""


def is_missing_gradient_error(err: BaseException) -> bool:
    """True for AOTAutograd's assertion that a parameter requiring grad got no gradient from the loss."""
    return isinstance(err, AssertionError) and "did not receive a gradient" in str(err)


def is_real_tensor_in_trace_error(err: BaseException) -> bool:
    """True for the fake-tensor tracer's refusal of a real tensor it was not given as an input (a tensor the
    forward reads from a global, a closure, or an attribute that is neither a parameter nor a buffer)."""
    return isinstance(err, AssertionError) and "Please convert all Tensors to FakeTensors" in str(err)


def autograd_function_of_frame(frame: Any) -> tuple[type, str] | None:
    """`(Function class, "forward" | "backward")` when `frame` runs a custom `torch.autograd.Function`'s forward
    or backward (its first argument is the Function's ctx), else None."""
    if frame.f_code.co_name not in ("forward", "backward") or frame.f_code.co_argcount == 0:
        return None
    ctx = frame.f_locals.get(frame.f_code.co_varnames[0])
    cls = getattr(type(ctx), "_forward_cls", None)  # the ctx of a Python Function is its backward node
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        return None
    if getattr(cls, frame.f_code.co_name, None) is None:
        return None
    return cls, frame.f_code.co_name


@contextlib.contextmanager
def reentrant_checkpoint_traceable() -> Iterator[None]:
    """Within the block, `torch.utils.checkpoint.checkpoint(..., use_reentrant=True)` runs PyTorch's
    non-reentrant implementation.

    Why: the reentrant implementation is an autograd.Function whose backward re-runs the forward and calls
    `torch.autograd.backward` itself, so the parameters inside the checkpoint get their gradients as a side effect
    on `.grad`, which a traced joint graph never sees ("did not receive a gradient", verified on 2.13). Both
    implementations compute the same values and gradients; recomputation only saves memory. PyTorch's rule for
    the reentrant form is kept: when grad mode is off or no tensor argument requires grad, its output requires no
    grad (the parameters inside get none), so the function then runs under no_grad."""
    from torch.utils import checkpoint as checkpoint_module

    cls = checkpoint_module.CheckpointFunction  # what checkpoint(use_reentrant=True) applies
    own = cls.__dict__.get("apply")

    def apply(function, preserve_rng_state, *args):
        if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            with torch.no_grad():
                return function(*args)
        return checkpoint_module.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)

    cls.apply = staticmethod(apply)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is not None:
            cls.apply = own  # type: ignore[method-assign]
        else:
            del cls.apply
