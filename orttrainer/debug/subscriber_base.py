"""The subscriber callbacks and the run context they receive (the manager that calls them: ``subscriber.py``).

A subscriber acts only in the steps of its half-open range ``[start_step, end_step)``. For every hook the manager
calls the public ``*_apply`` method, which checks the range and then runs the matching ``*_impl`` method; a subclass
overrides the ``*_impl`` methods it needs (the base ones pass values through). The manager registers input hooks only
when some subscriber overrides a ``pre_forward_*_impl``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch


@dataclasses.dataclass
class GlobalStates:
    """Per-manager state. Names follow the legacy ``RuntimeStates.global_states``; the last four are new."""

    execution_step: int = 0
    module_index_to_depth: dict[int, int] = dataclasses.field(default_factory=dict)
    module_to_module_index: dict[torch.nn.Module, int] = dataclasses.field(default_factory=dict)
    module_index_to_path: dict[int, str] = dataclasses.field(default_factory=dict)
    module_call_count: dict[int, int] = dataclasses.field(default_factory=dict)  # calls in the current step
    inspected_names: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> first call site, this step
    root_nesting: int = 0


class RuntimeStates:
    """The run context handed to every subscriber callback."""

    def __init__(self) -> None:
        self.global_states = GlobalStates()


class SubscriberBase:
    """Base of all subscribers: callbacks that run only for steps in ``[start_step, end_step)``.

    ``None`` start means 0 and ``None`` end means ``sys.maxsize``. Each public ``*_apply`` method checks the range
    and calls the matching ``*_impl`` (no-ops here) or returns its inputs unchanged. Override the ``*_impl``.
    """

    def __init__(self, start_step: int | None, end_step: int | None) -> None:
        self._start_step = _step_bound(start_step, 0, "start_step")
        self._end_step = _step_bound(end_step, sys.maxsize, "end_step")
        if self._end_step < self._start_step:
            raise ValueError(f"end_step ({end_step}) must not be smaller than start_step ({start_step})")

    @property
    def start_step(self) -> int:
        """First step this subscriber acts in."""
        return self._start_step

    @property
    def end_step(self) -> int:
        """First step it no longer acts in (``sys.maxsize`` when unbounded)."""
        return self._end_step

    def in_range(self, step: int) -> bool:
        """Whether ``step`` is in the half-open range ``[start_step, end_step)``."""
        return self._start_step <= step < self._end_step

    def pre_forward_module_apply(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        """Before ``module.forward``: may replace its ``(args, kwargs)``; runs ``pre_forward_module_apply_impl``."""
        if not self.in_range(run_ctx.global_states.execution_step):
            return args, kwargs
        return self.pre_forward_module_apply_impl(run_ctx, module, args, kwargs)

    def pre_forward_tensor_apply(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: torch.Tensor
    ) -> torch.Tensor:
        """Before ``module.forward``: may replace one input tensor (positional and keyword inputs are numbered
        separately, each from 0); runs ``pre_forward_tensor_apply_impl``."""
        if not self.in_range(run_ctx.global_states.execution_step):
            return tensor
        return self.pre_forward_tensor_apply_impl(run_ctx, module, tensor_index, tensor)

    def post_forward_module_apply(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, args: Any, outputs: Any
    ) -> tuple[Any, Any]:
        """After ``module.forward``: may replace ``(args, outputs)``; runs ``post_forward_module_apply_impl``."""
        if not self.in_range(run_ctx.global_states.execution_step):
            return args, outputs
        return self.post_forward_module_apply_impl(run_ctx, module, args, outputs)

    def post_forward_tensor_apply(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: torch.Tensor
    ) -> torch.Tensor:
        """After ``module.forward``: may replace one output tensor (numbered depth first); runs
        ``post_forward_tensor_apply_impl``."""
        if not self.in_range(run_ctx.global_states.execution_step):
            return tensor
        return self.post_forward_tensor_apply_impl(run_ctx, module, tensor_index, tensor)

    def post_forward_outmost_module_apply(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, args: Any, outputs: Any
    ) -> tuple[Any, Any]:
        """After the root module's outermost forward, before the step ends; runs
        ``post_forward_outmost_module_apply_impl``."""
        if not self.in_range(run_ctx.global_states.execution_step):
            return args, outputs
        return self.post_forward_outmost_module_apply_impl(run_ctx, module, args, outputs)

    def inspect_activation_apply(self, run_ctx: RuntimeStates, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Called by ``inspect_activation`` (new: the legacy code bypassed the step range there)."""
        if not self.in_range(run_ctx.global_states.execution_step):
            return tensor
        return self.inspect_activation_apply_impl(run_ctx, name, tensor)

    def pre_forward_module_apply_impl(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        """Override to change a module's inputs as a whole; returns ``(args, kwargs)`` unchanged here."""
        return args, kwargs

    def pre_forward_tensor_apply_impl(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: torch.Tensor
    ) -> torch.Tensor:
        """Override to observe or replace one input tensor; returns it unchanged here."""
        return tensor

    def post_forward_module_apply_impl(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, args: Any, outputs: Any
    ) -> tuple[Any, Any]:
        """Override to change a module's outputs as a whole; returns ``(args, outputs)`` unchanged here."""
        return args, outputs

    def post_forward_tensor_apply_impl(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: torch.Tensor
    ) -> torch.Tensor:
        """Override to observe or replace one output tensor; returns it unchanged here."""
        return tensor

    def post_forward_outmost_module_apply_impl(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, args: Any, outputs: Any
    ) -> tuple[Any, Any]:
        """Override to act once per step on the root's outputs; returns ``(args, outputs)`` unchanged here."""
        return args, outputs

    def inspect_activation_apply_impl(self, run_ctx: RuntimeStates, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Override to handle ``inspect_activation`` tensors (this is what makes a subscriber an inspection
        handler); returns the tensor unchanged here."""
        return tensor


def _step_bound(value: int | None, default: int, what: str) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int or None, got {value!r}")
    return value
