"""aggregate_checkpoints over per-rank HDF5 files (docs/legacy_api.md §9.4): the worked example, Megatron and
ZeRO+Megatron grouping, and every mismatch with a message that names the file."""

from __future__ import annotations

from unittest.mock import call, patch

import numpy as np
import pytest
import torch
from legacy_checkpoint_files import trainer_options, write_checkpoint, write_zero_example

from orttrainer import checkpoint
from orttrainer.checkpoint import CheckpointAggregationError
from orttrainer.checkpoint.aggregate import _aggregate_over_ranks, _get_parallellism_groups


def _eq(actual, expected) -> bool:
    return np.array_equal(actual, np.array(expected))


# --- the worked example -------------------------------------------------------------------------------------------


def test_worked_example_zero_full_precision(tmp_path):
    paths = write_zero_example(tmp_path)
    state = checkpoint.aggregate_checkpoints(list(reversed(paths)), pytorch_format=False)  # any order
    model = state["model"]["full_precision"]
    assert _eq(model["optimizer_sharded"], [1, 2, 3])  # fp32 weights are replicated, not sharded
    assert _eq(model["non_sharded"], [11, 22, 33])
    sharded = state["optimizer"]["optimizer_sharded"]
    assert _eq(sharded["Moment_1"], [[9, 8, 7], [6, 5, 4]])
    assert _eq(sharded["Moment_2"], [[99, 88, 77], [66, 55, 44]])
    assert _eq(sharded["Step"], [5])
    assert _eq(state["optimizer"]["non_sharded"]["Moment_1"], [666, 555, 444])
    assert _eq(state["optimizer"]["non_sharded"]["Moment_2"], [6666, 5555, 4444])
    assert _eq(state["optimizer"]["non_sharded"]["Step"], [55])
    assert state["trainer_options"] == {
        "mixed_precision": False,
        "zero_stage": 0,
        "world_rank": 0,
        "world_size": 1,
        "optimizer_name": b"Adam",  # bytes stay bytes
        "data_parallel_size": 1,
        "horizontal_parallel_size": 1,
    }
    assert "partition_info" not in state
    # the user_dict of the first file (in rank order) that has one: only rank 1 has one here
    assert checkpoint.storage.from_serialized_hex(state["user_dict"]) == {"rank": 1}


def test_worked_example_mixed_precision(tmp_path):
    state = checkpoint.aggregate_checkpoints(write_zero_example(tmp_path, mixed_precision=True), pytorch_format=False)
    assert _eq(state["model"]["full_precision"]["optimizer_sharded"], [[1, 2, 3], [4, 5, 6]])
    assert _eq(state["model"]["full_precision"]["non_sharded"], [11, 22, 33])
    assert _eq(state["optimizer"]["optimizer_sharded"]["Moment_1"], [[9, 8, 7], [6, 5, 4]])
    assert state["trainer_options"]["mixed_precision"]


