"""Switches for the speed-only graph rewrites: each can be turned off, so that its effect can be measured and a
suspected difference ruled out.

`ORTTRAINER_DISABLE_REWRITES` is a comma-separated list of rewrite names (`all` turns every one off):
- `cross_entropy_as_plain_ops` (graph/cross_entropy.py),
- `static_shapes` (graph/static_shapes.py: the 'ort' builder's graph specialised per input-shape signature).
None of them changes what is computed beyond float32 rounding; each is tested both ways.
"""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLE = "ORTTRAINER_DISABLE_REWRITES"
REWRITES = ("cross_entropy_as_plain_ops", "static_shapes")


def rewrite_enabled(name: str) -> bool:
    """Whether the rewrite `name` (one of REWRITES) is on; ValueError for a name the variable does not know."""
    if name not in REWRITES:
        raise ValueError(f"unknown rewrite {name!r}; expected one of {list(REWRITES)}")
    disabled = {part.strip() for part in os.environ.get(ENVIRONMENT_VARIABLE, "").split(",") if part.strip()}
    unknown = disabled - {*REWRITES, "all"}
    if unknown:
        raise ValueError(f"{ENVIRONMENT_VARIABLE} names unknown rewrites {sorted(unknown)}; known: {list(REWRITES)}")
    return name not in disabled and "all" not in disabled
