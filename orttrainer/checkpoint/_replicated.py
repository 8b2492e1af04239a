"""The replicated entries of per-rank checkpoint files: what every rank saves identically, kept once on aggregation
(docs/legacy_api.md §9.4 for the merged ones).

Rule: every top-level entry that ``aggregate.py`` does not merge by its own rules (``MERGED``: model, optimizer,
trainer_options, partition_info, user_dict) is replicated — ``train_step_info``, ``loss_scaler``, ``rng``
(``rng/seed``, ``rng/positions/<graph key>``: the trainer's dropout stream), ``gradient_accumulation`` and any
entry added later. The first rank's copy is kept; every other rank must hold the same paths with equal values
(NaN equals NaN), or the aggregation is refused with a message naming the path and the file. Except the dropout
stream: ranks may draw their masks differently (seeded differently, or given batches of other shapes), so a
difference under ``rng/`` is a warning, and the first rank's stream is what the aggregated state continues.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import layout

MERGED = frozenset({layout.MODEL, layout.OPTIMIZER, layout.TRAINER_OPTIONS, layout.PARTITION_INFO, layout.USER_DICT})

_ONE_SAVE = "are the files from one save?"
# Why a replicated entry may differ, where there is more to say than "the files are not from one save".
_MISMATCH_HINTS = {
    layout.GRADIENT_ACCUMULATION: f"; {layout.GRADIENT_ACCUMULATION}: each data-parallel rank holds its own partial "
    "gradient sums, which do not merge into one trainer's; save at an optimizer step (the trainer refuses a save in "
    "the middle of an accumulation window with data parallelism)",
}


def replicated_entries(rank_state: Mapping[str, Any]) -> dict[str, Any]:
    """``{'rng/positions/all': 3, ...}``: the replicated entries flattened to their leaves (an empty group is one)."""
    flat: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        else:
            flat[path] = value

    for key, value in rank_state.items():
        if key not in MERGED:
            walk(value, key)
    return flat


def replicated_mismatches(
    first: dict[str, Any], entries: dict[str, Any], name: Any, first_rank: int
) -> list[tuple[str, str]]:
    """How a later rank's replicated ``entries`` (file ``name``) differ from the ``first`` rank's: ``(path,
    message)``, errors first, then the differences only worth a warning (``is_lenient``); ``[]``: they agree."""
    found = [
        (path, f"{path} is in the checkpoint file of rank {first_rank} but missing from {name}: {_ONE_SAVE}")
        for path in sorted(first.keys() - entries.keys())
    ]
    found += [
        (path, f"{path} is in {name} but not in the checkpoint file of rank {first_rank}: {_ONE_SAVE}")
        for path in sorted(entries.keys() - first.keys())
    ]
    for path in entries.keys() & first.keys():
        if not _equal(first[path], entries[path]):
            difference = f"{entries[path]!r} here, {first[path]!r} on rank {first_rank}"
            hint = _MISMATCH_HINTS.get(_group(path), "")
            found.append((path, f"Value mismatch for {path} (file: {name}): {difference}{hint}"))
    return sorted(found, key=lambda item: is_lenient(item[0]))


def is_lenient(path: str) -> bool:
    """Whether ranks may differ at ``path``: the dropout stream (``rng/``) may — ranks seeded differently, or given
    batches of other shapes (positions per graph key) — and the first rank's is kept, with a warning."""
    return _group(path) == layout.RNG


def _group(path: str) -> str:
    return path.split("/")[0]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return a == b
    try:
        return bool(np.array_equal(a, b, equal_nan=True))
    except TypeError:  # equal_nan needs numbers
        return bool(np.array_equal(a, b))
