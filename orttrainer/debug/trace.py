"""The activations a ``StatisticsSubscriber`` would dump for a model, in dump order, without writing anything.

This is the hand-over to collection paths that do not run the PyTorch hooks (the ONNX Runtime trainer): trace the
model once, then for each step in the subscriber's range compute the statistics of each record's value elsewhere
and write them with ``StatisticsSubscriber.dump`` (or ``write_statistics``) in record order. The resulting files
and order.txt then match a plain-PyTorch run name for name and line for line.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ._tap import tap
from .statistics_subscriber import activation_file_name, module_activation_name
from .subscriber import RuntimeStates, SubscriberBase, SubscriberManager, exclusive, map_tensors


@dataclasses.dataclass(frozen=True)
class ActivationRecord:
    """One dump: ``file_name`` is the order.txt line; module fields are ``None`` for ``inspect_activation``.

    ``module_path`` is the qualified name in the model (``""`` for the root, ``"block.lin"``), ``tensor_index``
    the position among the module's flattened output tensors, ``call`` the module's call number in the step.
    """

    name: str
    direction: str
    depth: int
    module_index: int | None
    module_path: str | None
    module_class: str | None
    tensor_index: int | None
    call: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def file_name(self) -> str:
        """``<name>_<direction>``: the statistics file and its order.txt line."""
        return activation_file_name(self.name, self.direction)


class RecordingSubscriber(SubscriberBase):
    """Records what ``StatisticsSubscriber`` would dump (same names, depths and order), computing nothing."""

    def __init__(self, start_step: int | None = None, end_step: int | None = None) -> None:
        super().__init__(start_step, end_step)
        self.records: list[ActivationRecord] = []

    def post_forward_tensor_apply_impl(
        self, run_ctx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: torch.Tensor
    ) -> torch.Tensor:
        """Record the output tensor now and its gradient in backward, as ``StatisticsSubscriber`` would dump them."""
        states = run_ctx.global_states
        index = states.module_to_module_index[module]
        call = states.module_call_count.get(index, 1)
        name = module_activation_name(type(module).__name__, index, tensor_index, call)
        details = dict(
            module_index=index,
            module_path=states.module_index_to_path[index],
            module_class=type(module).__name__,
            tensor_index=tensor_index,
            call=call,
        )
        return self._tap(name, states.module_index_to_depth[index], details, tensor)

    def inspect_activation_apply_impl(self, run_ctx: RuntimeStates, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Record an ``inspect_activation`` tensor (no module fields) and, in backward, its gradient."""
        details = dict(module_index=None, module_path=None, module_class=None, tensor_index=None, call=None)
        return self._tap(name, -1, details, tensor)

    def _tap(self, name: str, depth: int, details: dict[str, Any], tensor: torch.Tensor) -> torch.Tensor:
        def record(direction: str) -> Callable[[torch.Tensor], None]:
            return lambda value: self.records.append(
                ActivationRecord(
                    name=name, direction=direction, depth=depth, shape=tuple(value.shape), dtype=value.dtype, **details
                )
            )

        return tap(tensor, record("forward"), record("backward"))


def trace_activations(
    model: torch.nn.Module,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    backward: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> list[ActivationRecord]:
    """Run ``model(*args, **kwargs)`` once (and a backward) and return its dumps in order.txt order.

    The backward differentiates ``loss_fn(outputs)`` (default: the sum of all floating output tensors) with respect
    to every leaf that requires grad, through ``torch.autograd.grad``, so no ``.grad`` is touched. Other managers
    subscribed to ``model`` are paused (no files, no step counted); buffers (e.g. BatchNorm statistics) and the RNG
    state are restored afterwards, so tracing does not change the training run.
    """
    recorder = RecordingSubscriber()
    manager = SubscriberManager()
    with exclusive(manager), _preserved(model):
        manager.subscribe(model, [recorder])
        try:
            outputs = model(*args, **(kwargs or {}))
            if backward:
                _differentiate(loss_fn(outputs) if loss_fn is not None else _sum_outputs(outputs), model, args, kwargs)
        finally:
            manager.unsubscribe()
    return recorder.records


def order_for_step(records: Sequence[ActivationRecord], subscriber: SubscriberBase, step: int) -> list[str]:
    """The order.txt lines ``subscriber`` writes in ``step``: all records inside its step range, none outside."""
    return [record.file_name for record in records] if subscriber.in_range(step) else []


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def keep(_: int, tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(value, keep)
    return found


def _sum_outputs(outputs: Any) -> torch.Tensor | None:
    parts = [t.float().sum() for t in _tensors(outputs) if t.requires_grad and t.is_floating_point()]
    return torch.stack(parts).sum() if parts else None


def _differentiate(loss: torch.Tensor | None, model: torch.nn.Module, args: Any, kwargs: Any) -> None:
    if loss is None or not loss.requires_grad:
        return
    leaves: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    leaves += [t for t in _tensors((args, kwargs)) if t.requires_grad and t.is_leaf]
    if leaves:
        torch.autograd.grad(loss, leaves, allow_unused=True)


@contextlib.contextmanager
def _preserved(model: torch.nn.Module) -> Iterator[None]:
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, buf in model.named_buffers():
                    if name in buffers:
                        buf.copy_(buffers[name])
