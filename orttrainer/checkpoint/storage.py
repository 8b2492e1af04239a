"""Checkpoint storage: nested dicts <-> HDF5 files, in the legacy ``_checkpoint_storage`` layout.

Layout (docs/legacy_api.md §9.2): every Mapping becomes an HDF5 group, every other value a dataset; a key with
``/`` creates nested groups. Loading turns groups back into dicts and datasets into ``dataset[()]``, so types come
back as numpy types: int -> ``numpy.int64``, float -> ``numpy.float64``, bool -> ``numpy.bool_``, a list of
numbers or a tensor -> ``numpy.ndarray`` (dtype and shape kept), ``str`` -> ``bytes``, ``{}`` -> ``{}``.

Beyond legacy: a save is atomic, never overwrites and leaves nothing behind when the process dies (see ``_atomic``);
file-like objects work for load as well as save; a missing, truncated or non-HDF5 file gives an error that names it.

Checksums: every dataset is saved with one, and every load verifies it. Arrays (fixed-size elements, at least one
dimension) are chunked with HDF5's ``fletcher32`` filter, which HDF5 checks on every read (any HDF5 reader
does); scalars, strings and other values, which HDF5 cannot filter, carry a CRC-32 of their value in the
``orttrainer_crc32`` attribute. A mismatch raises ``CheckpointCorruptError`` naming the file and the dataset.
Files written before checksums (and by the original ORTTrainer) have neither and load as before, unverified.

Hostile and failing files (docs/reliability.md §4):
- Saving to a path never lets an exception cross HDF5: h5py's Python file-object driver crashes the interpreter
  (SIGSEGV) when a write raises inside it (EFBIG under ``RLIMIT_FSIZE``, ENOSPC on a full disk). The driver writes
  through ``_LatchedFile``, which keeps the first ``OSError`` and skips later writes; once h5py has let go of the
  file the save raises that ``OSError`` naming the checkpoint path, and no file appears (an earlier one is intact).
- Loading checks what each dataset declares before reading it: the declared size may not exceed the bytes the file
  stores for it (or, compressed, ``_MAX_COMPRESSION`` times those), its data must be inside the file (no HDF5
  external storage, no virtual dataset), every group member must be a hard link (no external or soft links) and no
  object may be reached twice (no link cycles). Each refusal raises ``CheckpointCorruptError`` naming the file and
  the dataset, before anything is allocated.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import sys
import zlib
from collections.abc import Iterator, Mapping
from typing import IO, Any, TypeGuard

import h5py
import numpy as np

from . import safe_pickle
from ._atomic import atomic_write, write_error

PathOrFile = str | os.PathLike | IO[bytes]

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_ZIP_SIGNATURE = b"PK\x03\x04"  # torch.save's format: what experimental_save_checkpoint writes


CHECKSUM_ATTRIBUTE = "orttrainer_crc32"
_FLETCHER32_KINDS = "biufcS"  # numpy kinds with fixed-size elements: bool, ints, floats, complex, bytes
# The most a compressed dataset may declare per stored byte: deflate's ceiling (a 258-byte match in about two
# bits). HDF5's other compressing filters on checkpoint data do not come close; none of orttrainer's files, nor
# the original's, is compressed.
_MAX_COMPRESSION = 1032
# Filters that store every byte (a checksum, a byte reordering): the stored size bounds the declared one.
_STORING_FILTERS = {h5py.h5z.FILTER_FLETCHER32, h5py.h5z.FILTER_SHUFFLE}


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """No file at the checkpoint path. Also a ValueError, which is what legacy raised for a missing file."""


class CheckpointCorruptError(ValueError):
    """A dataset's data no longer matches the checksum saved with it (or cannot be read at all)."""


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
    atomic_write(path, lambda handle: _write_hdf5_to_file(save_obj, handle, path))


def _save_to_file_object(save_obj: Mapping[str, Any], file_object: IO[bytes]) -> None:
    buffer = io.BytesIO()
    _write_hdf5(save_obj, buffer, _describe(file_object))
    file_object.write(buffer.getvalue())
    if hasattr(file_object, "flush"):
        file_object.flush()


