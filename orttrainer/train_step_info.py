"""``TrainStepInfo``: the runtime state of the current train step, shared by trainer, LR scheduler and loss scaler."""

from __future__ import annotations

from typing import Any

from ._require import require as _require
from .optim.config import _OptimizerConfig

__all__ = ["TrainStepInfo"]


class TrainStepInfo:
    r"""Runtime information about the current train step.

    The trainer keeps one instance (``ORTTrainer._train_step_info``) and updates it in place; it is passed to
    ``_LRScheduler.get_lr`` and ``LossScaler.update``.

    Args:
        optimizer_config: the trainer's :class:`orttrainer.optim._OptimizerConfig` (schedulers read its ``lr``).
        all_finite: whether the last mixed-precision step's gradients were all finite. The constructor requires a
            ``bool``; the trainer later stores the graph's one-element bool tensor here, unchecked.
        fetches: output names that ``train_step``/``eval_step`` return instead of the model's outputs; ``[]``
            (the default) restores normal behaviour. ``None`` gives each instance its own new list.
        optimization_step: number of optimizer updates done so far (int >= 0); drives the LR schedulers.
        step: number of ``train_step`` calls so far (int >= 0).

    Attributes are plain and can be reassigned freely; only the constructor validates.
    """

    def __init__(
        self,
        optimizer_config: _OptimizerConfig,
        all_finite: bool = True,
        fetches: list[str] | None = None,
        optimization_step: int = 0,
        step: int = 0,
    ) -> None:
        # Legacy defaulted to one shared `fetches=[]`, so appending to one instance's list changed every default.
        fetches = [] if fetches is None else fetches
        _require(isinstance(optimizer_config, _OptimizerConfig), "optimizer_config must be a optim._OptimizerConfig")
        _require(isinstance(all_finite, bool), "all_finite must be a bool")
        _require(
            isinstance(fetches, list) and all(isinstance(item, str) for item in fetches),
            "fetches must be a list of str",
        )
        _require(
            isinstance(optimization_step, int) and optimization_step >= 0, "optimization_step must be a positive int"
        )
        _require(isinstance(step, int) and step >= 0, "step must be a positive int")

        self.optimizer_config = optimizer_config
        # the trainer later stores the graph's one-element bool tensor here, as the original did
        self.all_finite: Any = all_finite  # a bool, or a one-element bool tensor
        self.fetches = fetches
        self.optimization_step = optimization_step
        self.step = step

    def __repr__(self) -> str:
        return (
            f"TrainStepInfo(optimizer_config={self.optimizer_config!r}, all_finite={self.all_finite!r}, "
            f"fetches={self.fetches!r}, optimization_step={self.optimization_step}, step={self.step})"
        )
