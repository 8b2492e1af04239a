"""How the older API fed model_desc inputs to `model.forward`: mostly by position (docs/legacy_api.md §14.4).

Rule (1.13.1 `wrap_for_input_match`), with `names` the model_desc input names and `keys` the parameters of
`forward` followed, with a loss_fn, by the loss_fn's label parameter:
- without a loss_fn, all inputs go to `forward` positionally;
- with a loss_fn, the last input is the label and the others go positionally when `len(names) >= len(keys)`, when
  some name is not in `keys`, or when they already follow `forward`'s order — and by name only when the names are
  a reordered subset of `forward`'s parameters.

The new trainer always passes inputs by name. When positional and by-name feeding differ, `legacy_input_model`
returns an adapter: an instance of a subclass of the model's class that **shares the model's `__dict__`** (so
parameter names, state, hooks and train/eval mode are the model's own) and whose `forward` takes the model_desc
names and calls the original `forward` positionally.
"""

from __future__ import annotations

import inspect
import keyword
from collections.abc import Callable
from typing import Any, cast

import torch

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def legacy_input_model(
    model: torch.nn.Module, loss_fn: Callable[..., Any] | None, input_names: list[str]
) -> torch.nn.Module:
    """`model`, or the positional adapter when the older API would feed `forward` differently than by name."""
    params = inspect.signature(model.forward).parameters
    model_names = input_names[:-1] if loss_fn is not None else list(input_names)
    if not _positional(list(params), loss_fn, input_names) or model_names == list(params)[: len(model_names)]:
        return model  # by name, or positional feeding that names already express
    slots = [p for p in params.values() if p.kind in _POSITIONAL]
    takes_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
    if len(model_names) > len(slots) and not takes_varargs:
        raise ValueError(
            f"the older ORTTrainer passes the model_desc inputs {model_names} to "
            f"{type(model).__name__}.forward{inspect.signature(model.forward)} by position, but it takes "
            f"{len(slots)} positional arguments"
        )
    bad = [n for n in model_names if not n.isidentifier() or keyword.iskeyword(n) or n == "self"]
    if bad:
        raise ValueError(
            f"model_desc inputs {bad} must be Python identifiers to be passed to "
            f"{type(model).__name__}.forward by position"
        )
    if "forward" in vars(model):
        raise ValueError(
            f"{type(model).__name__} has an instance-level forward; the older ORTTrainer's positional "
            "input matching cannot wrap it: name the model_desc inputs after forward's parameters"
        )
    return _adapter(model, model_names)


def _positional(params: list[str], loss_fn: Callable[..., Any] | None, input_names: list[str]) -> bool:
    if loss_fn is None:
        return True
    try:
        loss_params = list(inspect.signature(loss_fn).parameters)
    except ValueError:  # no signature (some builtins): no label name to match
        loss_params = []
    keys = params + loss_params[1:2]
    if len(input_names) >= len(keys) or any(n not in keys for n in input_names):
        return True
    return input_names == keys[: len(input_names)]


def _adapter(model: torch.nn.Module, names: list[str]) -> torch.nn.Module:
    base = type(model)

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        return base.forward(self, *[bound.arguments[n] for n in names])

    signature = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ["self", *names]]
    )
    # typeshed gives functions no __signature__ attribute; inspect.signature() reads it by design, so it is set here.
    forward.__signature__ = signature  # type: ignore[attr-defined]
    adapter_class = type(
        base.__name__, (base,), {"forward": forward, "__module__": base.__module__, "__qualname__": base.__qualname__}
    )
    # type() with three arguments is typed as returning a plain `type`; the class built here subclasses `base`.
    adapter = object.__new__(cast("type[torch.nn.Module]", adapter_class))
    object.__setattr__(adapter, "__dict__", model.__dict__)  # one state: the user's model
    return adapter
