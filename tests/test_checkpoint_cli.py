"""``python -m orttrainer.checkpoint`` run as a user would: in a subprocess, on legacy-layout files."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from legacy_checkpoint_files import (
    adam_state,
    lamb_state,
    linear_weights,
    trainer_options,
    write_checkpoint,
    write_zero_example,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orttrainer.checkpoint", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def _assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def adam_checkpoint(tmp_path):
    weights = linear_weights()
    path = tmp_path / "adam.ortcp"
    write_checkpoint(path, weights=weights, optimizer=adam_state(weights), user_dict={"epoch": 3})
    return path


# --- help ---------------------------------------------------------------------------------------------------------


def test_help():
    result = _run("--help")
    assert result.returncode == 0
    assert "info" in result.stdout and "to-pytorch" in result.stdout
    sub = _run("to-pytorch", "--help")
    assert sub.returncode == 0 and "OUT" in sub.stdout and "aggregate" in sub.stdout


def test_usage_errors_are_one_line():
    _assert_one_line_error(_run(), "required: COMMAND")
    _assert_one_line_error(_run("convert", "x"), "invalid choice: 'convert'")
    _assert_one_line_error(_run("to-pytorch", "only_one_argument"), "required: OUT")


# --- info ---------------------------------------------------------------------------------------------------------


def test_info_adam_checkpoint(adam_checkpoint):
    result = _run("info", adam_checkpoint)
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines()]
    assert f"checkpoint: {adam_checkpoint} (HDF5," in result.stdout
    assert "model/full_precision: 2 tensors, 15 values" in result.stdout
    assert ["fc.weight", "(3,", "4)", "float32"] in lines
    assert ["fc.bias", "(3,)", "float32"] in lines
    assert "optimizer: AdamOptimizer, state for 2 weights" in result.stdout
    assert ["fc.weight", "Moment_1", "(3,", "4)", "float32"] in lines
    assert ["fc.bias", "Update_Count", "(1,)", "int64", "[5]"] in lines
    for option, value in [
        ("mixed_precision", "False"),
        ("zero_stage", "0"),
        ("world_rank", "0"),
        ("world_size", "1"),
        ("optimizer_name", "AdamOptimizer"),
        ("data_parallel_size", "1"),
        ("horizontal_parallel_size", "1"),
        ("optimization_step", "5"),
        ("step", "20"),
    ]:
        assert [option, value] in lines
    assert "partition_info: absent" in result.stdout
    assert "user_dict: present" in result.stdout


def test_info_lamb_zero_rank_file(tmp_path):
    weights = linear_weights()
    path = tmp_path / "lamb.ortcp"
    write_checkpoint(
        path,
        weights=weights,
        optimizer=lamb_state(weights),
        options=trainer_options(rank=1, world_size=2, zero_stage=1, optimizer_name="LambOptimizer"),
        partition_info={"fc.weight": {"original_dim": [3, 4], "megatron_row_partition": [-1]}},
        train_step_info=None,
    )
    result = _run("info", path)
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines()]
    assert "optimizer: LambOptimizer, state for 2 weights and shared state" in result.stdout
    assert ["shared_optimizer_state", "Step", "(1,)", "int64", "[7]"] in lines
    assert "partition_info: present for 1 weight" in result.stdout
    assert ["fc.weight", "[3,", "4]", "[-1]"] in lines
    assert "train_step_info: absent" in result.stdout
    assert "user_dict: absent" in result.stdout


def test_info_missing_file(tmp_path):
    _assert_one_line_error(_run("info", tmp_path / "absent.ortcp"), "not found", str(tmp_path / "absent.ortcp"))


def test_info_non_hdf5_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    _assert_one_line_error(_run("info", path), f"{path} is not an HDF5 checkpoint file")


def test_info_truncated_file(adam_checkpoint):
    adam_checkpoint.write_bytes(adam_checkpoint.read_bytes()[:1500])
    _assert_one_line_error(_run("info", adam_checkpoint), str(adam_checkpoint), "truncated or corrupt")


# --- to-pytorch ---------------------------------------------------------------------------------------------------


def test_to_pytorch_loads_into_the_module(adam_checkpoint, tmp_path):
    out = tmp_path / "model.pt"
    result = _run("to-pytorch", adam_checkpoint, out)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote 2 tensors (15 values) to {out}"
    state = torch.load(out)  # weights_only: a plain {name: Tensor}
    assert set(state) == {"fc.weight", "fc.bias"}
    assert all(type(value) is torch.Tensor for value in state.values())
    module = torch.nn.Module()
    module.fc = torch.nn.Linear(4, 3)
    module.load_state_dict(state)  # strict: exactly the module's keys and shapes
    np.testing.assert_array_equal(module.fc.weight.detach().numpy(), linear_weights()["fc.weight"])
    np.testing.assert_array_equal(module.fc.bias.detach().numpy(), linear_weights()["fc.bias"])
    assert sorted(os.listdir(tmp_path)) == ["adam.ortcp", "model.pt"]


def test_to_pytorch_refuses_to_overwrite(adam_checkpoint, tmp_path):
    out = tmp_path / "model.pt"
    out.write_bytes(b"precious")
    _assert_one_line_error(_run("to-pytorch", adam_checkpoint, out), "already exists", str(out))
    assert out.read_bytes() == b"precious"


def test_to_pytorch_aggregates_zero_rank_files(tmp_path):
    paths = write_zero_example(tmp_path, mixed_precision=True)
    out = tmp_path / "merged.pt"
    result = _run("to-pytorch", paths[1], paths[0], out)
    assert result.returncode == 0, result.stderr
    state = torch.load(out)
    assert torch.equal(state["optimizer_sharded"], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert torch.equal(state["non_sharded"], torch.tensor([11, 22, 33]))


def test_to_pytorch_single_zero_rank_file_is_refused(tmp_path):
    paths = write_zero_example(tmp_path, mixed_precision=True)
    out = tmp_path / "merged.pt"
    _assert_one_line_error(_run("to-pytorch", paths[1], out), f"{paths[1]} is rank 1", "pass all 2 rank files")
    assert not out.exists()


def test_to_pytorch_mismatched_rank_files(tmp_path):
    paths = write_zero_example(tmp_path)
    other = write_zero_example(tmp_path, mixed_precision=True, prefix="other")
    out = tmp_path / "merged.pt"
    _assert_one_line_error(
        _run("to-pytorch", paths[0], other[1], out), "Mixed precision state mismatch among checkpoint files", other[1]
    )
    assert not out.exists()


def test_to_pytorch_missing_input(tmp_path):
    out = tmp_path / "model.pt"
    _assert_one_line_error(_run("to-pytorch", tmp_path / "absent.ortcp", out), str(tmp_path / "absent.ortcp"))
    assert not out.exists()