def _write_hdf5(save_obj: Mapping[str, Any], target: IO[bytes] | _LatchedFile, shown_as: str) -> None:
    with h5py.File(target, "w") as handle:
        _save_group(handle, save_obj, "", shown_as)


def _write_hdf5_to_file(save_obj: Mapping[str, Any], handle: IO[bytes], path: str) -> None:
    """Write the HDF5 file into the open file ``handle`` through a ``_LatchedFile``; a failed write raises its
    ``OSError`` naming ``path`` only after h5py has closed the file (module docstring)."""
    latched = _LatchedFile(handle.fileno())
    try:
        _write_hdf5(save_obj, latched, path)
    except Exception as error:
        if latched.error is None:
            raise
        raise write_error(path, latched.error) from error
    if latched.error is not None:
        raise write_error(path, latched.error)


class _LatchedFile:
    """A file object over the descriptor ``fd`` whose methods never raise: the first ``OSError`` is kept in
    ``error``, writes after it are skipped (and reported as done), reads after it return zeros.

    h5py's file-object driver calls these methods from inside HDF5, where an exception crashes the interpreter
    (module docstring); the caller checks ``error`` once h5py is done. Positioned reads and writes
    (``os.pread``/``os.pwrite``) keep the descriptor's own offset out of it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._position = 0
        self.error: OSError | None = None

    def _keep(self, error: OSError) -> None:
        if self.error is None:
            self.error = error

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self._position
        elif whence == os.SEEK_END:
            offset += self._size()
        self._position = max(offset, 0)
        return self._position

    def tell(self) -> int:
        return self._position

    def _size(self) -> int:
        try:
            return os.fstat(self._fd).st_size
        except OSError as error:
            self._keep(error)
            return 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.error is None:
            written = 0
            try:
                while written < len(view):
                    written += os.pwrite(self._fd, view[written:], self._position + written)
            except OSError as error:
                self._keep(error)
        self._position += len(view)
        return len(view)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        if self.error is None:
            try:
                while done < len(view):
                    chunk = os.pread(self._fd, len(view) - done, self._position + done)
                    if not chunk:
                        break
                    view[done : done + len(chunk)] = chunk
                    done += len(chunk)
            except OSError as error:
                self._keep(error)
        view[done:] = bytes(len(view) - done)
        self._position += len(view)
        return len(view)

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(self._size() - self._position, 0)
        buffer = bytearray(size)
        self.readinto(buffer)
        return bytes(buffer)

    def truncate(self, size: int | None = None) -> int:
        size = self._position if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self._fd, size)
            except OSError as error:
                self._keep(error)
        return size

    def flush(self) -> None:
        """Nothing is buffered here."""

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        """The descriptor belongs to the caller (``atomic_write``), which closes it."""


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
            _write_dataset(group, key, _storable(value))
        except (TypeError, ValueError) as error:
            kind = TypeError if isinstance(error, TypeError) else ValueError
            raise kind(
                f"Cannot save checkpoint {shown_as}: value at {where!r} ({type(value).__name__}) "
                f"has no HDF5 representation: {error}"
            ) from error


def _write_dataset(group: h5py.Group, key: str, data: Any) -> None:
    """One dataset with its checksum: fletcher32 for arrays, the CRC-32 attribute for everything else."""
    array = _filterable_array(data)
    if array is not None:
        group.create_dataset(key, data=array, chunks=True, fletcher32=True)
        return
    dataset = group.create_dataset(key, data=data)
    # The CRC of the value as it reads back, so that saving and verifying hash exactly the same thing.
    dataset.attrs[CHECKSUM_ATTRIBUTE] = np.uint32(_checksum(dataset[()]))


def _filterable_array(data: Any) -> np.ndarray | None:
    """``data`` as an array HDF5 can chunk and checksum (fixed-size elements, >= 1 dimension), else None."""
    if isinstance(data, (list, tuple)):
        try:
            data = np.asarray(data)
        except (TypeError, ValueError):  # ragged: h5py reports it when the plain dataset is attempted
            return None
    if isinstance(data, np.ndarray) and data.ndim >= 1 and data.dtype.kind in _FLETCHER32_KINDS:
        return data
    return None


def _checksum(value: Any) -> int:
    if isinstance(value, bytes):
        return zlib.crc32(value)
    if isinstance(value, str):
        return zlib.crc32(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, np.ndarray) and value.dtype.kind == "O":  # variable-length strings
        return zlib.crc32(repr(value.tolist()).encode("utf-8", "surrogatepass"))
    return zlib.crc32(np.ascontiguousarray(value).tobytes())


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
            if isinstance(node, h5py.Dataset):
                return read_dataset(node, shown_as)
            return _load_group(node, shown_as, set())
        except OSError as error:  # a damaged object inside a file whose header was fine
            raise _corrupt_error(shown_as, error) from error


def _descend(handle: h5py.File, key: str | None, shown_as: str) -> h5py.Group | h5py.Dataset:
    node: h5py.Group | h5py.Dataset = handle
    for name in (key or "").split("/"):
        if not name:
            continue
        if not isinstance(node, h5py.Group) or name not in node:
            raise KeyError(f"Key {key!r} not found in checkpoint {shown_as}")
        node = _member(node, name, shown_as)
    return node


def check_links(handle: h5py.File, shown_as: str) -> None:
    """Walk the whole file as ``load`` does, reading no data: every member a hard link, no object reached twice
    (``CheckpointCorruptError`` naming the file and the link otherwise)."""
    seen: set[Any] = set()
    pending = [handle]
    while pending:
        group = pending.pop()
        _visit_once(group, shown_as, seen)
        for key in group:
            item = _member(group, key, shown_as)
            if isinstance(item, h5py.Group):
                pending.append(item)
            else:
                _visit_once(item, shown_as, seen)


def _load_group(group: h5py.Group, shown_as: str, seen: set[Any]) -> dict[str, Any]:
    _visit_once(group, shown_as, seen)
    loaded = {}
    for key in group:
        item = _member(group, key, shown_as)
        if isinstance(item, h5py.Group):
            loaded[key] = _load_group(item, shown_as, seen)
        else:
            _visit_once(item, shown_as, seen)
            loaded[key] = read_dataset(item, shown_as)
    return loaded


def _visit_once(node: h5py.Group | h5py.Dataset, shown_as: str, seen: set[Any]) -> None:
    """Every object is read once: a hard link back to a group would loop forever, and shared objects multiply
    what a small file makes the loader allocate. No checkpoint writer links an object twice."""
    info = h5py.h5o.get_info(node.id)
    identity = (info.fileno, info.addr)
    if identity in seen:
        raise CheckpointCorruptError(
            f"{shown_as} is not a checkpoint file: {node.name!r} is linked more than once (a cycle or a shared "
            "object), which no checkpoint writer makes"
        )
    seen.add(identity)


def _member(group: h5py.Group, name: str, shown_as: str) -> h5py.Group | h5py.Dataset:
    """``group[name]``, which must be a hard link to a group or a dataset: an external link would open another file
    and a soft link may point anywhere in this one (``CheckpointCorruptError`` naming the file and the link)."""
    link = group.get(name, getlink=True)
    where = f"{group.name.rstrip('/')}/{name}".lstrip("/")
    if not isinstance(link, h5py.HardLink):
        kind = "an external link to another file" if isinstance(link, h5py.ExternalLink) else "a soft link"
        raise CheckpointCorruptError(f"{shown_as} is not a checkpoint file: {where!r} is {kind}")
    item = group[name]
    if not isinstance(item, (h5py.Group, h5py.Dataset)):
        raise CheckpointCorruptError(f"{shown_as} is not a checkpoint file: {where!r} is a {type(item).__name__}")
    return item


def read_dataset(dataset: h5py.Dataset, shown_as: str) -> Any:
    """``dataset[()]``, verified against its checksum when it has one.

    Raises ``CheckpointCorruptError`` naming ``shown_as`` and the dataset when the data does not match (a
    fletcher32 failure surfaces as a read error) or cannot be read.
    """
    where = dataset.name.lstrip("/")
    check_declared_size(dataset, shown_as)
    try:
        value = dataset[()]
    except MemoryError:
        raise MemoryError(
            f"{shown_as}: dataset {where!r} ({_size_text(_declared_bytes(dataset))}) does not fit in memory"
        ) from None
    except OSError as error:
        mismatch = " (its data does not match its fletcher32 checksum)" if dataset.fletcher32 else ""
        raise _dataset_error(shown_as, where, f"cannot be read{mismatch}: {error}") from error
    expected = dataset.attrs.get(CHECKSUM_ATTRIBUTE)
    if expected is not None and _checksum(value) != int(expected):
        raise _dataset_error(shown_as, where, f"does not match the CRC-32 checksum saved with it ({int(expected)})")
    return value


def check_declared_size(dataset: h5py.Dataset, shown_as: str) -> None:
    """Refuse, before anything is read or allocated, a dataset whose data is not all in the file: declared larger
    than the bytes the file stores for it (``_MAX_COMPRESSION`` times those when compressed), kept in HDF5 external
    storage (raw files named by the checkpoint) or virtual (mapped from other files). ``CheckpointCorruptError``
    names the file and the dataset."""
    where = dataset.name.lstrip("/")
    plist = dataset.id.get_create_plist()
    if plist.get_external_count() > 0:
        raise _dataset_error(shown_as, where, "keeps its data in an external file, which a checkpoint never does")
    if dataset.is_virtual:
        raise _dataset_error(shown_as, where, "is a virtual dataset mapped from other files")
    declared = _declared_bytes(dataset)
    if declared == 0:
        return
    filters = {plist.get_filter(i)[0] for i in range(plist.get_nfilters())}
    ratio = 1 if filters <= _STORING_FILTERS else _MAX_COMPRESSION
    stored = dataset.id.get_storage_size()
    if declared > stored * ratio:
        count = math.prod(dataset.shape or ())
        raise _dataset_error(
            shown_as,
            where,
            f"declares {count} elements ({_size_text(declared)}) but the file stores {stored} bytes of its data",
        )


def _declared_bytes(dataset: h5py.Dataset) -> int:
    """The bytes the dataset's elements take in the file (0 for an empty one)."""
    if dataset.shape is None:  # HDF5's null dataspace: no elements
        return 0
    return math.prod(dataset.shape) * dataset.id.get_type().get_size()


