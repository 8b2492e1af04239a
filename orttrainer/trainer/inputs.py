"""Turn `train_step(*args, **kwargs)` into the ordered input list the graph takes, and check it before anything runs.

Ordering follows the legacy `_prepare_model_input` (docs/legacy_api.md §3.5): a single list argument is unpacked;
positional inputs come first, then keyword inputs in model_desc order. Unlike the original, an unknown keyword or an
input given twice is an error instead of being silently dropped or shifting every later input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def order_inputs(args: tuple, kwargs: dict, descs: Sequence, allow_fewer: bool = False) -> list:
    """Positional inputs, then keyword inputs in model_desc order; checks names and the count. `allow_fewer` (an
    eval step, as the original paired inputs with descriptions and stopped at the shorter list): the inputs given
    may be the first k of model_desc (k ≥ 1) instead of all."""
    if len(args) == 1 and isinstance(args[0], list):
        args = tuple(args[0])
    names = [d.name for d in descs]
    unknown = [k for k in kwargs if k not in names]
    if unknown:
        raise TypeError(
            f"unexpected keyword input{'s' if len(unknown) > 1 else ''} {unknown}; the model_desc inputs are {names}"
        )
    doubled = [k for k in kwargs if names.index(k) < len(args)]
    if doubled:
        raise TypeError(f"input{'s' if len(doubled) > 1 else ''} {doubled} given both positionally and by keyword")
    inputs = list(args) + [kwargs[d.name] for d in descs if d.name in kwargs]
    given = set(names[: len(args)]) | set(kwargs)
    if allow_fewer and 0 < len(inputs) < len(descs) and given == set(names[: len(inputs)]):
        return inputs
    if len(inputs) != len(descs):
        raise ValueError(f"expected {len(descs)} inputs {names}, got {len(inputs)}")
    return inputs


def check_inputs(inputs: list, descs: Sequence) -> dict[str, int]:
    """Each input must be a tensor whose dtype (once known) and shape agree with its model_desc entry.

    Returns the sizes bound to the symbolic dimension names; a name bound to two sizes is an error.
    """
    sizes: dict[str, int] = {}
    for value, desc in zip(inputs, descs, strict=True):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"input {desc.name!r} must be a torch.Tensor, got {type(value).__name__}")
        if value.is_meta:
            raise ValueError(f"input {desc.name!r} is on the meta device and holds no data; pass a tensor with values")
        if value.numel() == 0:
            raise ValueError(
                f"input {desc.name!r} is empty (shape {list(value.shape)}); a step needs at least one sample"
            )
        dtype = getattr(desc, "dtype", None)
        if dtype is not None and value.dtype != dtype:
            raise TypeError(f"input {desc.name!r} has dtype {value.dtype}, but the model was exported for {dtype}")
        _check_shape(desc.name, list(value.shape), list(desc.shape), sizes, "input")
    return sizes


def check_outputs(outputs: dict[str, torch.Tensor], descs: Sequence, sizes: dict[str, int]) -> None:
    """Output shapes must agree with model_desc (symbolic names as bound by the inputs)."""
    for desc in descs:
        if desc.name in outputs:
            _check_shape(desc.name, list(outputs[desc.name].shape), list(desc.shape), dict(sizes), "output")


def _check_shape(name: str, actual: list[int], declared: list, sizes: dict[str, int], kind: str) -> None:
    if len(actual) != len(declared):
        raise ValueError(
            f"{kind} {name!r} has shape {actual}, but model_desc declares {declared} (rank {len(declared)})"
        )
    for axis, (size, dim) in enumerate(zip(actual, declared, strict=True)):
        if isinstance(dim, str):
            bound = sizes.setdefault(dim, size)
            if bound != size and kind == "input":
                raise ValueError(
                    f"input {name!r} has size {size} on axis {axis} ({dim!r}), but another input bound "
                    f"{dim!r} to {bound}"
                )
        elif size != dim:
            raise ValueError(f"{kind} {name!r} has shape {actual}, but model_desc declares {declared}")
