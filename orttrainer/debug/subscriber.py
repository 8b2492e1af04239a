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
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, cast

import torch

from .subscriber_base import GlobalStates, RuntimeStates, SubscriberBase

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

_GATE: dict[str, Any] = {"suspended": 0, "exclusive": None}
_ACTIVE: list[SubscriberManager] = []  # managers whose root forward is running, innermost last
_MANAGERS: weakref.WeakSet[SubscriberManager] = weakref.WeakSet()  # every manager constructed (copies are not)


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
        self._index_modules(module)
        self._register_hooks(module)

    def unsubscribe(self) -> None:
        """Remove every hook this manager registered and forget its subscribers and state."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._subscribers = ()
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
