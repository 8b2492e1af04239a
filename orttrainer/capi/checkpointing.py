"""The older API's checkpoint helpers (docs/legacy_api.md §14.4 module functions, §9.5 `checkpointing_utils`).

Files are `torch.save` pickles of `{'model': trainer.state_dict(), **checkpoint_state_dict}` named by
`get_checkpoint_name`: `<prefix>.ort.pt`, or `<prefix>.ZeRO.<rank>.<world_size-1>.ort.pt` with ZeRO. They are the
same files as the new API's `checkpoint.experimental_*` functions write, and the work is theirs
(`checkpoint/experimental.py`), without their deprecation warnings. Load only checkpoints you trust (pickle).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..checkpoint import experimental as flat

if TYPE_CHECKING:  # both import onnxruntime; the functions here import the trainer when called
    from ..trainer import ORTTrainer as NewORTTrainer
    from .ort_trainer import ORTTrainer


def get_checkpoint_name(
    prefix: str, is_partitioned: Any, world_rank: int | None = None, world_size: int | None = None
) -> str:
    """`<prefix>.ZeRO.<world_rank>.<world_size-1>.ort.pt` when partitioned, else `<prefix>.ort.pt`."""
    return flat._get_checkpoint_name(prefix, is_partitioned, world_rank, world_size)


def list_checkpoint_files(checkpoint_dir: str, checkpoint_prefix: str, extension: str = ".ort.pt") -> list[str]:
    """Paths in `checkpoint_dir` starting with the prefix and ending in `extension`, in rank order."""
    try:
        return flat._list_checkpoint_files(checkpoint_dir, checkpoint_prefix, extension)
    except AssertionError:
        raise AssertionError(
            f'No checkpoint files found with prefix "{checkpoint_prefix}" in directory {checkpoint_dir}.'
        ) from None


class CombineZeroCheckpoint(flat._CombineZeroCheckpoint):
    """Merge the per-rank ZeRO files into one flat state (`_CombineZeroCheckpoint`, without its deprecation)."""

    def aggregate_checkpoints(self) -> dict[str, Any]:
        """Load every rank's file and return the combined flat ``{name: tensor}`` state."""
        return self._aggregate_files()


def save_checkpoint(
    model: ORTTrainer,
    checkpoint_dir: str,
    checkpoint_prefix: str = "ORT_checkpoint",
    checkpoint_state_dict: dict | None = None,
    include_optimizer_state: bool = True,
) -> None:
    """Write `model.state_dict()` plus `checkpoint_state_dict` (not modified) into `checkpoint_dir`, atomically."""
    trainer = _new_trainer(model)
    if not os.path.isdir(checkpoint_dir):
        raise AssertionError(f"ERROR: Checkpoint directory doesn't exist: {checkpoint_dir}")
    flat._save_flat_checkpoint(
        trainer, checkpoint_dir, checkpoint_prefix, checkpoint_state_dict, include_optimizer_state
    )


def load_checkpoint(
    model: ORTTrainer,
    checkpoint_dir: str,
    checkpoint_prefix: str = "ORT_checkpoint",
    strict: bool = False,
    *,
    trusted: bool = False,
) -> dict[str, Any]:
    """Load the prefix's checkpoint (several ZeRO files are combined) into `model`; returns the saved extra state
    (everything but `'model'`). Plain data only, unless `trusted=True` (the files are torch.save pickles: a crafted
    one could run code, so other objects load only from files you trust)."""
    return flat._load_flat_checkpoint(_new_trainer(model), checkpoint_dir, checkpoint_prefix, strict, trusted=trusted)


def _new_trainer(model: Any) -> NewORTTrainer:
    from .ort_trainer import ORTTrainer

    if not isinstance(model, ORTTrainer):
        raise TypeError(
            f"model must be an onnxruntime.capi.ort_trainer.ORTTrainer (orttrainer.capi.ORTTrainer), "
            f"got {type(model).__name__}; for orttrainer.ORTTrainer use its save_checkpoint/"
            "load_checkpoint or orttrainer.checkpoint.experimental_*"
        )
    return model.ort_trainer
