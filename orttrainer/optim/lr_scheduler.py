"""Learning-rate schedulers: ``lr(step)`` as small objects, evaluated by the trainer before every optimizer step.

A scheduler reads ``train_step_info.optimization_step`` (``s``) and the base learning rate
``train_step_info.optimizer_config.lr`` (``lr0``) and returns ``[lr0 * f(s)]``. Every schedule starts with the
same linear warm-up over ``n_w = warmup * total_steps`` steps (a float)::

    f(s) = s / max(1, n_w)        for s < n_w

Formulas and validation follow the legacy ``onnxruntime.training.optim.lr_scheduler`` (release 1.13.1), including
the positional order of the constructor arguments (``CosineWarmupLRScheduler(10, 0.5)`` sets ``cycles``,
``PolyWarmupLRScheduler(10, 0.5)`` sets ``lr_end``). Two legacy defects are fixed: the warm-up error message now
states the range that is actually accepted, ``[0, 1)``, and the poly scheduler's ``lr0 > lr_end`` check raises an
``AssertionError`` naming both values instead of a ``NameError``.
"""

from __future__ import annotations

import math
from typing import Any

from .._require import require as _require

__all__ = [
    "_LRScheduler",
    "ConstantWarmupLRScheduler",
    "CosineWarmupLRScheduler",
    "LinearWarmupLRScheduler",
    "PolyWarmupLRScheduler",
]


def _check_total_steps_and_warmup(total_steps: Any, warmup: Any) -> None:
    _require(isinstance(total_steps, int) and total_steps > 0, "total_steps must be a strict positive number")
    # Legacy said "(0, 1]" here, but 0.0 is accepted and 1.0 is not; an int (even 0) is rejected.
    _require(isinstance(warmup, float) and 0 <= warmup < 1, "warmup must be a float in the range [0, 1)")


def _check_total_steps_greater_than_warmup(total_steps: int, warmup: float) -> None:
    # Always true once the checks above passed (total_steps >= 1 > warmup); kept for parity with the legacy API.
    _require(total_steps > warmup, "total_steps must be greater than warmup")


