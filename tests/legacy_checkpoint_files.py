"""Write checkpoint files exactly as legacy ORTTrainer.save_checkpoint did, with h5py directly.

Legacy walked the state dict depth first: a dict became ``create_group(key)``, anything else ``group[key] = value``
(docs/legacy_api.md §9.2). So a Python str became a scalar variable-length string, a bool a scalar bool, an int
a scalar int64, and the user dict a hex string at the root. These helpers do the same, without our storage code,
so that the tests read files that the original would have produced.
"""

from __future__ import annotations

import pickle
from typing import Any

import h5py
import numpy as np


def write_tree(group: h5py.Group, tree: dict[str, Any]) -> None:
    for key, value in tree.items():
        if isinstance(value, dict):
            write_tree(group.create_group(key), value)
        else:
            group[key] = value


def trainer_options(
    *,
    rank: int = 0,
    world_size: int = 1,
    zero_stage: int = 0,
    mixed_precision: bool = False,
    optimizer_name: str = "AdamOptimizer",
    data_parallel_size: int | None = None,
    horizontal_parallel_size: int = 1,
) -> dict[str, Any]:
    if data_parallel_size is None:
        data_parallel_size = world_size // horizontal_parallel_size  # what the legacy trainer wrote (§3.3)
    return {
        "mixed_precision": mixed_precision,
        "zero_stage": zero_stage,
        "world_rank": rank,
        "world_size": world_size,
        "optimizer_name": optimizer_name,
        "data_parallel_size": data_parallel_size,
        "horizontal_parallel_size": horizontal_parallel_size,
    }


def write_checkpoint(
    path: Any,
    *,
    weights: dict[str, np.ndarray],
    optimizer: dict[str, dict[str, np.ndarray]] | None = None,
    options: dict[str, Any] | None = None,
    train_step_info: tuple[int, int] | None = (5, 20),
    partition_info: dict[str, dict[str, Any]] | None = None,
    user_dict: Any = None,
) -> None:
    """One legacy checkpoint file; the keys appear in the order ORTTrainer.state_dict() built them."""
    tree: dict[str, Any] = {"model": {"full_precision": weights}}
    if optimizer is not None:
        tree["optimizer"] = optimizer
    tree["trainer_options"] = options if options is not None else trainer_options()
    if train_step_info is not None:
        tree["train_step_info"] = {"optimization_step": train_step_info[0], "step": train_step_info[1]}
    if partition_info is not None:
        tree["partition_info"] = partition_info
    if user_dict is not None:
        tree["user_dict"] = pickle.dumps(user_dict).hex()
    with h5py.File(path, "w-") as handle:
        write_tree(handle, tree)


def linear_weights() -> dict[str, np.ndarray]:
    """The weights of an nn.Linear(4, 3), with recognisable values."""
    return {
        "fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 10,
        "fc.bias": np.array([0.5, -0.5, 1.5], dtype=np.float32),
    }


def adam_state(weights: dict[str, np.ndarray], update_count: int = 5) -> dict[str, dict[str, np.ndarray]]:
    return {
        name: {
            "Moment_1": np.full_like(value, 0.25),
            "Moment_2": np.full_like(value, 0.0625),
            "Update_Count": np.array([update_count], dtype=np.int64),
        }
        for name, value in weights.items()
    }


def lamb_state(weights: dict[str, np.ndarray], step: int = 7) -> dict[str, dict[str, np.ndarray]]:
    state: dict[str, dict[str, np.ndarray]] = {
        name: {"Moment_1": np.full_like(value, 0.5), "Moment_2": np.full_like(value, 0.125)}
        for name, value in weights.items()
    }
    state["shared_optimizer_state"] = {"Step": np.array([step], dtype=np.int64)}
    return state


def write_zero_example(directory: Any, *, mixed_precision: bool = False, prefix: str = "zero") -> list[str]:
    """The two ZeRO-1 rank files of the legacy unit test (docs/legacy_api.md §9.4 worked example).

    Full precision: weight ``optimizer_sharded`` is [1,2,3] on both ranks; its Moment_1 shards are [9,8,7] and
    [6,5,4] with original_dim [2,3]. Mixed precision: the weight itself is sharded, [1,2,3] and [4,5,6].
    """
    paths = []
    for rank in range(2):
        sharded_weight = np.array([1, 2, 3]) if not mixed_precision or rank == 0 else np.array([4, 5, 6])
        path = f"{directory}/{prefix}.rank{rank}.ortcp"
        write_checkpoint(
            path,
            weights={"optimizer_sharded": sharded_weight, "non_sharded": np.array([11, 22, 33])},
            optimizer={
                "optimizer_sharded": {
                    "Moment_1": np.array([9, 8, 7]) if rank == 0 else np.array([6, 5, 4]),
                    "Moment_2": np.array([99, 88, 77]) if rank == 0 else np.array([66, 55, 44]),
                    "Step": np.array([5]),
                },
                "non_sharded": {
                    "Moment_1": np.array([666, 555, 444]),
                    "Moment_2": np.array([6666, 5555, 4444]),
                    "Step": np.array([55]),
                },
            },
            options=trainer_options(
                rank=rank, world_size=2, zero_stage=1, mixed_precision=mixed_precision, optimizer_name="Adam"
            ),
            partition_info={"optimizer_sharded": {"original_dim": [2, 3], "megatron_row_partition": [-1]}},
            user_dict={"rank": rank} if rank == 1 else None,
        )
        paths.append(path)
    return paths
