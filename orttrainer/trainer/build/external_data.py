"""The data of an ONNX model's external tensors, read by orttrainer itself and confined to the model's directory.

An ONNX tensor may keep its data in a file named by its `location` (with an `offset` and a `length`), relative to
the model's directory. `inline_external_data(model, directory)` reads every such tensor into the model (a copy;
the argument is left as it is), so that neither onnx, nor numpy, nor ONNX Runtime resolves a location afterwards.
Rules (docs/reliability.md §1.1):

- `location` is a relative path without `..` components or NUL characters;
- the file it names, with every symlink followed (`realpath`), lies inside the model's directory (also followed):
  a symlink in the model's folder that points outside it is refused, as is one in a subfolder;
- the file is a regular file, opened without following a symlink swapped in meanwhile (the path the opened
  descriptor has is checked once more);
- `offset` and `length` are non-negative integers; the tensor's declared size (model_checks.declared_bytes, which
  also refuses a count beyond int64) equals `length` when given and fits in the file after `offset`: nothing is
  allocated before that, and exactly the declared bytes are read.

Any violation raises `ExternalDataError` (a ValueError) naming the tensor, its location and the model.

Which directory: `load_model(path)` uses the model file's directory. A ModelProto handed to the trainer with its
external data not loaded (`onnx.load(path, load_external_data=False)`) has no path of its own, and onnx and ONNX
Runtime would resolve its locations against the working directory; the trainer does the same, with these rules.
A ModelProto from plain `onnx.load(path)` already holds the data, which onnx read by its own rules (onnx 1.17
refuses `..` and absolute locations, but follows symlinks): load models with `load_model` instead.
"""

from __future__ import annotations

import os
import stat

import onnx
from onnx import TensorProto

from .model_checks import InvalidModelError, check_model, declared_bytes, describe, tensors

__all__ = ["ExternalDataError", "inline_external_data", "load_model", "prepare_model"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted as the data file must not block the open


class ExternalDataError(InvalidModelError):
    """An external tensor's location or size breaks the rules of `external_data`; the message names it."""


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """`onnx.load(path)` with the external data read by this module's rules, relative to the file's directory,
    then checked (`model_checks.check_model`). Errors name `path`."""
    path = os.fspath(path)
    model = onnx.load(path, load_external_data=False)
    return prepare_model(model, os.path.dirname(os.path.abspath(path)), path)


def prepare_model(model: onnx.ModelProto, directory: str | None = None, source: str | None = None) -> onnx.ModelProto:
    """What the trainer does to an ONNX model from outside before anything else: `check_model`, then the external
    data read in (`inline_external_data`; `directory` defaults to the working directory). Returns `model` itself
    when it has no external data."""
    shown = source or describe(model)
    check_model(model, shown)
    return inline_external_data(model, os.getcwd() if directory is None else directory, shown)


def inline_external_data(model: onnx.ModelProto, directory: str, source: str | None = None) -> onnx.ModelProto:
    """A copy of `model` whose external tensors hold their data (rules: module docstring); `model` itself when it
    has none. `source` names the model in errors."""
    shown = source or describe(model)
    if not any(t.data_location == TensorProto.EXTERNAL for _, t in tensors(model)):
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    root = os.path.realpath(directory)
    for where, tensor in list(tensors(result)):
        if tensor.data_location == TensorProto.EXTERNAL:
            _read_into(tensor, where, root, shown)
    return result


def _read_into(tensor: TensorProto, where: str, root: str, source: str) -> None:
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    name = f"tensor {tensor.name!r} ({where}, external data {location!r})"
    path = _confined(location, root, name, source)
    offset, length = _number(info, "offset", name, source), _number(info, "length", name, source)
    size = declared_bytes(tensor, where, source)
    if length is not None and length != size:
        raise ExternalDataError(f"{source}: {name} declares {size} bytes but its length is {length}")
    fd = _open_inside(path, root, name, source)
    try:
        available = os.fstat(fd).st_size - (offset or 0)
        if available < size or (length is None and available != size):
            raise ExternalDataError(
                f"{source}: {name} declares {size} bytes but {path} holds {max(available, 0)} bytes after offset "
                f"{offset or 0}"
            )
        data = _read_exactly(fd, size, offset or 0)
    finally:
        os.close(fd)
    if len(data) != size:
        raise ExternalDataError(f"{source}: {name}: {path} changed while it was read")
    tensor.raw_data = data
    del tensor.external_data[:]
    tensor.data_location = TensorProto.DEFAULT


def _confined(location: str, root: str, name: str, source: str) -> str:
    """The real path `location` names, refused unless it lies inside `root` (already a real path)."""
    if not location or "\0" in location:
        raise ExternalDataError(f"{source}: {name} has no valid location")
    if os.path.isabs(location) or ".." in location.replace("\\", "/").split("/"):
        raise ExternalDataError(
            f"{source}: {name}: a location must be a relative path inside the model's directory {root}, without '..'"
        )
    real = os.path.realpath(os.path.join(root, location))
    if not _inside(real, root):
        raise ExternalDataError(
            f"{source}: {name} resolves to {real} (a symlink leads there), outside the model's directory {root}; "
            "external data must lie inside it"
        )
    return real


def _inside(path: str, root: str) -> bool:
    return path != root and os.path.commonpath([path, root]) == root


def _open_inside(path: str, root: str, name: str, source: str) -> int:
    """Open the regular file at the real path `path` for reading, without following a symlink put there since it
    was resolved; where /proc tells what was opened, that too must lie inside `root`."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | _O_NONBLOCK)
    except OSError as error:
        raise ExternalDataError(f"{source}: {name}: cannot open {path}: {error.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ExternalDataError(f"{source}: {name}: {path} is not a regular file")
        opened = _opened_path(fd)
        if opened is not None and not _inside(opened, root):
            raise ExternalDataError(f"{source}: {name}: {path} was replaced by {opened}, outside {root}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _opened_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _number(info: dict[str, str], key: str, name: str, source: str) -> int | None:
    if key not in info:
        return None
    text = info[key]
    if not text.isdigit():
        raise ExternalDataError(f"{source}: {name} has {key} {text!r}, not a non-negative integer")
    return int(text)


def _read_exactly(fd: int, size: int, offset: int) -> bytes:
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, min(size - done, 1 << 26), offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)
