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

import h5py
import numpy as np
import pytest
from legacy_checkpoint_files import adam_state, linear_weights, trainer_options, write_checkpoint

from orttrainer.checkpoint import CheckpointAggregationError, _atomic, aggregate_checkpoints, storage

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


def test_a_directory_that_cannot_take_the_file_is_an_error_naming_the_target(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & (_atomic._O_TMPFILE or os.O_CREAT):
            raise OSError(30, "Read-only file system")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OSError, match="Cannot create the checkpoint file: Read-only file system") as error:
        storage.save({"a": 1}, tmp_path / "c.ortcp")
    assert error.value.filename == str(tmp_path / "c.ortcp")


# --- checksums ----------------------------------------------------------------------------------------------------


def _flip(path, offset: int, count: int = 8) -> None:
    data = bytearray(path.read_bytes())
    for index in range(offset, offset + count):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


def _data_offset(path, name: str) -> int:
    """Where the dataset's values start in the file (its first chunk, or its contiguous data)."""
    with h5py.File(path, "r") as handle:
        dataset = handle[name]
        if dataset.chunks:
            return dataset.id.get_chunk_info(0).byte_offset
        return dataset.id.get_offset()


def _checkpoint(path) -> None:
    weights = {"fc.weight": np.linspace(-1, 1, 400, dtype=np.float32).reshape(20, 20), "fc.bias": np.ones(20)}
    storage.save(
        {
            "model": {"full_precision": weights},
            "trainer_options": {"optimizer_name": "AdamOptimizer", "world_size": 1},
            "train_step_info": {"optimization_step": 7, "step": 7},
        },
        path,
    )


def test_every_dataset_is_saved_with_a_checksum(tmp_path):
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    with h5py.File(path, "r") as handle:
        assert handle["model/full_precision/fc.weight"].fletcher32
        assert handle["model/full_precision/fc.bias"].fletcher32
        for name in ("trainer_options/optimizer_name", "trainer_options/world_size", "train_step_info/step"):
            assert storage.CHECKSUM_ATTRIBUTE in handle[name].attrs, name
    assert storage.load(path)["train_step_info"] == {"optimization_step": 7, "step": 7}


def test_flipped_bytes_in_a_weight_are_detected(tmp_path):
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    _flip(path, _data_offset(path, "model/full_precision/fc.weight") + 40)
    for read in (lambda: storage.load(path), lambda: storage.load(path, key="model/full_precision")):
        with pytest.raises(storage.CheckpointCorruptError) as error:
            read()
        assert "'model/full_precision/fc.weight'" in str(error.value) and str(path) in str(error.value)
    assert storage.load(path, key="train_step_info/step") == 7  # the rest of the file still reads


def test_flipped_bytes_in_a_scalar_are_detected(tmp_path):
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    _flip(path, _data_offset(path, "train_step_info/step"), count=2)
    with pytest.raises(storage.CheckpointCorruptError, match="'train_step_info/step' does not match the CRC-32"):
        storage.load(path)


def test_flipped_bytes_in_a_string_are_detected(tmp_path):
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    data = path.read_bytes()
    assert data.count(b"AdamOptimizer") == 1
    _flip(path, data.index(b"AdamOptimizer") + 4, count=1)
    with pytest.raises(storage.CheckpointCorruptError, match="'trainer_options/optimizer_name'"):
        storage.load(path, key="trainer_options")


def test_files_without_checksums_still_load(tmp_path):
    path = tmp_path / "legacy.ortcp"
    weights = linear_weights()
    write_checkpoint(path, weights=weights, optimizer=adam_state(weights))
    with h5py.File(path, "r") as handle:
        assert not handle["model/full_precision/fc.weight"].fletcher32
        assert not handle["train_step_info/step"].attrs
    np.testing.assert_array_equal(storage.load(path)["model"]["full_precision"]["fc.weight"], weights["fc.weight"])


def test_cli_info_reports_checksums_and_refuses_corrupt_values(tmp_path, capsys):
    from orttrainer.checkpoint import cli

    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    assert cli.main(["info", str(path)]) == 0
    assert "checksums: fletcher32 on 2 arrays, CRC-32 on 4 other datasets" in capsys.readouterr().out
    _flip(path, _data_offset(path, "train_step_info/step"), count=2)
    assert cli.main(["info", str(path)]) == 2
    assert "'train_step_info/step' does not match" in capsys.readouterr().err


# --- aggregation keeps what the trainer saves beyond the legacy layout --------------------------------------------


