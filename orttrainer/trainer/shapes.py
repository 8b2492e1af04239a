"""Input-shape signatures, and a cache of one value per signature.

Why: a graph traced by the torch gradient builder with concrete shapes is valid only for the input shapes and dtypes
it was traced with, and one traced with dynamic dims only for the shapes its guards accept (gradient/torch_builder.py),
so the trainer keeps the compiled graph for each signature it has seen (several may share one dynamic graph).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

ShapeSignature = tuple[tuple[tuple[int, ...], str], ...]
T = TypeVar("T")


def shape_signature(inputs: Sequence[torch.Tensor]) -> ShapeSignature:
    """The key a traced graph is valid for: each input's shape and dtype, in order."""
    return tuple((tuple(int(d) for d in t.shape), str(t.dtype)) for t in inputs)


def named_dims(input_descs: Sequence) -> list[list[int]]:
    """For each model_desc input, the dims its shape names with a string (`['batch', 784]` -> `[0]`): the dims the
    torch path traces as dynamic."""
    return [[i for i, dim in enumerate(desc.shape) if isinstance(dim, str)] for desc in input_descs]


def same_size_groups(input_descs: Sequence) -> list[list[tuple[int, int]]]:
    """The (input, dim) pairs model_desc names with the same string, for each name used more than once (`batch` in
    `['batch', 'seq']` and `['batch']`): the torch path traces them as one size."""
    groups: dict[str, list[tuple[int, int]]] = {}
    for i, desc in enumerate(input_descs):
        for d, dim in enumerate(desc.shape):
            if isinstance(dim, str):
                groups.setdefault(dim, []).append((i, d))
    return [group for group in groups.values() if len(group) > 1]


class ShapeKeyedCache(Generic[T]):
    """One value (a gradient graph, a compiled session) per input-shape signature, least recently used evicted.

    Rule: `get_or_build(inputs, build)` returns the value stored for `shape_signature(inputs)`, calling `build()`
    only on a miss; at most `max_entries` values are kept."""

    def __init__(self, max_entries: int = 16) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._values: OrderedDict[ShapeSignature, T] = OrderedDict()

    def get_or_build(self, inputs: Sequence[torch.Tensor], build: Callable[[], T]) -> T:
        key = shape_signature(inputs)
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = build()
        self._values[key] = value
        if len(self._values) > self.max_entries:
            self._values.popitem(last=False)
        return value

    def replace_all(self, rebuild: Callable[[T], T]) -> None:
        """Replace every stored value `v` by `rebuild(v)`, keeping keys and their order."""
        for key, value in list(self._values.items()):
            self._values[key] = rebuild(value)

    def __contains__(self, inputs: Sequence[torch.Tensor]) -> bool:
        return shape_signature(inputs) in self._values

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> list[T]:
        """The stored values, least recently used first (several signatures may share one value)."""
        return list(self._values.values())