def test_pytorch_format_is_flat_tensors(tmp_path):
    result = checkpoint.aggregate_checkpoints(write_zero_example(tmp_path, mixed_precision=True))
    assert set(result) == {"optimizer_sharded", "non_sharded"}
    assert all(isinstance(value, torch.Tensor) for value in result.values())
    assert torch.equal(result["optimizer_sharded"], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert torch.equal(result["non_sharded"], torch.tensor([11, 22, 33]))


def _legacy_mock_dicts():
    """The legacy unit test's mocked loads: trainer_options of paths[0], of each path, then the two rank files."""
    options = [
        {**trainer_options(rank=rank, world_size=2, zero_stage=1, optimizer_name="x"), "optimizer_name": b"Adam"}
        for rank in (0, 1)
    ]
    rank_files = []
    for rank, (moment_1, moment_2) in enumerate([([9, 8, 7], [99, 88, 77]), ([6, 5, 4], [66, 55, 44])]):
        rank_files.append(
            {
                "model": {
                    "full_precision": {"optimizer_sharded": np.array([1, 2, 3]), "non_sharded": np.array([11, 22, 33])}
                },
                "optimizer": {
                    "optimizer_sharded": {
                        "Moment_1": np.array(moment_1),
                        "Moment_2": np.array(moment_2),
                        "Step": np.array([5]),
                    },
                    "non_sharded": {
                        "Moment_1": np.array([666, 555, 444]),
                        "Moment_2": np.array([6666, 5555, 4444]),
                        "Step": np.array([55]),
                    },
                },
                # the rank files of the legacy test say world_size 1 / zero_stage 0: only agreement among them counts
                "trainer_options": {**trainer_options(rank=rank, world_size=1), "optimizer_name": b"Adam"},
                "partition_info": {"optimizer_sharded": {"original_dim": np.array([2, 3])}},
            }
        )
    return options, rank_files


def test_legacy_mocked_load_sequence():
    options, rank_files = _legacy_mock_dicts()
    with patch("orttrainer._checkpoint_storage.load") as load_mock:
        # paths[0] ('abc') first, then 'abc' says rank 1 and 'def' rank 0, so 'def' is aggregated first
        load_mock.side_effect = [options[1], options[1], options[0], *rank_files]
        state = checkpoint.aggregate_checkpoints(["abc", "def"], pytorch_format=False)
    assert load_mock.call_args_list == [
        call("abc", key="trainer_options"),
        call("abc", key="trainer_options"),
        call("def", key="trainer_options"),
        call("def"),
        call("abc"),
    ]
    assert _eq(state["optimizer"]["optimizer_sharded"]["Moment_1"], [[9, 8, 7], [6, 5, 4]])
    assert _eq(state["optimizer"]["optimizer_sharded"]["Moment_2"], [[99, 88, 77], [66, 55, 44]])
    assert state["trainer_options"]["optimizer_name"] == b"Adam"


# --- groups, Megatron, ZeRO + Megatron ----------------------------------------------------------------------------


def test_parallelism_groups():
    assert _get_parallellism_groups(2, 2, 4) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    assert _get_parallellism_groups(4, 1, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert _get_parallellism_groups(1, 2, 2) == ([[0], [1]], [[0, 1]])


def _megatron_files(tmp_path, world_size=2):
    """Megatron (H=2) shards: a column-split weight (row_partition 0, last axis) and a row-split one (axis 0)."""
    full_col = np.arange(12, dtype=np.float32).reshape(3, 4)
    full_row = np.arange(8, dtype=np.float32).reshape(4, 2) + 100
    paths = []
    for rank in range(world_size):
        path = tmp_path / f"megatron.{rank}.ortcp"
        write_checkpoint(
            path,
            weights={
                "col": full_col[:, 2 * rank : 2 * rank + 2],
                "row": full_row[2 * rank : 2 * rank + 2],
                "bias": np.array([1.0, 2.0], np.float32),
            },
            optimizer={"row": {"Moment_1": full_row[2 * rank : 2 * rank + 2] * 0.5, "Step": np.array([3])}},
            options=trainer_options(rank=rank, world_size=2, horizontal_parallel_size=2),
            partition_info={
                "col": {"original_dim": [3, 4], "megatron_row_partition": [0]},
                "row": {"original_dim": [4, 2], "megatron_row_partition": [1]},
            },
        )
        paths.append(str(path))
    return paths, full_col, full_row


def test_megatron_concatenates_along_the_partitioned_axis(tmp_path):
    paths, full_col, full_row = _megatron_files(tmp_path)
    state = checkpoint.aggregate_checkpoints(paths, pytorch_format=False)
    np.testing.assert_array_equal(state["model"]["full_precision"]["col"], full_col)
    np.testing.assert_array_equal(state["model"]["full_precision"]["row"], full_row)
    np.testing.assert_array_equal(state["model"]["full_precision"]["bias"], [1.0, 2.0])
    np.testing.assert_array_equal(state["optimizer"]["row"]["Moment_1"], full_row * 0.5)
    assert _eq(state["optimizer"]["row"]["Step"], [3])
    assert state["trainer_options"]["horizontal_parallel_size"] == 1


def test_zero_and_megatron(tmp_path):
    """D=2, H=2, W=4, mixed precision: ZeRO over ranks {0,2} and {1,3}, then Megatron over the two results."""
    full = np.arange(16, dtype=np.float32).reshape(4, 4)  # Megatron splits rows (axis 0): rank%2 holds 2 rows
    paths = []
    for rank in range(4):
        h, d = rank % 2, rank // 2
        megatron_shard = full[2 * h : 2 * h + 2].reshape(-1)  # 8 values, ZeRO then splits them in 2 flat halves
        zero_shard = megatron_shard[4 * d : 4 * d + 4]
        path = tmp_path / f"dh.{rank}.ortcp"
        write_checkpoint(
            path,
            weights={"w": zero_shard, "replicated": np.array([7.0, 8.0], np.float32)},
            optimizer={"w": {"Moment_1": zero_shard * 10, "Moment_2": zero_shard * 100, "Step": np.array([9])}},
            options=trainer_options(
                rank=rank,
                world_size=4,
                zero_stage=1,
                mixed_precision=True,
                data_parallel_size=2,
                horizontal_parallel_size=2,
            ),
            partition_info={"w": {"original_dim": [4, 4], "megatron_row_partition": [1]}},
            user_dict={"from": rank} if rank >= 2 else None,
        )
        paths.append(str(path))
    state = checkpoint.aggregate_checkpoints(paths[::-1], pytorch_format=False)
    np.testing.assert_array_equal(state["model"]["full_precision"]["w"], full)
    np.testing.assert_array_equal(state["optimizer"]["w"]["Moment_1"], full * 10)
    np.testing.assert_array_equal(state["optimizer"]["w"]["Moment_2"], full * 100)
    np.testing.assert_array_equal(state["model"]["full_precision"]["replicated"], [7.0, 8.0])
    assert state["trainer_options"]["world_rank"] == 0 and state["trainer_options"]["world_size"] == 1
    assert checkpoint.storage.from_serialized_hex(state["user_dict"]) == {"from": 2}
    flat = checkpoint.aggregate_checkpoints(paths)
    assert torch.equal(flat["w"], torch.from_numpy(full))


# --- mismatches ---------------------------------------------------------------------------------------------------


def _zero_pair(tmp_path, rank1_options=None, **rank1_changes):
    """Two ZeRO rank files; rank 1's trainer_options or contents can be altered."""
    paths = []
    for rank in range(2):
        options = trainer_options(rank=rank, world_size=2, zero_stage=1)
        if rank == 1 and rank1_options:
            options.update(rank1_options)
        spec = {
            "weights": {"w": np.array([1.0, 2.0, 3.0, 4.0], np.float32)},
            "optimizer": {"w": {"Moment_1": np.array([rank, rank], np.float32), "Update_Count": np.array([4])}},
            "options": options,
            "partition_info": {"w": {"original_dim": [4], "megatron_row_partition": [-1]}},
        }
        if rank == 1:
            spec.update(rank1_changes)
        path = tmp_path / f"pair.{rank}.ortcp"
        write_checkpoint(path, **spec)
        paths.append(str(path))
    return paths


def _aggregation_error(paths) -> str:
    with pytest.raises(CheckpointAggregationError) as error:
        checkpoint.aggregate_checkpoints(paths, pytorch_format=False)
    assert isinstance(error.value, AssertionError) and isinstance(error.value, ValueError)
    return str(error.value)


def test_pair_aggregates_when_consistent(tmp_path):
    state = checkpoint.aggregate_checkpoints(_zero_pair(tmp_path), pytorch_format=False)
    assert _eq(state["optimizer"]["w"]["Moment_1"], [0, 0, 1, 1])
    assert _eq(state["optimizer"]["w"]["Update_Count"], [4])


@pytest.mark.parametrize(
    "changed, expected",
    [
        ({"mixed_precision": True}, "Mixed precision state mismatch among checkpoint files. File: {path}"),
        ({"optimizer_name": "LambOptimizer"}, "Optimizer name mismatch among checkpoint files. File: {path}"),
        ({"zero_stage": 2}, "Zero stage mismatch among checkpoint files. File: {path}"),
        ({"world_size": 4}, "World size state mismatch among checkpoint files. File: {path}"),
    ],
)
def test_trainer_option_mismatch_names_the_file(tmp_path, changed, expected):
    paths = _zero_pair(tmp_path, rank1_options=changed)
    assert _aggregation_error(paths).startswith(expected.format(path=paths[1]))


def test_rank_mismatch_names_file_and_both_ranks(tmp_path):
    # legacy's message referenced an undefined name: a NameError instead of this
    paths = _zero_pair(tmp_path)
    with pytest.raises(CheckpointAggregationError) as error:
        _aggregate_over_ranks(paths, [1, 0])
    assert str(error.value) == f"Unexpected rank in file at path {paths[0]}. Expected 1, got 0"


def test_unsharded_model_state_mismatch(tmp_path):
    paths = _zero_pair(tmp_path, weights={"w": np.array([1.0, 2.0, 3.0, 5.0], np.float32)})
    message = _aggregation_error(paths)
    assert message == f"Value mismatch for model state w (file: {paths[1]})"


def test_unsharded_optimizer_state_mismatch(tmp_path):
    optimizer = {"w": {"Moment_1": np.array([1, 1], np.float32), "Update_Count": np.array([5])}}
    paths = _zero_pair(tmp_path, optimizer=optimizer)
    assert _aggregation_error(paths) == (
        f"Value mismatch for model state w and optimizer state Update_Count (file: {paths[1]})"
    )


@pytest.mark.parametrize("missing", ["partition_info", "trainer_options"])
def test_missing_information(tmp_path, missing):
    paths = _zero_pair(tmp_path)
    state = checkpoint.storage.load(paths[1])
    del state[missing]
    with patch("orttrainer._checkpoint_storage.load", return_value=state):
        with pytest.raises(CheckpointAggregationError) as error:
            _aggregate_over_ranks(["x"], [1])
    assert str(error.value) == f"Missing information: {missing} in checkpoint file x"


def test_duplicate_rank_file(tmp_path):
    paths = _zero_pair(tmp_path)
    message = _aggregation_error([paths[0], paths[0]])
    assert message == (
        f"Expected one checkpoint file for each rank 0..1 (world_size 2), got {paths[0]}: rank 0, {paths[0]}: rank 0"
    )


def test_missing_rank_file(tmp_path):
    paths = _zero_pair(tmp_path)
    assert _aggregation_error(paths[1:]).startswith("Expected one checkpoint file for each rank 0..1 (world_size 2)")


def test_shards_that_do_not_fill_the_original_shape(tmp_path):
    paths = _zero_pair(
        tmp_path, optimizer={"w": {"Moment_1": np.array([1], np.float32), "Update_Count": np.array([4])}}
    )
    message = _aggregation_error(paths)
    assert message.startswith("Cannot reshape the aggregated optimizer state Moment_1 of w (3 elements)")
    assert "[4]" in message


def test_unpartitioned_files_are_refused(tmp_path):
    path = tmp_path / "plain.ortcp"
    write_checkpoint(path, weights={"w": np.ones(2, np.float32)})
    assert _aggregation_error([str(path)]).startswith(f"{path} is not partitioned")


def test_inconsistent_parallel_sizes(tmp_path):
    path = tmp_path / "odd.ortcp"
    write_checkpoint(
        path,
        weights={"w": np.ones(2, np.float32)},
        options=trainer_options(world_size=4, zero_stage=1, data_parallel_size=3),
        partition_info={},
    )
    assert _aggregation_error([str(path)]) == (
        f"Inconsistent parallel sizes in {path}: data_parallel_size 3 x horizontal_parallel_size 1 != world_size 4"
    )


def test_no_paths():
    with pytest.raises(CheckpointAggregationError, match="at least one checkpoint file"):
        checkpoint.aggregate_checkpoints([])


def test_unreadable_rank_file_names_it(tmp_path):
    paths = _zero_pair(tmp_path)
    with open(paths[1], "r+b") as handle:
        handle.truncate(1000)
    with pytest.raises(ValueError) as error:
        checkpoint.aggregate_checkpoints(paths)
    assert paths[1] in str(error.value)
