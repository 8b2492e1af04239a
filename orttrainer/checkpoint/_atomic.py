"""All-or-nothing file writes: a checkpoint file is either complete or absent, never half written.

The data goes to a temporary file in the target's directory (same filesystem, so publishing it is a rename, not a
copy), is flushed and fsynced, and only then appears under the target name. Any error on the way removes the
temporary file and leaves whatever was at the target untouched.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable


def target_exists_error(path: str) -> FileExistsError:
    """The error for "a file is already there": names the path and says nothing was written."""
    return FileExistsError(17, "Checkpoint file already exists; refusing to overwrite it", path)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], *, overwrite: bool = False) -> None:
    """Run ``write(tmp_path)`` and publish ``tmp_path`` as ``path`` once it is complete and on disk.

    Rule: without ``overwrite`` an existing ``path`` raises ``FileExistsError`` before anything is written, and the
    final publish cannot clobber a file that appeared meanwhile (a hard link fails if the name exists). With
    ``overwrite`` the file is replaced atomically (``os.replace``). ``write`` must create the file it is given.
    """
    path = os.fspath(path)
    if not overwrite and os.path.lexists(path):
        raise target_exists_error(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(2, "Directory for the checkpoint file does not exist", path)
    tmp = _temporary_name(path)
    try:
        write(tmp)
        _fsync_file(tmp)
        _publish(tmp, path, overwrite)
    except BaseException:
        _remove_quietly(tmp)
        raise
    _fsync_directory(directory)


def _temporary_name(path: str) -> str:
    # Hidden, random and in the same directory: never collides with a real checkpoint name or another writer.
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.{secrets.token_hex(8)}.tmp")


def _fsync_file(path: str) -> None:
    # Opened for update because Windows refuses fsync on a read-only descriptor.
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _publish(tmp: str, path: str, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        # link() is the atomic "create only if absent": it fails when the name exists, so a file written by someone
        # else between our check and now survives.
        os.link(tmp, path)
    except FileExistsError:
        raise target_exists_error(path) from None
    except OSError:
        # A filesystem without hard links: check once more and rename (a tiny window, as small as we can make it).
        if os.path.lexists(path):
            raise target_exists_error(path) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _fsync_directory(directory: str) -> None:
    # Makes the new directory entry durable; not possible on every platform, and the data itself is already synced.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