def _size_text(size: int) -> str:
    if size < 1024:
        return f"{size} bytes"
    exponent = min((size.bit_length() - 1) // 10, 4)
    return f"{size / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


def _dataset_error(shown_as: str, where: str, detail: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{shown_as} is truncated or corrupt: dataset {where!r} {detail}. The file changed after it was saved; "
        "load another copy of the checkpoint"
    )


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
    """``pickle.dumps(user_dict).hex()``: a str that HDF5 stores as is (the original ORTTrainer's user_dict format;
    ``ORTTrainer.save_checkpoint`` now stores plain data without pickle, see ``checkpoint.user_dict``)."""
    return pickle.dumps(user_dict).hex()


def from_serialized_hex(serialized_hex: str | bytes, *, trusted: bool = False) -> Any:
    """Inverse of ``to_serialized_hex``; accepts the ``bytes`` that HDF5 gives back for a saved str.

    Rule: without ``trusted`` only plain data is unpickled (``safe_pickle``: numbers, strings, bytes, None, lists,
    tuples, dicts, sets, numpy arrays, torch tensors); anything else raises ``safe_pickle.UnsafePickleError``
    naming the key and the global it needs, and no code runs. ``trusted=True`` is ``pickle.loads``: only for data
    you trust, since unpickling can run any code.
    """
    if isinstance(serialized_hex, bytes):
        serialized_hex = serialized_hex.decode()
    data = bytes.fromhex(serialized_hex)
    return pickle.loads(data) if trusted else safe_pickle.loads(data, where="serialized user_dict", path="user_dict")


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
