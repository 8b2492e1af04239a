"""Subscribers and the manager that runs them from ``nn.Module`` hooks.

``SubscriberManager.subscribe(model, subscribers)`` indexes every module of ``model`` by a pre-order DFS over
``children()`` (root 0, depth 1; a module reachable twice keeps its first index and is hooked once) and registers
a forward hook on each; with it, every subscriber sees every module's outputs. One **step** is one completed
forward of the root module (train or eval, with or without grad; backward never counts). The step counter starts
at 0 and is shared by all subscribers of a manager.

Decisions that differ from the legacy ORT manager (``docs/debugging.md`` §1):

* ``subscribe()`` first removes every hook this manager registered before, so subscribing the same model twice
  replaces the hooks instead of doubling them (legacy: duplicated dumps and a step counter moving by 2); subscribing
  another model detaches the previous one. The arguments are validated before anything is reset.
* Subscribers run in the order given (legacy kept them in a set, so the order followed hash order).
* A module called several times in one step names its outputs per call: the first call keeps the legacy name,
  later ones add ``_call<c>`` (legacy overwrote the file and listed the name twice in order.txt).
* Values other than tensors, lists, tuples and dicts in module inputs/outputs are passed through untouched
  (legacy raised ``TypeError: Unsupported flatten data type``); no ``module.id`` attribute is set.
* A forward that raises does not count as a step. Forwards re-run inside backward (activation checkpointing)
  are not dumped again; with ``use_reentrant=True`` checkpointing the checkpointed region gets no backward files
  (its first forward ran without grad).
* ``no_increase_global_step()`` suspends all managers: no dumps and no step counting (used while exporting).

Collection paths that run the model elsewhere (the ONNX Runtime trainer) find the managers subscribed to a model
with ``managers_of(model)`` and end each step they run with ``advance_step()``, as a root forward does here.

The subscriber callbacks (``SubscriberBase``) receive the run context (``RuntimeStates``). A subscriber acts only in
the steps of its half-open range ``[start_step, end_step)``. For every hook the manager calls the public ``*_apply``
method, which checks the range and then runs the matching ``*_impl`` method; a subclass overrides the ``*_impl``
methods it needs (the base ones pass values through). The manager registers input hooks only when some subscriber
overrides a ``pre_forward_*_impl``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, cast

import torch

__all__ = [
    "GlobalStates",
    "GlobalSubscriberManager",
    "RuntimeStates",
    "SubscriberBase",
    "SubscriberManager",
    "current_manager",
    "exclusive",
    "managers_of",
    "map_tensors",
    "no_increase_global_step",
]


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


_GATE: dict[str, Any] = {"suspended": 0, "exclusive": None}
_ACTIVE: list[SubscriberManager] = []  # managers whose root forward is running, innermost last
_MANAGERS: weakref.WeakSet[SubscriberManager] = weakref.WeakSet()  # every manager constructed (copies are not)
WATCHED: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[SubscriberManager]] = weakref.WeakKeyDictionary()
"""The modules that managers subscribe now, with those managers: a test cheap enough for code that runs every step
(ORTTrainer skips its statistics bookkeeping for a model no manager watches, trainer/activations.py)."""


def _current_graph_task_id() -> int:
    # -1 outside autograd's backward; torch has no public way to ask (checked on torch 2.1-2.13).
    getter = getattr(torch._C, "_current_graph_task_id", None)
    return getter() if getter is not None else -1


def _overrides(subscriber: SubscriberBase, method: str) -> bool:
    return getattr(type(subscriber), method) is not getattr(SubscriberBase, method)


class SubscriberManager:
    """Registers hooks on one model at a time and runs its subscribers, in order, at every module forward."""

    def __init__(self) -> None:
        self._run_ctx = RuntimeStates()
        self._subscribers: tuple[SubscriberBase, ...] = ()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._module: torch.nn.Module | None = None
        _MANAGERS.add(self)

    @property
    def subscribers(self) -> tuple[SubscriberBase, ...]:
        """The subscribers, in the order they run."""
        return self._subscribers

    @property
    def module(self) -> torch.nn.Module | None:
        """The subscribed root module, ``None`` before ``subscribe`` or after ``unsubscribe``."""
        return self._module

    def get_run_context(self) -> RuntimeStates:
        """The run context (step counter and module index) handed to the subscribers."""
        return self._run_ctx

    def get_subscriber(self, subscriber_type: type) -> SubscriberBase:
        """The first subscriber that is an instance of ``subscriber_type``; ``RuntimeError`` when there is none."""
        for subscriber in self._subscribers:
            if isinstance(subscriber, subscriber_type):
                return subscriber
        raise RuntimeError(f"Subscriber with type {subscriber_type} is not registered.")

    def subscribe(self, module: torch.nn.Module, subscribers: Sequence[SubscriberBase]) -> None:
        """Hook ``module`` and all its sub-modules; replaces whatever this manager subscribed before.

        The step counter restarts at 0. Duplicate subscriber objects are kept once, at their first position.
        """
        if not isinstance(module, torch.nn.Module):
            raise ValueError("module must be a torch.nn.Module instance")
        if not subscribers:
            raise RuntimeError("No subscribers are registered.")
        for subscriber in subscribers:
            if not isinstance(subscriber, SubscriberBase):
                raise ValueError("subscriber must be a SubscriberBase instance")
        self.unsubscribe()
        self._subscribers = tuple(dict.fromkeys(subscribers))
        self._module = module
        WATCHED.setdefault(module, weakref.WeakSet()).add(self)
        self._index_modules(module)
        self._register_hooks(module)

    def unsubscribe(self) -> None:
        """Remove every hook this manager registered and forget its subscribers and state."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._subscribers = ()
        module = self._module
        watchers = WATCHED.get(module) if module is not None else None
        if module is not None and watchers is not None:
            watchers.discard(self)
            if not watchers:
                del WATCHED[module]
        self._module = None
        self._run_ctx = RuntimeStates()

    def is_live(self) -> bool:
        """Whether hooks act now: not inside ``no_increase_global_step``, another manager's exclusive trace, or a
        backward pass (activation checkpointing re-runs forwards there; they were dumped the first time)."""
        exclusive = _GATE["exclusive"]
        allowed = self is exclusive if exclusive is not None else not _GATE["suspended"]
        return allowed and _current_graph_task_id() == -1

    def advance_step(self) -> None:
        """End the current step: the counter moves on and per-step bookkeeping (call counts, names) restarts."""
        states = self._run_ctx.global_states
        states.execution_step += 1
        states.module_call_count.clear()
        states.inspected_names.clear()

    def inspect(self, name: str, tensor: torch.Tensor, call_site: str) -> torch.Tensor:
        """Route one ``inspect_activation`` call to the subscribers that handle it (see ``inspect.py``)."""
        if not self.is_live():  # suspended (export, another manager's trace): pass through, nothing checked
            return tensor
        handlers = [s for s in self._subscribers if _overrides(s, "inspect_activation_apply_impl")]
        if not handlers:
            raise RuntimeError("StatisticsSubscriber is not registered, cannot inspect activation.")
        self._check_unique(name, call_site)
        for subscriber in handlers:
            tensor = subscriber.inspect_activation_apply(self._run_ctx, name, tensor)
        return tensor

    def _check_unique(self, name: str, call_site: str) -> None:
        # Checked in every step, in range or not, so a clash fails at the first step rather than when dumping starts.
        states = self._run_ctx.global_states
        first = states.inspected_names.get(name)
        if first is None:
            states.inspected_names[name] = call_site
        else:
            raise ValueError(
                f"inspect_activation name {name!r} is used twice in step {states.execution_step}: first at {first}, "
                f"again at {call_site}. Each name is one file per step, so names must be unique within a step "
                "(for a block used several times, put its index into the name)."
            )

    # ------------------------------------------------------------------------------------------- registration

    def _index_modules(self, root: torch.nn.Module) -> None:
        states = self._run_ctx.global_states
        stack: list[tuple[torch.nn.Module, int, str]] = [(root, 1, "")]
        while stack:  # pre-order DFS; children pushed reversed so the first child is visited first
            module, depth, path = stack.pop()
            if module in states.module_to_module_index:
                continue
            index = len(states.module_to_module_index)
            states.module_to_module_index[module] = index
            states.module_index_to_depth[index] = depth
            states.module_index_to_path[index] = path
            children = [
                (child, depth + 1, f"{path}.{name}" if path else name) for name, child in module.named_children()
            ]
            stack.extend(reversed(children))

    def _register_hooks(self, root: torch.nn.Module) -> None:
        wants_inputs = any(
            _overrides(s, "pre_forward_module_apply_impl") or _overrides(s, "pre_forward_tensor_apply_impl")
            for s in self._subscribers
        )
        self._handles.append(root.register_forward_pre_hook(self._root_pre_hook))
        for module in self._run_ctx.global_states.module_to_module_index:
            if wants_inputs:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook))
        # Registered after the root's own post-hook, so the root outputs are dumped before the step moves on.
        self._handles.append(root.register_forward_hook(self._root_post_hook))
        self._handles.append(root.register_forward_hook(self._root_exit_hook, always_call=True))

    # --------------------------------------------------------------------------------------------------- hooks

    def _root_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self.is_live():
            _ACTIVE.append(self)
            self._run_ctx.global_states.root_nesting += 1

    def _pre_hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if not self.is_live():
            return None
        for subscriber in self._subscribers:
            args, kwargs = subscriber.pre_forward_module_apply(self._run_ctx, module, args, kwargs)

        def apply(index: int, tensor: torch.Tensor) -> torch.Tensor:
            for subscriber in self._subscribers:
                tensor = subscriber.pre_forward_tensor_apply(self._run_ctx, module, index, tensor)
            return tensor

        # Positional and keyword tensors are numbered separately, each from 0 (legacy behaviour).
        return map_tensors(args, apply), map_tensors(kwargs, apply)

    def _post_hook(self, module: torch.nn.Module, args: Any, outputs: Any) -> Any:
        if not self.is_live():
            return None
        states = self._run_ctx.global_states
        index = states.module_to_module_index[module]
        states.module_call_count[index] = states.module_call_count.get(index, 0) + 1
        for subscriber in self._subscribers:
            args, outputs = subscriber.post_forward_module_apply(self._run_ctx, module, args, outputs)

        def apply(tensor_index: int, tensor: torch.Tensor) -> torch.Tensor:
            for subscriber in self._subscribers:
                tensor = subscriber.post_forward_tensor_apply(self._run_ctx, module, tensor_index, tensor)
            return tensor

        return map_tensors(outputs, apply)

    def _root_post_hook(self, module: torch.nn.Module, args: Any, outputs: Any) -> Any:
        states = self._run_ctx.global_states
        if not self.is_live() or states.root_nesting != 1:  # only the outermost call of the root ends a step
            return None
        for subscriber in self._subscribers:
            args, outputs = subscriber.post_forward_outmost_module_apply(self._run_ctx, module, args, outputs)
        self.advance_step()
        return outputs

    def _root_exit_hook(self, module: torch.nn.Module, args: Any, outputs: Any) -> None:
        # always_call: runs also when forward raised, so the active stack never keeps a dead entry.
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
            self._run_ctx.global_states.root_nesting -= 1


