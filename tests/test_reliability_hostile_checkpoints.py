"""Checkpoints from outside and checkpoints written under pressure (docs/reliability.md §4): a
dataset that declares more than the file holds, data kept outside the file, links out of it or back into it; a save
that hits the file-size limit (EFBIG), which crashed the interpreter inside h5py's file-object driver before the fix
and so runs in a subprocess here."""

from __future__ import annotations

import errno
import json
import os

import h5py
import numpy as np
import pytest
from test_reliability_hostile_files import _run_child, _trained_mlp

from orttrainer.checkpoint import storage
from orttrainer.checkpoint.storage import CheckpointCorruptError

# --- checkpoints under a file-size limit --------------------------------------------------------------------------

_FSIZE_CHILD = """
    import json, os, resource, sys
    import numpy as np
    from orttrainer.checkpoint import _atomic, storage

    def limited(save, limit):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            save()
            return {"saved": True}
        except Exception as error:
            return {"type": type(error).__name__, "errno": getattr(error, "errno", None),
                    "filename": getattr(error, "filename", None), "message": str(error)}
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    folder, mode, how = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "named":
        _atomic._O_TMPFILE = 0  # as on a filesystem without O_TMPFILE
    state = {"model": {"full_precision": {"w": np.arange(100_000, dtype=np.float32)}}}
    previous = os.path.join(folder, "previous.ortcp")
    storage.save(state, previous)
    results = {}
    for limit in (4096, 65536):
        if how == "storage":
            target = os.path.join(folder, f"new-{limit}.ortcp")
            results[limit] = limited(lambda: storage.save(state, target), limit)
        else:  # an overwrite, as experimental_save_checkpoint does: torch.save through atomic_write
            import torch
            write = lambda handle: torch.save({"w": torch.arange(100_000.0)}, handle)
            results[limit] = limited(lambda: _atomic.atomic_write(previous, write, overwrite=True), limit)
    print(json.dumps(results))
"""


@pytest.mark.parametrize("how", ["storage", "overwrite"])
@pytest.mark.parametrize("mode", ["anonymous", "named"])
def test_a_save_beyond_the_file_size_limit_raises_and_keeps_the_previous_file(tmp_path, mode, how):
    result = _run_child(_FSIZE_CHILD, str(tmp_path), mode, how)
    assert result.returncode == 0, f"the saving process died ({result.returncode}): {result.stderr[-2000:]}"
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    for limit, outcome in outcomes.items():
        target = str(tmp_path / (f"new-{limit}.ortcp" if how == "storage" else "previous.ortcp"))
        assert outcome["type"] == "OSError" and outcome["errno"] == errno.EFBIG, outcome
        assert outcome["filename"] == target and "nothing was saved" in outcome["message"], outcome
    assert os.listdir(tmp_path) == ["previous.ortcp"]  # no new file, no temporary
    loaded = storage.load(tmp_path / "previous.ortcp")
    assert np.array_equal(loaded["model"]["full_precision"]["w"], np.arange(100_000, dtype=np.float32))


_DISK_FULL_CHILD = """
    import errno, json, os, sys
    import numpy as np
    from orttrainer.checkpoint import storage

    folder = sys.argv[1]
    state = {"model": {"full_precision": {"w": np.arange(100_000, dtype=np.float32)}}}
    storage.save(state, os.path.join(folder, "previous.ortcp"))
    real, written = os.pwrite, [0]

    def pwrite(fd, data, offset):  # a disk that fills up after 10 KB
        if written[0] + len(data) > 10_000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return real(fd, data, offset)

    os.pwrite = pwrite
    target = os.path.join(folder, "new.ortcp")
    try:
        storage.save(state, target)
        print(json.dumps("saved"))
    except OSError as error:
        print(json.dumps([error.errno, error.filename]))
"""


def test_a_save_on_a_full_disk_raises_and_keeps_the_previous_file(tmp_path):
    """ENOSPC inside HDF5's writes (injected into os.pwrite, which the HDF5 writes go through)."""
    result = _run_child(_DISK_FULL_CHILD, str(tmp_path))
    assert result.returncode == 0, f"the saving process died ({result.returncode}): {result.stderr[-2000:]}"
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [errno.ENOSPC, str(tmp_path / "new.ortcp")]
    assert os.listdir(tmp_path) == ["previous.ortcp"]
    assert storage.load(tmp_path / "previous.ortcp")["model"]["full_precision"]["w"].shape == (100_000,)


_TRAINER_FSIZE_CHILD = """
    import json, os, resource, sys
    import numpy as np, torch
    from helpers import make_trainer
    from models import MLP, mlp_desc
    from orttrainer import optim

    folder = sys.argv[1]
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(lr=1e-3), torch.nn.functional.cross_entropy)
    trainer.train_step(torch.randn(4, 32), torch.tensor([0, 1, 2, 3]))
    trainer.save_checkpoint(os.path.join(folder, "previous.ortcp"))
    before = {k: v.tolist() for k, v in trainer.state_dict(pytorch_format=True).items()}
    trainer.train_step(torch.randn(4, 32), torch.tensor([0, 1, 2, 3]))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    results = {}
    for limit in (4096, 65536):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            trainer.save_checkpoint(os.path.join(folder, f"new-{limit}.ortcp"))
            results[limit] = "saved"
        except OSError as error:
            results[limit] = [error.errno, error.filename]
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    trainer.load_checkpoint(os.path.join(folder, "previous.ortcp"))
    after = {k: v.tolist() for k, v in trainer.state_dict(pytorch_format=True).items()}
    print(json.dumps({"results": results, "restored": before == after}))
"""


