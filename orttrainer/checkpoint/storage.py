"""Checkpoint storage: nested dicts <-> HDF5 files, in the legacy ``_checkpoint_storage`` layout.

Layout (docs/legacy_api.md §9.2): every Mapping becomes an HDF5 group, every other value a dataset; a key with
``/`` creates nested groups. Loading turns groups back into dicts and datasets into ``dataset[()]``, so types come
back as numpy types: int -> ``numpy.int64``, float -> ``numpy.float64``, bool -> ``numpy.bool_``, a list of
numbers or a tensor -> ``numpy.ndarray`` (dtype and shape kept), ``str`` -> ``bytes``, ``{}`` -> ``{}``.

Beyond legacy: a save is atomic and never overwrites (see ``_atomic``); file-like objects work for load as well as
save; a missing, truncated or non-HDF5 file gives an error that names it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
from collections.abc import Iterator, Mapping
from typing import IO, Any, TypeGuard

import h5py

from ._atomic import atomic_write

PathOrFile = str | os.PathLike | IO[bytes]

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_ZIP_SIGNATURE = b"PK\x03\x04"  # torch.save's format: what experimental_save_checkpoint writes


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """No file at the checkpoint path. Also a ValueError, which is what legacy raised for a missing file."""


# --- save ---------------------------------------------------------------------------------------------------------


def save(save_obj: Mapping[str, Any], path_or_file: PathOrFile) -> None:
    """Write ``save_obj`` (a nested Mapping) as an HDF5 checkpoint to a path or a writable binary file object.

    Rules: a non-Mapping raises ``ValueError("Object to be saved must be a dictionary")``. A path that exists raises
    ``FileExistsError`` naming it, and nothing is written (a missing directory: ``FileNotFoundError`` naming the
    path). The file appears only when complete: a value HDF5 cannot
    store (a set, None, ...) raises ``TypeError`` naming its key, and leaves no file at the path (an earlier file
    there stays intact). A file object receives the bytes only after the whole file was built in memory; it must be
    positioned at its start for ``load`` to read it back, and it is not closed.
    """
    if not isinstance(save_obj, Mapping):
        raise ValueError("Object to be saved must be a dictionary")
    if _is_file_object(path_or_file, "write"):
        _save_to_file_object(save_obj, path_or_file)
        return
    path = _fspath(path_or_file)
    atomic_write(path, lambda handle: _write_hdf5(save_obj, handle, path))


def _save_to_file_object(save_obj: Mapping[str, Any], file_object: IO[bytes]) -> None:
    buffer = io.BytesIO()
    _write_hdf5(save_obj, buffer, _describe(file_object))
    file_object.write(buffer.getvalue())
    if hasattr(file_object, "flush"):
        file_object.flush()


def _write_hdf5(save_obj: Mapping[str, Any], target: IO[bytes], shown_as: str) -> None:
    with h5py.File(target, "w") as handle:
        _save_group(handle, save_obj, "", shown_as)


def _save_group(group: h5py.Group, save_obj: Mapping[str, Any], prefix: str, shown_as: str) -> None:
    """Depth first: a Mapping becomes a sub-group, anything else a dataset."""
    for key, value in save_obj.items():
        where = f"{prefix}{key}"
        if not isinstance(key, str):
            raise TypeError(f"Cannot save checkpoint {shown_as}: key {where!r} is a {type(key).__name__}, not a str")
        if isinstance(value, Mapping):
            _save_group(group.create_group(key), value, f"{where}/", shown_as)
            continue
        try:
            group[key] = _storable(value)
        except (TypeError, ValueError) as error:
            kind = TypeError if isinstance(error, TypeError) else ValueError
            raise kind(
                f"Cannot save checkpoint {shown_as}: value at {where!r} ({type(value).__name__}) "
                f"has no HDF5 representation: {error}"
            ) from error


def _storable(value: Any) -> Any:
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported; don't import it for nothing
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            raise TypeError("numpy and HDF5 have no bfloat16; convert the tensor to float32 first")
        return value.detach().cpu().numpy()
    return value


# --- load ---------------------------------------------------------------------------------------------------------


def load(path_or_file: PathOrFile, key: str | None = None) -> Any:
    """Read an HDF5 checkpoint (a path or a readable, seekable binary file object) into nested dicts.

    Rules: with ``key`` (``'/'``-separated, e.g. ``'trainer_options'`` or ``'dict1/str1'``) only that node is read:
    a group gives a dict, a dataset its value; an absent key raises ``KeyError`` naming the key and file. A missing
    file raises ``CheckpointNotFoundError`` (a ``FileNotFoundError`` and a ``ValueError``); a file that is not HDF5,
    is empty, truncated or corrupt raises ``ValueError``; every message names the file.
    """
    with open_checkpoint(path_or_file) as (handle, shown_as):
        try:
            node = _descend(handle, key, shown_as)
            return node[()] if isinstance(node, h5py.Dataset) else _load_group(node)
        except OSError as error:  # a damaged object inside a file whose header was fine
            raise _corrupt_error(shown_as, error) from error


def _descend(handle: h5py.File, key: str | None, shown_as: str) -> h5py.Group | h5py.Dataset:
    if not key:
        return handle
    try:
        return handle[key]
    except KeyError:
        raise KeyError(f"Key {key!r} not found in checkpoint {shown_as}") from None


def _load_group(group: h5py.Group) -> dict[str, Any]:
    return {key: _load_group(item) if isinstance(item, h5py.Group) else item[()] for key, item in group.items()}


@contextlib.contextmanager
def open_checkpoint(path_or_file: PathOrFile) -> Iterator[tuple[h5py.File, str]]:
    """Open a checkpoint for reading and yield ``(h5py.File, printable name)``; errors as described in ``load``."""
    if _is_file_object(path_or_file, "read"):
        shown_as = _describe(path_or_file)
        _check_file_object(path_or_file, shown_as)
        target: str | IO[bytes] = path_or_file
    else:
        shown_as = target = _fspath(path_or_file)
        _check_path(target)
    try:
        handle = h5py.File(target, "r")
    except OSError as error:
        raise _corrupt_error(shown_as, error) from error
    with handle:
        yield handle, shown_as


def _check_path(path: str) -> None:
    if not os.path.exists(path):
        raise CheckpointNotFoundError(2, "Checkpoint file not found", path)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory, not a checkpoint file")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty, not an HDF5 checkpoint file")
    if not h5py.is_hdf5(path):
        with open(path, "rb") as handle:
            raise _not_hdf5_error(path, handle.read(8))


def _check_file_object(file_object: IO[bytes], shown_as: str) -> None:
    # h5py addresses file objects from offset 0, as it does files; a signature elsewhere (a user block) is rare
    # enough that it is left to h5py to accept or reject.
    file_object.seek(0)
    head = file_object.read(8)
    file_object.seek(0)
    if not head:
        raise ValueError(f"{shown_as} is empty, not an HDF5 checkpoint file")
    if head != _HDF5_SIGNATURE:
        raise _not_hdf5_error(shown_as, head)


def _not_hdf5_error(shown_as: str, head: bytes) -> ValueError:
    hint = ""
    if head.startswith(_ZIP_SIGNATURE):
        hint = " (it looks like a torch.save file: load it with torch.load or checkpoint.experimental_load_checkpoint)"
    return ValueError(f"{shown_as} is not an HDF5 checkpoint file{hint}")


def _corrupt_error(shown_as: str, error: OSError) -> ValueError:
    return ValueError(f"{shown_as} is truncated or corrupt and cannot be read as a checkpoint: {error}")


# --- user_dict serialisation --------------------------------------------------------------------------------------


def to_serialized_hex(user_dict: Any) -> str:
    """``pickle.dumps(user_dict).hex()``: a str that HDF5 stores as is, so arbitrary Python types survive."""
    return pickle.dumps(user_dict).hex()


def from_serialized_hex(serialized_hex: str | bytes) -> Any:
    """Inverse of ``to_serialized_hex``; accepts the ``bytes`` that HDF5 gives back for a saved str.

    This unpickles: only load checkpoints you trust.
    """
    if isinstance(serialized_hex, bytes):
        serialized_hex = serialized_hex.decode()
    return pickle.loads(bytes.fromhex(serialized_hex))


# --- helpers ------------------------------------------------------------------------------------------------------


def _is_file_object(obj: Any, method: str) -> TypeGuard[IO[bytes]]:
    """Whether ``obj`` is used as a binary file object (it has ``method``, e.g. ``read``) rather than as a path."""
    return not isinstance(obj, (str, bytes, os.PathLike)) and callable(getattr(obj, method, None))


def _fspath(path: Any) -> str:
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        raise TypeError(
            f"Checkpoint location must be a path or a binary file object, not {type(path).__name__}"
        ) from None


def _describe(file_object: Any) -> str:
    name = getattr(file_object, "name", None)
    return name if isinstance(name, str) else f"<{type(file_object).__name__} file object>"
