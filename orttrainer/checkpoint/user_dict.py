"""The ``user_dict`` of a checkpoint file, stored without pickle where it is plain data, and loaded safely.

The original stored ``pickle.dumps(user_dict).hex()`` and unpickled it on load (docs/legacy_api.md §3.12, §9.2):
a crafted file ran code. Those files still load, through ``safe_pickle``.

On disk (``ORTTrainer.save_checkpoint``) ``user_dict`` is an HDF5 group::

    user_dict/format        "orttrainer.user_dict/1"
    user_dict/tree          JSON: the structure, with the values JSON has
    user_dict/arrays/<n>    numpy arrays, tensors' data, bytes, pickles (datasets with fletcher32 checksums)

JSON nodes: ``null``, ``true``/``false``, numbers (``NaN``/``Infinity`` as Python's ``json`` writes them), strings
and lists are themselves; every other value is an object with one tag key: ``{"tuple": [...]}``, ``{"dict":
[[key, value], ...]}`` and ``{"odict": [...], "attrs": {...}}`` (any plain key type, order kept),
``{"complex": [re, im]}``, ``{"bytes": n}``, ``{"ndarray": n}``, ``{"numpy": n}`` (a numpy scalar), ``{"tensor":
n, "dtype": "float32", "requires_grad": false, "parameter": false}`` (dtypes numpy lacks, e.g. bfloat16, are
stored as same-size integers), and ``{"pickle": n}``.

Rules:
- Plain values (exact types: ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``list``,
  ``tuple``, ``dict``, ``OrderedDict``, numpy arrays and scalars of bool/int/float/complex dtype, strided torch
  tensors and Parameters) round-trip exactly: type, dtype, shape, key types and order. Tensors come back on the CPU.
- Any other value is pickled on its own (a ``pickle`` node); the rest stays plain. Saving warns when such a value
  will need ``trusted=True`` to load, naming its key.
- Loading never unpickles without ``trusted=True`` except through ``safe_pickle`` (plain data only); a refused
  value raises ``safe_pickle.UnsafePickleError`` naming its key (``user_dict['cfg']``) and the global it needs.
- Legacy files (and files whose user_dict is a hex string, as the original ORTTrainer wrote) load through the same
  restricted unpickler, or ``pickle.loads`` with ``trusted=True``.
"""

from __future__ import annotations

import collections
import json
import pickle
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import safe_pickle