class _LRScheduler:
    r"""Base class of learning-rate schedulers.

    Subclasses implement :meth:`get_lr`, which must return a one-element list ``[lr]`` (per-group learning rates
    are not supported). The trainer calls :meth:`_step` once per optimizer step and feeds ``_step(info)[0]`` to the
    graph; :meth:`get_last_lr` returns what the last call computed.
    """

    def __init__(self) -> None:
        self._last_lr: list[float] = []

    def _step(self, train_step_info: Any) -> list[float]:
        """Compute the learning rate for ``train_step_info``, remember it and return it."""
        new_lr = self.get_lr(train_step_info)
        self._last_lr = new_lr
        return new_lr

    def get_lr(self, train_step_info: Any) -> list[float]:
        """Return ``[lr]`` for ``train_step_info`` (a :class:`orttrainer.TrainStepInfo`)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """Return the list computed by the last :meth:`_step` (``[]`` before the first)."""
        return self._last_lr


class _WarmupLRScheduler(_LRScheduler):
    """Shared state and warm-up phase of the concrete schedulers (not part of the legacy API)."""

    def __init__(self, total_steps: int, warmup: float) -> None:
        super().__init__()
        self.total_steps = total_steps
        self.warmup = warmup
        self._num_warmup_steps = warmup * total_steps

    def _in_warmup(self, step: int) -> bool:
        return step < self._num_warmup_steps

    def _warmup_factor(self, step: int) -> float:
        """``f(s) = s / max(1, n_w)``."""
        return float(step) / float(max(1, self._num_warmup_steps))

    def _factor(self, train_step_info: Any) -> float:
        raise NotImplementedError

    def get_lr(self, train_step_info: Any) -> list[float]:
        """``[lr0 * f(s)]``, with ``f`` given by the subclass."""
        return [train_step_info.optimizer_config.lr * self._factor(train_step_info)]


class ConstantWarmupLRScheduler(_WarmupLRScheduler):
    r"""Linear warm-up, then constant.

    ``f(s) = s / max(1, n_w)`` for ``s < n_w``, else ``1.0``; ``n_w = warmup * total_steps``.

    Args:
        total_steps: total number of optimizer steps (int > 0).
        warmup: fraction of ``total_steps`` spent warming up (float in ``[0, 1)``).
    """

    def __init__(self, total_steps: int, warmup: float = 0.002) -> None:
        _check_total_steps_and_warmup(total_steps, warmup)
        _check_total_steps_greater_than_warmup(total_steps, warmup)
        super().__init__(total_steps, warmup)

    def _factor(self, train_step_info: Any) -> float:
        step = train_step_info.optimization_step
        return self._warmup_factor(step) if self._in_warmup(step) else 1.0


class CosineWarmupLRScheduler(_WarmupLRScheduler):
    r"""Linear warm-up, then cosine decay.

    For ``s >= n_w``::

        progress = (s - n_w) / max(1, total_steps - n_w)
        f(s) = max(0, 0.5 * (1 + cos(pi * cycles * 2 * progress)))

    Args:
        total_steps: total number of optimizer steps (int > 0).
        cycles: number of cosine waves (float > 0); 0.5 decays from ``lr0`` to 0 over the run.
        warmup: fraction of ``total_steps`` spent warming up (float in ``[0, 1)``). Note the argument order:
            the second positional argument is ``cycles``.
    """

    def __init__(self, total_steps: int, cycles: float = 0.5, warmup: float = 0.002) -> None:
        _require(isinstance(total_steps, int) and total_steps > 0, "total_steps must be a strict positive number")
        _require(isinstance(cycles, float) and cycles > 0, "cycles must be a positive float")
        _check_total_steps_and_warmup(total_steps, warmup)
        _check_total_steps_greater_than_warmup(total_steps, warmup)
        super().__init__(total_steps, warmup)
        self.cycles = cycles

    def _factor(self, train_step_info: Any) -> float:
        step = train_step_info.optimization_step
        if self._in_warmup(step):
            return self._warmup_factor(step)
        progress = float(step - self._num_warmup_steps) / float(max(1, self.total_steps - self._num_warmup_steps))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(self.cycles) * 2.0 * progress)))


class LinearWarmupLRScheduler(_WarmupLRScheduler):
    r"""Linear warm-up, then linear decay to 0 at ``total_steps``.

    For ``s >= n_w``: ``f(s) = max(0, (total_steps - s) / max(1, total_steps - n_w))``.

    Args:
        total_steps: total number of optimizer steps (int > 0).
        warmup: fraction of ``total_steps`` spent warming up (float in ``[0, 1)``).
    """

    def __init__(self, total_steps: int, warmup: float = 0.002) -> None:
        _check_total_steps_and_warmup(total_steps, warmup)
        _check_total_steps_greater_than_warmup(total_steps, warmup)
        super().__init__(total_steps, warmup)

    def _factor(self, train_step_info: Any) -> float:
        step = train_step_info.optimization_step
        if self._in_warmup(step):
            return self._warmup_factor(step)
        remaining = float(self.total_steps - step) / float(max(1, self.total_steps - self._num_warmup_steps))
        return max(0.0, remaining)


class PolyWarmupLRScheduler(_WarmupLRScheduler):
    r"""Linear warm-up, then polynomial decay from ``lr0`` to ``lr_end``.

    For ``n_w <= s <= total_steps`` (note: a plain ``total_steps - n_w`` denominator, no ``max(1, ...)``)::

        f(s) = ((lr0 - lr_end) * (1 - (s - n_w) / (total_steps - n_w)) ** power + lr_end) / lr0

    and ``f(s) = lr_end / lr0`` for ``s > total_steps``, so the learning rate stays at ``lr_end``.

    Args:
        total_steps: total number of optimizer steps (int > 0).
        lr_end: final learning rate (float >= 0); must be smaller than the optimizer's ``lr``.
        power: polynomial degree (float >= 0).
        warmup: fraction of ``total_steps`` spent warming up (float in ``[0, 1)``). Note the argument order:
            the second positional argument is ``lr_end``.

    Raises:
        AssertionError: from :meth:`get_lr` when the optimizer's ``lr`` is not greater than ``lr_end``.
    """

    def __init__(self, total_steps: int, lr_end: float = 1e-7, power: float = 1.0, warmup: float = 0.002) -> None:
        _require(isinstance(total_steps, int) and total_steps > 0, "total_steps must be a strict positive number")
        _require(isinstance(lr_end, float) and lr_end >= 0, "lr_end must be a positive float")
        _check_total_steps_and_warmup(total_steps, warmup)
        _require(isinstance(power, float) and power >= 0, "power must be a positive float")
        _check_total_steps_greater_than_warmup(total_steps, warmup)
        super().__init__(total_steps, warmup)
        self.lr_end = lr_end
        self.power = power

    def _factor(self, train_step_info: Any) -> float:
        lr0 = train_step_info.optimizer_config.lr
        # Legacy formatted this message with an undefined name and so raised NameError instead.
        _require(lr0 > self.lr_end, f"lr_end ({self.lr_end}) must be smaller than initial lr ({lr0})")
        step = train_step_info.optimization_step
        if self._in_warmup(step):
            return self._warmup_factor(step)
        if step > self.total_steps:
            return self.lr_end / lr0
        pct_remaining = 1 - (step - self._num_warmup_steps) / (self.total_steps - self._num_warmup_steps)
        decay = (lr0 - self.lr_end) * pct_remaining**self.power + self.lr_end
        return decay / lr0
