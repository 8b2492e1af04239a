"""Unpickling that runs no code: plain data comes back, anything else is refused by name.

For the pickles of checkpoints: the original's ``user_dict`` hex strings (docs/legacy_api.md §3.12, §9.2), the
values of a ``user_dict`` that are not plain data, and (through torch) the ``torch.save`` files of §9.3.

A pickle is a program: each global it names is imported and called. ``loads`` resolves only the globals that plain
data needs (``ALLOWED``) and refuses every other one, naming it and where in the value it sits; ``pickle.loads``
is for files the caller trusts (``trusted=True`` in the checkpoint API).

Rules:
- Allowed: ``builtins`` ``complex``, ``bytearray``, ``set``, ``frozenset``; ``_codecs.encode`` (how protocol 2
  writes bytes); ``collections.OrderedDict``; numpy's array and scalar reconstruction (``_reconstruct``,
  ``scalar``, ``_frombuffer`` under ``numpy.core`` and ``numpy._core``, ``numpy.ndarray``, ``numpy.dtype``);
  torch's tensor rebuild (``torch._utils._rebuild_tensor_v2``, ``_rebuild_parameter``,
  ``torch.storage._load_from_bytes``), ``torch.Size`` and the ``torch.<dtype>`` objects. Protocol 0–2 names
  (``__builtin__``) are mapped as ``pickle`` maps them.
- ``_load_from_bytes`` is replaced by ``torch.load(weights_only=True)`` of the same bytes (torch's own runs
  ``torch.load(weights_only=False)``: a second, unrestricted pickle inside the first); the tensor rebuilds refuse
  backward hooks (hooks are code).
- ``BUILD`` (``__setstate__``) only on numpy arrays and dtypes (numpy validates the state) and an ``OrderedDict``'s
  attributes; nothing else gets its state set.
- A refused global is not called: it and whatever the pickle builds from it become inert placeholders, so that the
  whole value is read and every refused global reported with its path (``user_dict['cfg']``), then
  ``UnsafePickleError`` is raised. No code outside the allow-list runs, refused or not.
- ``torch_load``: the same rule for ``torch.save`` files, by ``torch.load(weights_only=True)`` with numpy's
  reconstruction added to torch's own allow-list.
"""

from __future__ import annotations

import collections
import importlib
import io
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

PLAIN_TYPES = (
    "numbers, strings, bytes, None, lists, tuples, dicts, sets, numpy arrays and scalars, torch tensors and dtypes"
)


_TORCH_REFUSAL = re.compile(r"Unsupported global: GLOBAL (\S+)|but got <class '([^']+)'>")


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """A pickle names a global outside the allow-list (or sets state where only plain data may)."""


