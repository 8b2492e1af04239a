"""Checkpoint reliability: a crash during a save leaves nothing behind (temporaries are nameless, or swept when a
dead writer left one). Fault tests run the writer in a subprocess and SIGKILL it mid-write, bounded in time."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from orttrainer.checkpoint import _atomic, storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The writer pauses (and says so) after the first dataset is in the file: it is killed mid-write.
_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from orttrainer.checkpoint import _atomic, storage

    target, mode = sys.argv[1], sys.argv[2]
    if mode == "named":
        _atomic._O_TMPFILE = 0  # as on a filesystem without O_TMPFILE
    real = storage._storable

    def slow(value):
        if isinstance(value, str) and value == "pause here":
            print("writing", flush=True)
            time.sleep(120)
        return real(value)

    storage._storable = slow
    if sys.argv[3] == "storage":
        storage.save({"model": {"w": np.ones(1_000_000)}, "z": "pause here"}, target)
    else:  # an overwriting save, as experimental_save_checkpoint does
        def write(handle):
            handle.write(b"new contents " * 100_000)
            slow("pause here")
        _atomic.atomic_write(target, write, overwrite=True)
    """
)


def _kill_mid_write(target, mode: str, how: str = "storage") -> int:
    """Start a save of ``target`` in a subprocess, SIGKILL it once it is writing; returns its (reaped) pid."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(target), mode, how], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 120)
        assert ready, "the writer did not start writing within 120 s"
        assert process.stdout.readline().strip() == "writing"
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    return process.pid


def _temporaries(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


def test_killed_save_leaves_no_file_at_all(tmp_path):
    """O_TMPFILE: the file being written has no name, so a SIGKILL leaves nothing for anyone to clean up."""
    target = tmp_path / "c.ortcp"
    _kill_mid_write(target, "anonymous")
    assert os.listdir(tmp_path) == []
    storage.save({"a": 1}, target)  # the save that was interrupted can simply be made again
    assert os.listdir(tmp_path) == ["c.ortcp"] and storage.load(target) == {"a": 1}


def test_temporary_of_a_killed_writer_is_swept_by_the_next_save(tmp_path):
    """Without O_TMPFILE the temporary has a name; the next save in the directory removes it (its writer is dead)."""
    target = tmp_path / "c.ortcp"
    pid = _kill_mid_write(target, "named")
    (stale,) = _temporaries(tmp_path)
    assert stale.startswith(".c.ortcp.") and f"-{pid}." in stale
    assert not target.exists()
    storage.save({"b": 2}, tmp_path / "other.ortcp")  # any save in the directory sweeps
    assert sorted(os.listdir(tmp_path)) == ["other.ortcp"]


@pytest.mark.parametrize("mode", ["anonymous", "named"])
def test_killed_overwrite_keeps_the_old_file(tmp_path, mode):
    target = tmp_path / "c.ort.pt"
    target.write_bytes(b"old contents")
    _kill_mid_write(target, mode, how="overwrite")
    assert target.read_bytes() == b"old contents"
    _atomic.atomic_write(target, lambda handle: handle.write(b"newer"), overwrite=True)
    assert os.listdir(tmp_path) == ["c.ort.pt"] and target.read_bytes() == b"newer"


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=60)
    return process.pid


def test_sweep_leaves_live_writers_other_hosts_and_other_files_alone(tmp_path):
    host, dead = _atomic._HOST, _dead_pid()
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8
    keep = [
        f".c.ortcp.{host}-{os.getpid()}.{'a' * 16}.tmp",  # this process: a save in progress in another thread
        f".c.ortcp.{other_host}-{dead}.{'b' * 16}.tmp",  # another host's pid says nothing here
        f".c.ortcp.{'c' * 16}.tmp",  # not our pattern (what older versions wrote): not touched
        "notes.tmp",
    ]
    stale = f".c.ortcp.{host}-{dead}.{'d' * 16}.tmp"
    for name in [*keep, stale]:
        (tmp_path / name).write_bytes(b"x")
    assert _atomic.sweep_stale_temporaries(str(tmp_path)) == [str(tmp_path / stale)]
    assert sorted(os.listdir(tmp_path)) == sorted(keep)


def test_sweep_leaves_a_locked_temporary_alone(tmp_path):
    """A writer in another pid namespace looks dead by its pid; its lock says it is not."""
    name = f".c.ortcp.{_atomic._HOST}-{_dead_pid()}.{'e' * 16}.tmp"
    (tmp_path / name).write_bytes(b"x")
    with open(tmp_path / name, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert _atomic.sweep_stale_temporaries(str(tmp_path)) == []
    assert _atomic.sweep_stale_temporaries(str(tmp_path)) == [str(tmp_path / name)]


@pytest.mark.parametrize("anonymous", [True, False])
def test_failed_write_leaves_nothing_in_either_mode(tmp_path, monkeypatch, anonymous):
    if not anonymous:
        monkeypatch.setattr(_atomic, "_O_TMPFILE", 0)

    def fail(handle):
        handle.write(b"partial")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        _atomic.atomic_write(tmp_path / "c.ortcp", fail)
    assert os.listdir(tmp_path) == []
    storage.save({"w": np.arange(3)}, tmp_path / "c.ortcp")
    assert os.listdir(tmp_path) == ["c.ortcp"]