def _zero_rank_file(path, rank: int, **changes) -> str:
    """One rank of a ZeRO-1 run of 2, as ORTTrainer.save_checkpoint writes it (storage, with checksums)."""
    extra = {
        "train_step_info": {"optimization_step": 3, "step": 6},
        "loss_scaler": {"loss_scale": 128.0, "stable_steps": 5},
        "rng": {"seed": 12345, "positions": {"all": 3, "8x32:float32|8:int64": 2}},
    }
    for key, value in changes.items():
        if value is None:
            extra.pop(key)
        else:
            extra[key] = value
    storage.save(
        {
            "model": {"full_precision": {"w": np.arange(6, dtype=np.float32)}},
            "optimizer": {"w": {"Moment_1": np.full(3, rank + 1.0), "Moment_2": np.full(3, rank + 2.0)}},
            "trainer_options": trainer_options(rank=rank, world_size=2, zero_stage=1),
            "partition_info": {"w": {"original_dim": np.array([6]), "megatron_row_partition": np.array([-1])}},
            **extra,
        },
        path,
    )
    return str(path)


def test_aggregation_keeps_rng_loss_scaler_and_counters(tmp_path):
    paths = [_zero_rank_file(tmp_path / f"r{rank}.ortcp", rank) for rank in (0, 1)]
    state = aggregate_checkpoints(paths, pytorch_format=False)
    assert state["rng"] == {"seed": 12345, "positions": {"all": 3, "8x32:float32|8:int64": 2}}
    assert state["loss_scaler"] == {"loss_scale": 128.0, "stable_steps": 5}
    assert state["train_step_info"] == {"optimization_step": 3, "step": 6}
    assert state["optimizer"]["w"]["Moment_1"].tolist() == [1, 1, 1, 2, 2, 2]


def test_aggregation_keeps_identical_gradient_accumulation(tmp_path):
    sums = {"gradient_accumulation": {"w": np.full(6, 0.5, np.float32)}}
    paths = [_zero_rank_file(tmp_path / f"r{rank}.ortcp", rank, **sums) for rank in (0, 1)]
    state = aggregate_checkpoints(paths, pytorch_format=False)
    np.testing.assert_array_equal(state["gradient_accumulation"]["w"], np.full(6, 0.5, np.float32))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"loss_scaler": {"loss_scale": 64.0, "stable_steps": 5}}, "Value mismatch for loss_scaler/loss_scale"),
        ({"train_step_info": None}, "train_step_info/optimization_step is in the checkpoint file of rank 0 but"),
        (
            {"gradient_accumulation": {"w": np.ones(6, np.float32)}},
            "gradient_accumulation: each data-parallel rank holds its own partial gradient sums",
        ),
    ],
    ids=["loss_scale", "counters_missing", "gradient_accumulation"],
)
def test_aggregation_refuses_ranks_that_disagree_on_replicated_state(tmp_path, changes, message):
    accumulation = (
        {"gradient_accumulation": {"w": np.zeros(6, np.float32)}} if "gradient_accumulation" in changes else {}
    )
    first = _zero_rank_file(tmp_path / "r0.ortcp", 0, **accumulation)
    second = _zero_rank_file(tmp_path / "r1.ortcp", 1, **changes)
    with pytest.raises(CheckpointAggregationError) as error:
        aggregate_checkpoints([first, second], pytorch_format=False)
    assert message in str(error.value) and second in str(error.value)


@pytest.mark.parametrize(
    "rng, message",
    [
        ({"seed": 12345, "positions": {"all": 4, "8x32:float32|8:int64": 2}}, "Value mismatch for rng/positions/all"),
        ({"seed": 7, "positions": {"all": 3, "8x32:float32|8:int64": 2}}, "Value mismatch for rng/seed"),
        ({"seed": 12345, "positions": {"all": 3}}, "rng/positions/8x32:float32|8:int64 is in the checkpoint file"),
        (None, "rng/seed is in the checkpoint file of rank 0 but missing"),
    ],
    ids=["position", "seed", "missing_key", "missing"],
)
def test_aggregation_keeps_the_first_ranks_dropout_stream_when_ranks_differ(tmp_path, rng, message):
    """Ranks may draw masks differently (seeded differently, or other batch shapes): a warning, not a refusal."""
    first = _zero_rank_file(tmp_path / "r0.ortcp", 0)
    second = _zero_rank_file(tmp_path / "r1.ortcp", 1, rng=rng)
    with pytest.warns(UserWarning, match="continues rank 0's dropout stream") as record:
        state = aggregate_checkpoints([first, second], pytorch_format=False)
    assert message in str(record[0].message) and second in str(record[0].message)
    assert state["rng"] == {"seed": 12345, "positions": {"all": 3, "8x32:float32|8:int64": 2}}
