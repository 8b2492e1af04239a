"""The trainer's mutable training state, in one typed object: `TrainerState`.

Everything that changes as the trainer trains, except the tensors themselves (the session holds weights, moments and
accumulation buffers on the device, runtime/session.py), lives here: the step counters, the gradient-accumulation
window, the loss scaler under mixed precision, the dropout stream's position, and a state loaded before there is a
session to load it into. The configuration the trainer was given is `config.TrainerConfig` (frozen); what building
produced is `model.Built` (frozen).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import amp
from ..train_step_info import TrainStepInfo


@dataclass(frozen=True)
class AccumulationWindow:
    """Gradient accumulation over `steps` micro-steps (`batch.gradient_accumulation_steps`): the one place that
    decides which micro-step is an optimizer step (docs/design.md § Gradient semantics).

    Rule: micro-steps are counted from 1 (`TrainStepInfo.step` after the step); micro-step `n` ends a window, and so
    updates the weights, when `n % steps == 0`. After `n` micro-steps the window is open (`mid_window`) when the
    last one did not end it: the accumulation buffers then hold a partial sum. The buffers restart from zero after
    every optimizer step, finite or skipped (`zeroes_after`)."""

    steps: int = 1

    @property
    def accumulates(self) -> bool:
        """Whether gradients are summed over several micro-steps (accumulation buffers exist)."""
        return self.steps > 1

    def ends_at(self, step: int) -> bool:
        """Whether micro-step number `step` (1-based) is an optimizer step."""
        return step % self.steps == 0

    def mid_window(self, steps_done: int) -> bool:
        """Whether, after `steps_done` micro-steps, the buffers hold a partial sum."""
        return steps_done % self.steps != 0

    def zeroes_after(self, step: int) -> bool:
        """Whether the accumulation buffers are zeroed after micro-step `step`: after every optimizer step."""
        return self.ends_at(step)


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


def default_base_seed() -> int:
    """`1 + torch.initial_seed() mod 2**30`. Why the 1: seed 0 acts as seed 1 in ONNX Runtime's engine
    (docs/engine.md §9), so `torch.manual_seed(0)` would repeat its first mask."""
    return 1 + torch.initial_seed() % (1 << 30)


@dataclass
class DropoutStreams:
    """The trainer's dropout stream: `base` seed and the number of completed training runs per graph key.

    Rule (docs/engine.md §9): the stream starts at `base = 1 + torch.initial_seed() mod 2**30` (so
    `torch.manual_seed` makes runs repeatable), taken when the trainer is constructed, so that seeding torch again
    before its first step changes nothing. Every training graph gets per-node Dropout seeds for the position its
    stream has reached (`runtime.session.seeded`): one position per graph key — one key for a graph with dynamic
    shapes, one per input-shape signature for the torch builder's per-shape graphs, which run separate sessions. A
    training run that completes moves its key's position by one (every Dropout computes once per forward pass;
    recompute reuses the mask). The base and the positions are part of the state dict (`rng/...`); loading them
    makes the sessions be created again at the loaded positions. A model without Dropout has no stream to save
    (`active` stays False), and its state dict keeps the legacy layout."""

    base: int = field(default_factory=default_base_seed)
    positions: dict[str, int] = field(default_factory=dict)
    active: bool = False  # a training graph with Dropout nodes was seeded: the stream is part of the state

    def advance(self, key: str) -> None:
        """One completed training run of the graph for `key`."""
        self.positions[key] = self.positions.get(key, 0) + 1

    def state(self) -> dict[str, Any]:
        """The state dict entry: `{'seed': base, 'positions': {key: runs}}`."""
        return {"seed": self.base, "positions": dict(self.positions)}

    @staticmethod
    def parsed(saved: dict[str, Any]) -> tuple[int, dict[str, int]]:
        """The base and positions of a saved entry (`state()`); ValueError naming what is malformed."""
        try:
            base = _count(saved["seed"])
            positions = {_text(k): _count(v) for k, v in dict(saved.get("positions", {})).items()}
        except (KeyError, TypeError, ValueError) as err:
            expected = "{'seed': int, 'positions': {graph key: int}}"
            raise ValueError(
                f"state_dict[rng] is malformed ({type(err).__name__}: {err}); expected {expected}"
            ) from err
        return base, positions

    def adopt(self, base: int, positions: dict[str, int]) -> bool:
        """Take a parsed entry; returns whether anything changed (the sessions must then be created again)."""
        changed = (base, positions) != (self.base, self.positions)
        self.base, self.positions = base, dict(positions)
        return changed

    def load(self, saved: dict[str, Any]) -> bool:
        """`adopt(*parsed(saved))`."""
        return self.adopt(*self.parsed(saved))


@dataclass
class TrainerState:
    """What changes as the trainer trains (module docstring).

    `loss_scaler` is the options' own `LossScaler` object under mixed precision (users read its `loss_scale`
    through `trainer.options`, as in the original), else None. `lock` serialises what reads or changes the state:
    one trainer used from several threads runs their steps one after another, never interleaved."""

    counters: StepCounters
    window: AccumulationWindow
    loss_scaler: amp.LossScaler | None = None
    streams: DropoutStreams = field(default_factory=DropoutStreams)
    pending: PendingLoad | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)  # held by every step, load and save

    def learning_rate(self, base_lr: float, scheduler: Any) -> float:
        """This step's learning rate: the scheduler's for the current progress, else the optimizer config's."""
        if scheduler is None:
            return float(base_lr)
        return float(scheduler._step(self.counters.info)[0])


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _count(value: object) -> int:
    """A non-negative integer read from a state dict (a Python or numpy integer, or a one-element array of one)."""
    array = np.asarray(value)
    if array.size != 1 or not np.issubdtype(array.dtype, np.integer) or int(array.reshape(-1)[0]) < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return int(array.reshape(-1)[0])


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Run the block with Python's signal handlers deferred: a KeyboardInterrupt (SIGINT), or any handler that
    raises, runs only when the block is done. Why: a step, or a load, changes several parts of the state; an
    exception between two of them would leave a state no run of the trainer produces (docs/design.md § Failure
    atomicity). The deferred handlers then run in the order their signals came, so the interrupt still happens,
    after the change is complete. Python runs signal handlers in the main thread only, so a block run elsewhere
    needs nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, Any]] = []
    saved: dict[int, Any] = {}
    for number in signal.valid_signals():
        handler = signal.getsignal(number)
        if callable(handler):
            saved[number] = handler
            signal.signal(number, lambda received, frame: pending.append((received, frame)))
    try:
        yield
    finally:
        for restored, handler in saved.items():
            signal.signal(restored, handler)
        for received, frame in pending:
            saved[received](received, frame)