FORMAT = "orttrainer.user_dict/1"
FORMAT_KEY, TREE_KEY, ARRAYS_KEY = "format", "tree", "arrays"
_ARRAY_KINDS = "biufc"  # what HDF5 stores natively: bool, ints, floats, complex
_SAME_SIZE_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def encode_user_dict(user_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The group to save under ``user_dict``: ``{'format': FORMAT, 'tree': json, 'arrays': {str(n): array}}``."""
    encoder = _Encoder()
    try:
        tree = encoder.node(user_dict, "user_dict", set())
        text = json.dumps(tree, separators=(",", ":"))
    except (RecursionError, ValueError):  # nested too deep, or an int beyond JSON's digit limit: pickle it whole
        encoder = _Encoder()
        text = json.dumps(encoder.pickled(user_dict, "user_dict"))
    if encoder.needs_trust:
        warnings.warn(
            f"{'; '.join(encoder.needs_trust)}: not plain data, so saved pickled, and load_checkpoint will refuse it "
            f"unless called with trusted=True. Plain data ({safe_pickle.PLAIN_TYPES}) needs no trust.",
            stacklevel=3,  # the caller of save_checkpoint
        )
    return {FORMAT_KEY: FORMAT, TREE_KEY: text, ARRAYS_KEY: encoder.arrays}


def decode_user_dict(stored: Any, *, trusted: bool = False, shown_as: str = "the checkpoint") -> Any:
    """The user dict from what ``storage.load`` read under ``user_dict``: this format's group, or a legacy hex
    string of a pickle. Without ``trusted``, pickled parts are loaded by ``safe_pickle`` (plain data only)."""
    if isinstance(stored, Mapping):
        return _Decoder(stored, trusted, shown_as).decode()
    if isinstance(stored, (bytes, str, np.bytes_, np.str_)):
        text = stored.decode() if isinstance(stored, bytes) else str(stored)
        try:
            data = bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"user_dict of {shown_as} is neither this format nor a hex-encoded pickle") from None
        return pickle.loads(data) if trusted else safe_pickle.loads(data, where=shown_as, path="user_dict")
    raise ValueError(f"user_dict of {shown_as} is a {type(stored).__name__}, neither a group nor a hex string")


class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.needs_trust: list[str] = []  # what loading will refuse without trusted=True, e.g. "user_dict['cfg'] ..."

    def array(self, value: np.ndarray) -> int:
        self.arrays[str(len(self.arrays))] = value
        return len(self.arrays) - 1

    def node(self, value: Any, path: str, active: set[int]) -> Any:
        kind = type(value)
        if value is None or kind in (bool, int, float, str):
            return value
        if kind is complex:
            return {"complex": [value.real, value.imag]}
        if kind is bytes:
            return {"bytes": self.array(np.frombuffer(value, dtype=np.uint8))}
        if kind in (list, tuple, dict, collections.OrderedDict):
            if id(value) in active:  # a cycle: pickle keeps it
                return self.pickled(value, path)
            return self.container(value, path, active | {id(value)})
        if kind is np.ndarray and value.dtype.kind in _ARRAY_KINDS:
            return {"ndarray": self.array(value)}
        if isinstance(value, np.generic) and value.dtype.kind in _ARRAY_KINDS:
            return {"numpy": self.array(np.asarray(value))}
        tensor = self.tensor(value) if "torch" in sys.modules else None
        return tensor if tensor is not None else self.pickled(value, path)

    def container(self, value: Any, path: str, active: set[int]) -> Any:
        if isinstance(value, list):
            return [self.node(item, f"{path}[{index}]", active) for index, item in enumerate(value)]
        if isinstance(value, tuple):
            return {"tuple": [self.node(item, f"{path}[{index}]", active) for index, item in enumerate(value)]}
        items = [
            [self.node(k, f"{path} key {k!r}", active), self.node(v, f"{path}[{k!r}]", active)]
            for k, v in value.items()
        ]
        if type(value) is dict:
            return {"dict": items}
        attributes = vars(value)  # e.g. the _metadata of a module's state_dict
        return {"odict": items, "attrs": self.node(dict(attributes), f"{path} attributes", active)}

    def tensor(self, value: Any) -> dict[str, Any] | None:
        torch = sys.modules["torch"]
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.layout != torch.strided:
            return None
        try:
            if value.is_quantized or value.is_nested:
                return None
            data = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
            try:
                array = data.numpy()
            except TypeError:  # bfloat16, float8, ...: numpy has no such dtype; the same bits as integers
                array = data.view(getattr(torch, _SAME_SIZE_INTS[data.element_size()])).numpy()
        except (RuntimeError, KeyError):  # meta tensors and the like: pickle decides
            return None
        dtype = str(value.dtype).removeprefix("torch.")
        parameter = isinstance(value, torch.nn.Parameter)
        return {
            "tensor": self.array(array),
            "dtype": dtype,
            "requires_grad": value.requires_grad,
            "parameter": parameter,
        }

    def pickled(self, value: Any, path: str) -> dict[str, int]:
        try:
            data = pickle.dumps(value)
        except Exception as error:  # noqa: BLE001 - pickle raises whatever the object's __reduce__ raises
            raise TypeError(
                f"Cannot save {path}: a {type(value).__name__} is neither plain data ({safe_pickle.PLAIN_TYPES}) "
                f"nor picklable ({type(error).__name__}: {error}); store what it holds instead"
            ) from error
        self.needs_trust += safe_pickle.refused(data, path)  # the load's own check, run now: no code runs either
        return {"pickle": self.array(np.frombuffer(data, dtype=np.uint8))}


class _Decoder:
    """Rebuilds the value from the JSON tree and the arrays; the file may be crafted, so every node is checked and
    only plain values are constructed (pickles: see ``decode_user_dict``)."""

    def __init__(self, stored: Mapping[str, Any], trusted: bool, shown_as: str) -> None:
        self.stored, self.trusted, self.shown_as = stored, trusted, shown_as
        self.arrays = stored.get(ARRAYS_KEY, {})

    def decode(self) -> Any:
        found = _text(self.stored.get(FORMAT_KEY, b""))
        if found != FORMAT:
            raise ValueError(
                f"user_dict of {self.shown_as} is in format {found!r}, which this version of orttrainer does not "
                f"read (it reads {FORMAT!r}); load it with the orttrainer version that saved it"
            )
        try:
            tree = json.loads(_text(self.stored.get(TREE_KEY, b"")))
        except ValueError as error:
            raise self.malformed("user_dict", f"its JSON tree does not parse ({error})") from None
        return self.node(tree, "user_dict")

    def malformed(self, path: str, detail: str) -> ValueError:
        return ValueError(f"user_dict of {self.shown_as} is malformed at {path}: {detail}")

    def node(self, node: Any, path: str) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.node(item, f"{path}[{index}]") for index, item in enumerate(node)]
        tag = next(iter(node), None) if isinstance(node, dict) else None
        handler = _HANDLERS.get(tag) if isinstance(tag, str) else None
        if handler is None:
            raise self.malformed(path, f"unknown node {str(node)[:80]}")
        try:
            return handler(self, node, path)
        except safe_pickle.UnsafePickleError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as error:
            if isinstance(error, ValueError) and str(error).startswith("user_dict of"):
                raise  # already says where
            raise self.malformed(path, f"{type(error).__name__}: {error}") from None

    def array(self, index: Any, path: str) -> np.ndarray:
        if type(index) is not int or str(index) not in self.arrays:
            raise self.malformed(path, f"no array {index!r} in user_dict/{ARRAYS_KEY}")
        return np.asarray(self.arrays[str(index)])

    def pairs(self, node: Any, path: str) -> list[tuple[Any, Any]]:
        pairs = []
        for item in _items(node):
            key_node, value_node = item  # a pair, or the ValueError of a malformed node
            key = self.node(key_node, f"{path} (a key)")
            pairs.append((key, self.node(value_node, f"{path}[{key!r}]")))
        return pairs

    def tensor(self, node: dict[str, Any], path: str) -> Any:
        import torch

        dtype = vars(torch).get(str(node["dtype"]))
        if not isinstance(dtype, torch.dtype):
            raise self.malformed(path, f"{node['dtype']!r} is not a torch dtype")
        tensor = torch.from_numpy(self.array(node["tensor"], path).copy())
        if tensor.dtype != dtype:
            tensor = tensor.view(dtype)
        if node.get("parameter") is True:
            return torch.nn.Parameter(tensor, requires_grad=node.get("requires_grad") is True)
        return tensor.requires_grad_(node.get("requires_grad") is True)

    def pickled(self, node: dict[str, Any], path: str) -> Any:
        data = self.array(node["pickle"], path).tobytes()
        return pickle.loads(data) if self.trusted else safe_pickle.loads(data, where=self.shown_as, path=path)


def _odict(decoder: _Decoder, node: dict[str, Any], path: str) -> collections.OrderedDict:
    value = collections.OrderedDict(decoder.pairs(node["odict"], path))
    attributes = decoder.node(node.get("attrs", {"dict": []}), f"{path} attributes")
    if not isinstance(attributes, dict) or not all(isinstance(key, str) for key in attributes):
        raise decoder.malformed(path, "attributes must be a dict with str keys")
    vars(value).update(attributes)
    return value


def _bytes(decoder: _Decoder, node: dict[str, Any], path: str) -> bytes:
    return decoder.array(node["bytes"], path).astype(np.uint8, copy=False).tobytes()


def _ndarray(decoder: _Decoder, node: dict[str, Any], path: str) -> np.ndarray:
    array = decoder.array(node["ndarray"], path)
    if array.dtype.kind not in _ARRAY_KINDS:
        raise decoder.malformed(path, f"an array of dtype {array.dtype} is not stored here")
    return array


def _numpy_scalar(decoder: _Decoder, node: dict[str, Any], path: str) -> Any:
    return _ndarray(decoder, {"ndarray": node["numpy"]}, path)[()]


_HANDLERS = {
    "tuple": lambda decoder, node, path: tuple(decoder.node(_items(node["tuple"]), path)),
    "dict": lambda decoder, node, path: dict(decoder.pairs(node["dict"], path)),
    "odict": _odict,
    "complex": lambda decoder, node, path: complex(*(float(part) for part in _items(node["complex"]))),
    "bytes": _bytes,
    "ndarray": _ndarray,
    "numpy": _numpy_scalar,
    "tensor": _Decoder.tensor,
    "pickle": _Decoder.pickled,
}


def _items(value: Any) -> list:
    if not isinstance(value, list):
        raise TypeError(f"expected a JSON list, got {type(value).__name__}")
    return value


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