def map_tensors(value: Any, fn: Callable[[int, torch.Tensor], torch.Tensor], counter: list[int] | None = None) -> Any:
    """Apply ``fn(index, tensor)`` to every tensor in a nest of lists/tuples/dicts, depth first, in order.

    The structure is rebuilt only where a tensor was replaced (namedtuples and dict types kept; other mappings are
    updated in place); any other value is returned as is and gets no index.
    """
    counter = [0] if counter is None else counter
    if isinstance(value, torch.Tensor):
        index = counter[0]
        counter[0] += 1
        return fn(index, value)
    if isinstance(value, (list, tuple)):
        items = [map_tensors(item, fn, counter) for item in value]
        if all(new is old for new, old in zip(items, value, strict=False)):
            return value
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, Mapping):
        mapped = {key: map_tensors(item, fn, counter) for key, item in value.items()}
        if all(mapped[key] is item for key, item in value.items()):
            return value
        if type(value) is dict:
            return mapped
        if type(value) is OrderedDict:
            return OrderedDict(mapped)
        # e.g. transformers' ModelOutput: keep the object, swap its values (a read-only Mapping raises TypeError here)
        target = cast("MutableMapping[Any, Any]", value)
        for key, item in mapped.items():
            target[key] = item
        return target
    return value


def managers_of(module: torch.nn.Module) -> list[SubscriberManager]:
    """The managers whose subscribed root is ``module`` (usually none or ``GlobalSubscriberManager``)."""
    return [manager for manager in list(_MANAGERS) if manager._module is module]


def current_manager() -> SubscriberManager:
    """The manager whose root forward is running (innermost), else ``GlobalSubscriberManager``."""
    return _ACTIVE[-1] if _ACTIVE else GlobalSubscriberManager


@contextlib.contextmanager
def no_increase_global_step() -> Iterator[None]:
    """Suspend every manager: hooks pass values through, nothing is dumped and no step is counted."""
    _GATE["suspended"] += 1
    try:
        yield
    finally:
        _GATE["suspended"] -= 1


@contextlib.contextmanager
def exclusive(manager: SubscriberManager) -> Iterator[None]:
    """Only ``manager`` acts while inside (used by ``trace_activations`` to observe without side effects)."""
    previous, _GATE["exclusive"] = _GATE["exclusive"], manager
    try:
        yield
    finally:
        _GATE["exclusive"] = previous


GlobalSubscriberManager = SubscriberManager()