class _Refused:
    """A refused global, and everything the pickle builds by calling it or setting its state: inert. Every pickle
    operation on it (construction, BUILD, SETITEM(S), APPEND(S), ADDITEMS) is accepted and ignored, so loading
    reaches the end of the stream and reports every refused global at once, and no code of the refused global runs."""

    global_name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Refused:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Ignored: the arguments are not kept."""

    def __setstate__(self, state: Any) -> None:
        """Ignored: BUILD on a refused object sets nothing."""

    def __setitem__(self, key: Any, value: Any) -> None:
        """Ignored: SETITEM(S) on a refused object stores nothing."""

    def append(self, item: Any) -> None:
        """Ignored: APPEND on a refused object stores nothing."""

    def extend(self, items: Any) -> None:
        """Ignored: APPENDS on a refused object stores nothing."""

    def add(self, item: Any) -> None:
        """Ignored: ADDITEMS on a refused object stores nothing."""


def _numpy(module: str, name: str) -> Callable[[], Any]:
    def resolve() -> Any:
        for prefix in ("numpy._core", "numpy.core"):  # numpy 2 moved numpy.core to numpy._core
            try:
                return getattr(importlib.import_module(f"{prefix}.{module}"), name)
            except (ImportError, AttributeError):
                continue
        raise UnsafePickleError(f"numpy has no {module}.{name} to rebuild this value with")

    return resolve


def _storage_from_bytes(data: bytes) -> Any:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; legacy pickles hold them all the same
        return torch.load(io.BytesIO(data), weights_only=True)


def _no_hooks(hooks: Any) -> collections.OrderedDict:
    if hooks:
        raise UnsafePickleError("a tensor with backward hooks is not plain data (hooks are code)")
    return collections.OrderedDict()


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, grad: Any, hooks: Any, meta: Any = None) -> Any:
    import torch

    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, grad, _no_hooks(hooks), meta)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> Any:
    import torch

    if not isinstance(data, torch.Tensor):
        raise UnsafePickleError(f"a torch.nn.Parameter needs a tensor, got {type(data).__name__}")
    return torch._utils._rebuild_parameter(data, requires_grad, _no_hooks(hooks))


def _torch_plain(module: str, name: str) -> Any:
    """``torch.Size`` or a ``torch.<dtype>``; None for any other name (read from the module's dict: no lazy
    imports run)."""
    if module != "torch":
        return None
    import torch

    value = vars(torch).get(name)
    return value if value is torch.Size or isinstance(value, torch.dtype) else None


_NUMPY = {
    (f"{prefix}.{module}", name): _numpy(module, name)
    for prefix in ("numpy.core", "numpy._core")
    for module, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer"))
}

# (module, name) as the pickle spells it -> what it resolves to (a function, so numpy and torch import lazily).
ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    ("builtins", "complex"): lambda: complex,
    ("builtins", "bytearray"): lambda: bytearray,
    ("builtins", "set"): lambda: set,
    ("builtins", "frozenset"): lambda: frozenset,
    ("_codecs", "encode"): lambda: importlib.import_module("_codecs").encode,
    ("collections", "OrderedDict"): lambda: collections.OrderedDict,
    **_NUMPY,
    ("numpy", "ndarray"): lambda: importlib.import_module("numpy").ndarray,
    ("numpy", "dtype"): lambda: importlib.import_module("numpy").dtype,
    ("torch._utils", "_rebuild_tensor_v2"): lambda: _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): lambda: _rebuild_parameter,
    ("torch.storage", "_load_from_bytes"): lambda: _storage_from_bytes,
}


# The pure-Python unpickler's stack and opcode handlers, which typeshed does not describe: reached untyped.
_BASE_BUILD: Callable[[Any], None] = vars(pickle._Unpickler)["load_build"]
_BASE_DISPATCH: dict[int, Callable[[Any], None]] = vars(pickle._Unpickler)["dispatch"]


def _restricted_build(unpickler: Any) -> None:
    """BUILD (``__setstate__``) on numpy arrays and dtypes (numpy validates), placeholders (inert) and an
    ``OrderedDict``'s attributes; any other instance keeps its state unset and is reported."""
    import numpy as np

    state, instance = unpickler.stack[-1], unpickler.stack[-2]
    attributes_only = isinstance(state, dict) and all(isinstance(key, str) for key in state)
    if isinstance(instance, (np.ndarray, np.dtype, _Refused)) or (
        type(instance) is collections.OrderedDict and attributes_only
    ):
        _BASE_BUILD(unpickler)
        return
    unpickler.refused_state.append(f"the state of a {type(instance).__module__}.{type(instance).__qualname__}")
    unpickler.stack.pop()


