"""The trainer's step counters, and a state loaded before there is a session to load it into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..train_step_info import TrainStepInfo


@dataclass
class StepCounters:
    """Training progress.

    `info` is the legacy `TrainStepInfo` (the trainer's `_train_step_info`): `step` counts `train_step` calls
    (micro-steps), `optimization_step` the optimizer steps that updated the weights (a skipped non-finite step under
    mixed precision does not count); users also set its `fetches`.

    `optimizer_updates` counts the updates the optimizer state has seen: the next update is number
    `optimizer_updates + 1`, which Adam's and LAMB's bias corrections use. Why a second counter: it belongs to the
    optimizer moments and is restored from their checkpoint entries (`Update_Count`, `Step`), while
    `optimization_step` is training progress restored from `train_step_info`. A checkpoint saved without optimizer
    state restores the progress (the learning-rate schedule goes on) but restarts the moments from zero, and their
    bias correction must then restart from update 1 — so the two differ after such a load.
    """

    info: TrainStepInfo
    optimizer_updates: int = 0

    @property
    def next_update(self) -> int:
        """The 1-based number of the next optimizer update (fed to the graph's update-count input)."""
        return self.optimizer_updates + 1

    def count_update(self) -> None:
        """One finite optimizer step: both counters move."""
        self.optimizer_updates += 1
        self.info.optimization_step += 1


@dataclass(frozen=True)
class PendingLoad:
    """A state handed to `load_state_dict` (or the experimental flat API, `flat=True`) before the first step: the
    trainer keeps it and applies it, with the same checks, once the session exists."""

    state: dict[str, Any]
    strict: bool
    flat: bool = False
