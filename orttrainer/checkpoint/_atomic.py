"""All-or-nothing file writes: a checkpoint file is either complete or absent, and a crash leaves nothing behind.

Rules:
- The data goes into a file that has no name yet (Linux ``O_TMPFILE``, in the target's directory: same filesystem),
  is flushed and fsynced, and only then gets the target name (``linkat`` of ``/proc/self/fd/N``). A process killed
  at any point leaves no file at all: the kernel frees a file that never got a name.
- Where that is not possible (no ``O_TMPFILE``, no ``/proc``, a filesystem that refuses the link), the data goes to
  a hidden temporary ``.<name>.<host>-<pid>.<random>.tmp`` in the target's directory, which its writer holds
  ``flock``-ed while it exists. Every write first sweeps the directory of the temporaries of dead writers: those of
  this host whose pid no longer runs and whose lock is free. A live writer's temporary, or another host's, is never
  touched (another host's pids mean nothing here).
- Without ``overwrite`` an existing target raises ``FileExistsError`` before anything is written, and the final
  step is a hard link, which fails if the name appeared meanwhile: a file written by someone else survives. With
  ``overwrite`` the file is replaced atomically (``os.replace``). Any error leaves the target untouched.
- Nothing is ever written through a name someone else could have planted: the nameless file has no name, the named
  temporary is created with ``O_EXCL`` under a random name, and the target name is only ever the destination of a
  link or a rename, which replace a symlink there rather than follow it (docs/reliability.md §3).
- A write that fails (a full disk, ``RLIMIT_FSIZE``: ENOSPC, EFBIG), in the writer, the flush or the fsync, raises
  ``OSError`` with that errno naming the target path, whatever the writer made of the error on its way out
  (``torch.save`` turns it into a ``RuntimeError``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import re
import secrets
import shutil
import socket
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO, cast

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

_O_TMPFILE = getattr(os, "O_TMPFILE", 0)  # Linux only; 0 elsewhere: named temporaries
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # with O_EXCL a planted link already fails; this says so twice
# What O_TMPFILE fails with where the filesystem (or an old kernel) cannot make nameless files.
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL, errno.ENOENT}
# This host, as it appears in temporary names: pids are only comparable on the host that wrote them.
_HOST = f"{zlib.crc32(socket.gethostname().encode()) & 0xFFFFFFFF:08x}"
_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)\.[0-9a-f]{16}\.tmp$")

Writer = Callable[[BinaryIO], object]


def target_exists_error(path: str) -> FileExistsError:
    """The error for "a file is already there": names the path and says nothing was written."""
    return FileExistsError(17, "Checkpoint file already exists; refusing to overwrite it", path)


def write_error(path: str, error: OSError, what: str = "checkpoint file") -> OSError:
    """The error for "writing failed": ``error``'s errno and reason, naming ``path``; says nothing was saved."""
    code = error.errno if error.errno is not None else errno.EIO
    reason = error.strerror or str(error)
    return OSError(code, f"Cannot write the {what} ({reason}); nothing was saved at that path", path)