class _RestrictedUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its BUILD can be restricted) with the allow-list as its only globals."""

    dispatch = {**_BASE_DISPATCH, pickle.BUILD[0]: _restricted_build}

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.refused: list[str] = []  # globals, each also left as a placeholder in the value
        self.refused_state: list[str] = []  # BUILDs refused: they leave no placeholder

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocol 0-2 pickles name Python 2's module
            module = "builtins"
        resolve = ALLOWED.get((module, name))
        value = resolve() if resolve is not None else _torch_plain(module, name)
        if value is not None:
            return value
        self.refused.append(f"{module}.{name}")
        return type("Refused", (_Refused,), {"global_name": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("a persistent id (an external object reference) is not plain data")


def loads(data: bytes, *, where: str, path: str) -> Any:
    """Unpickle ``data`` with the allow-list; ``where`` (the file) and ``path`` (e.g. ``user_dict['cfg']``) name the
    value in errors. Raises ``UnsafePickleError`` for refused globals, ``ValueError`` for data that is no pickle."""
    value, refused = _load(data, where, path)
    if refused:
        raise UnsafePickleError(
            f"Refusing to load {where}: {'; '.join(refused)}. That is not plain data, and unpickling it could run "
            f"any code. Loaded by default: {PLAIN_TYPES}. If you trust this file, load it with trusted=True."
        )
    return value


def refused(data: bytes, path: str) -> list[str]:
    """What ``loads`` would refuse in ``data``, e.g. ``["user_dict['cfg'] needs mylib.Config"]`` (``[]``: it loads
    safely). Runs no code outside the allow-list, like ``loads``."""
    try:
        return _load(data, "", path)[1]
    except ValueError as error:
        return [str(error)]


def _load(data: bytes, where: str, path: str) -> tuple[Any, list[str]]:
    unpickler = _RestrictedUnpickler(data)
    try:
        value = unpickler.load()
    except UnsafePickleError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the bytes make an allowed constructor raise
        names = unpickler.refused + unpickler.refused_state
        if names:  # a placeholder reached an allowed function: report what was refused
            return None, [f"{path} needs {name}" for name in dict.fromkeys(names)]
        raise ValueError(f"{path} of {where} is not a readable pickle: {type(error).__name__}: {error}") from error
    found: list[tuple[str, str]] = []
    _find_placeholders(value, path, found, set())
    located = {name for _, name in found}
    unlocated = [name for name in unpickler.refused if name not in located]  # inside an allowed object
    entries = [*found, *((path, name) for name in unlocated + unpickler.refused_state)]
    return value, [f"{where_} needs {name}" for where_, name in dict.fromkeys(entries)]


def _find_placeholders(value: Any, path: str, found: list[tuple[str, str]], seen: set[int]) -> None:
    if isinstance(value, _Refused) or (isinstance(value, type) and issubclass(value, _Refused)):
        found.append((path, value.global_name))
        return
    if id(value) in seen:
        return
    if isinstance(value, dict):
        seen.add(id(value))
        for key, item in value.items():
            _find_placeholders(key, f"{path} (a key)", found, seen)
            _find_placeholders(item, f"{path}[{key!r}]", found, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        seen.add(id(value))
        for index, item in enumerate(value):
            _find_placeholders(item, f"{path}[{index}]" if isinstance(value, (list, tuple)) else path, found, seen)
    elif type(value).__module__ == "numpy" and getattr(getattr(value, "dtype", None), "kind", "") == "O":
        seen.add(id(value))
        for index, item in enumerate(getattr(value, "flat", ())):
            _find_placeholders(item, f"{path}.flat[{index}]", found, seen)


def torch_load(path: str, trusted: bool, api: str) -> Any:
    """``torch.load`` of a ``torch.save`` file onto the CPU: ``weights_only=True`` plus numpy arrays and scalars,
    unless ``trusted`` (then everything, ``weights_only=False``). A refusal raises ``UnsafePickleError`` naming the
    file, the global and ``api``, the function that takes ``trusted=True``."""
    import torch

    if trusted:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        match = _TORCH_REFUSAL.search(str(error))
        needs = f"it needs {match.group(1) or match.group(2)}" if match else "it holds something else"
        raise UnsafePickleError(
            f"Refusing to load {path}: {needs}, which is not plain data, and unpickling it could run any code. "
            f"Loaded by default: {PLAIN_TYPES}. If you trust this file, pass trusted=True to {api}."
        ) from None


def _numpy_globals() -> list[Any]:
    # What numpy arrays and scalars unpickle through, beyond torch's own weights_only list: the reconstruction
    # functions, the classes and every dtype class (a BUILD sets a dtype's state).
    import numpy as np

    dtype_classes = [getattr(np.dtypes, name) for name in np.dtypes.__all__]
    return [ALLOWED[("numpy._core.multiarray", name)]() for name in ("_reconstruct", "scalar")] + [
        np.ndarray,
        np.dtype,
        *dtype_classes,
    ]