def test_save_checkpoint_beyond_the_file_size_limit_raises_and_the_previous_checkpoint_loads(tmp_path):
    result = _run_child(_TRAINER_FSIZE_CHILD, str(tmp_path))
    assert result.returncode == 0, f"the trainer's process died ({result.returncode}): {result.stderr[-2000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for limit in ("4096", "65536"):
        assert report["results"][limit] == [errno.EFBIG, str(tmp_path / f"new-{limit}.ortcp")], report
    assert report["restored"] and os.listdir(tmp_path) == ["previous.ortcp"]


# --- checkpoints that declare more than they hold, or link elsewhere ----------------------------------------------


def _checkpoint(path) -> None:
    storage.save({"model": {"full_precision": {"w": np.ones(4, np.float32)}}, "step": 3}, path)


def _replace_weight(path, **create) -> None:
    with h5py.File(path, "a") as handle:
        del handle["model/full_precision/w"]
        handle.create_dataset("model/full_precision/w", **create)


def test_a_dataset_declaring_a_terabyte_is_refused_before_anything_is_allocated(tmp_path):
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    _replace_weight(path, shape=(10**12,), dtype=np.float32)  # HDF5 stores none of it (fill value)
    with pytest.raises(CheckpointCorruptError, match=r"c\.ortcp .*'model/full_precision/w' declares 1000000000000 "):
        storage.load(path)
    assert "3.6 TiB" in str(pytest.raises(CheckpointCorruptError, storage.load, path).value)


def test_trainer_load_checkpoint_refuses_a_dataset_declaring_more_than_the_file_holds(tmp_path):
    trainer = _trained_mlp()
    path = tmp_path / "c.ortcp"
    trainer.save_checkpoint(str(path))
    with h5py.File(path, "a") as handle:
        del handle["model/full_precision/fc1.weight"]
        handle.create_dataset("model/full_precision/fc1.weight", shape=(10**6, 10**6), dtype=np.float32, chunks=True)
    with pytest.raises(CheckpointCorruptError, match=r"'model/full_precision/fc1\.weight' declares 1000000000000"):
        trainer.load_checkpoint(str(path))


def test_compressed_datasets_still_load(tmp_path):
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    _replace_weight(path, data=np.zeros(100_000, np.float32), compression="gzip", compression_opts=9)
    assert np.array_equal(storage.load(path)["model"]["full_precision"]["w"], np.zeros(100_000, np.float32))


def test_a_dataset_stored_in_an_external_raw_file_is_refused(tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.full(4, 7.0, np.float32).tobytes())
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    _replace_weight(path, shape=(4,), dtype=np.float32, external=[(str(outside), 0, 16)])
    with pytest.raises(CheckpointCorruptError, match=r"'model/full_precision/w' keeps its data in an external file"):
        storage.load(path)


@pytest.mark.parametrize("link", ["external", "soft", "cycle"])
def test_links_out_of_the_checkpoint_or_back_into_it_are_refused(tmp_path, link):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as handle:
        handle["w"] = np.full(4, 7.0, np.float32)
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    with h5py.File(path, "a") as handle:
        if link == "external":
            handle["model/extra"] = h5py.ExternalLink(str(other), "/w")
        elif link == "soft":
            handle["model/extra"] = h5py.SoftLink("/model/full_precision/w")
        else:
            handle["model/full_precision/loop"] = handle["model"]  # a hard link to an enclosing group
    message = {"external": "an external link", "soft": "a soft link", "cycle": "linked more than once"}[link]
    with pytest.raises(CheckpointCorruptError, match=message):
        storage.load(path)


def test_reading_one_key_follows_no_link_out_of_the_file(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as handle:
        handle["w"] = np.full(4, 7.0, np.float32)
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    with h5py.File(path, "a") as handle:
        handle["elsewhere"] = h5py.ExternalLink(str(other), "/")
    with pytest.raises(CheckpointCorruptError, match="'elsewhere' is an external link"):
        storage.load(path, "elsewhere/w")
    assert storage.load(path, "step") == 3


def test_cli_info_refuses_a_link_out_of_the_file(tmp_path, capsys):
    from orttrainer.checkpoint import cli

    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as handle:
        handle["w"] = np.full(4, 7.0, np.float32)
    path = tmp_path / "c.ortcp"
    _checkpoint(path)
    with h5py.File(path, "a") as handle:
        handle["model/full_precision/extra"] = h5py.ExternalLink(str(other), "/w")
    assert cli.main(["info", str(path)]) == 2
    assert "'model/full_precision/extra' is an external link" in capsys.readouterr().err