def atomic_write(
    path: str | os.PathLike, write: Writer, *, overwrite: bool = False, what: str = "checkpoint file"
) -> None:
    """Run ``write(handle)`` on a new binary file and publish it as ``path`` once it is complete and on disk.

    ``handle`` is readable, writable and seekable, positioned at 0; ``write`` must not close it. Rules: see the
    module docstring. A missing directory raises ``FileNotFoundError`` naming ``path``; ``what`` names the file
    in errors ("checkpoint file", "ONNX model file").
    """
    path = os.fspath(path)
    if not overwrite and os.path.lexists(path):
        raise target_exists_error(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(2, f"Directory for the {what} does not exist", path)
    sweep_stale_temporaries(directory)
    fd = _open_anonymous(directory, path, what)
    if fd is None:
        _write_named(path, write, overwrite, what)
    else:
        try:
            _write_and_sync(fd, write, path, what)
            if not _link_anonymous(fd, path, overwrite):
                _write_named(path, lambda handle: _copy_from(fd, handle), overwrite, what)
        finally:
            os.close(fd)
    _fsync_directory(directory)


def sweep_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporaries that writers of this host left in ``directory`` when they died; returns their paths.

    A temporary is stale when its name has this host's tag, its pid is not a running process and no one holds its
    lock. Anything else (other files, a live writer's temporary, another host's) is left alone.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        match = _TEMPORARY.match(name)
        if match is None or match["host"] != _HOST or _is_running(int(match["pid"])):
            continue
        path = os.path.join(directory, name)
        if _remove_if_unlocked(path):
            removed.append(path)
    return removed


# --- the nameless file --------------------------------------------------------------------------------------------


def _open_anonymous(directory: str, path: str, what: str) -> int | None:
    """A nameless file in ``directory``, or None where the filesystem cannot make one; other errors (no
    permission, read-only, full) name the target ``path``."""
    if not _O_TMPFILE or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(directory, _O_TMPFILE | os.O_RDWR | _O_CLOEXEC, 0o666)  # 0o666 less the umask, as open()
    except OSError as error:
        if error.errno in _UNSUPPORTED:
            return None
        raise type(error)(error.errno, f"Cannot create the {what}: {error.strerror}", path) from None


def _link_anonymous(fd: int, path: str, overwrite: bool) -> bool:
    """Give the nameless file ``fd`` the name ``path``; False when this filesystem refuses the link."""
    source = f"/proc/self/fd/{fd}"
    name = _temporary_name(path) if overwrite else path
    try:
        _link(source, name)
    except FileExistsError:
        raise target_exists_error(path) from None
    except OSError:
        return False
    if overwrite:
        try:
            os.replace(name, path)
        except BaseException:
            _remove_quietly(name)
            raise
    return True


def _link(source: str, path: str) -> None:
    # linkat(..., AT_SYMLINK_FOLLOW) is what links a /proc/self/fd entry; CPython only calls linkat (rather than
    # link, which would link the /proc symlink itself and fail) when a directory fd is given.
    directory, base = os.path.split(os.path.abspath(path))
    directory_fd = os.open(directory, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.link(source, base, dst_dir_fd=directory_fd, follow_symlinks=True)
    finally:
        os.close(directory_fd)


def _copy_from(fd: int, handle: BinaryIO) -> None:
    with open(fd, "rb", closefd=False) as source:
        source.seek(0)
        shutil.copyfileobj(source, handle, 1 << 20)


# --- the named temporary ------------------------------------------------------------------------------------------


def _write_named(path: str, write: Writer, overwrite: bool, what: str) -> None:
    temporary = _temporary_name(path)
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, 0o666)
    try:
        with contextlib.suppress(OSError):  # a filesystem without locks: the pid in the name still protects it
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _write_and_sync(fd, write, path, what)
        _publish(temporary, path, overwrite)
    except BaseException:
        _remove_quietly(temporary)
        raise
    finally:
        os.close(fd)


def _temporary_name(path: str) -> str:
    # Hidden, in the same directory, never a real checkpoint name; host and pid tell the sweep whose it is.
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.{_HOST}-{os.getpid()}.{secrets.token_hex(8)}.tmp")


def _publish(temporary: str, path: str, overwrite: bool) -> None:
    if overwrite:
        os.replace(temporary, path)
        return
    try:
        # link() is the atomic "create only if absent": it fails when the name exists.
        os.link(temporary, path)
    except FileExistsError:
        raise target_exists_error(path) from None
    except OSError:
        # A filesystem without hard links: check once more and rename (a tiny window, as small as we can make it).
        if os.path.lexists(path):
            raise target_exists_error(path) from None
        os.replace(temporary, path)
        return
    os.unlink(temporary)


def _is_running(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():  # this process: another thread may be writing it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: running, as another user
        return True
    return True


def _remove_if_unlocked(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
    except OSError:  # gone already, or a symlink: not ours to remove
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a writer (in another pid namespace, say) still holds it
        os.close(fd)
        return False
    except OSError:
        pass  # no locks on this filesystem: the dead pid decides
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)
    return True


# --- durability ---------------------------------------------------------------------------------------------------


class _WatchedFileIO(io.FileIO):
    """A raw file that remembers the first ``OSError`` its writes raised (and still raises it)."""

    error: OSError | None = None

    def write(self, data: ReadableBuffer, /) -> int:
        try:
            return super().write(data)
        except OSError as error:
            if self.error is None:
                self.error = error
            raise


def _write_and_sync(fd: int, write: Writer, path: str, what: str) -> None:
    """``write`` into ``fd``, flush and fsync; a failed write raises ``write_error`` naming ``path`` even where the
    writer turned it into another exception (``torch.save``: a ``RuntimeError``)."""
    raw = _WatchedFileIO(fd, "r+", closefd=False)
    handle = io.BufferedRandom(raw)
    try:
        write(cast(BinaryIO, handle))
        handle.flush()
    except Exception as error:
        if raw.error is None:
            raise
        raise write_error(path, raw.error, what) from error
    finally:
        with contextlib.suppress(OSError):  # after a failed write, closing flushes (and fails) once more
            handle.close()
    try:
        _fsync(fd)
    except OSError as error:
        raise write_error(path, error, what) from error


def _fsync(fd: int) -> None:
    os.fsync(fd)


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
