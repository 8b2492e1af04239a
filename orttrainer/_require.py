"""The one validation helper of the legacy API's argument checks.

The original validated arguments with `assert condition, message`; users catch `AssertionError` and tests compare the
messages, so orttrainer raises the same exception with the same text — explicitly, so `python -O` keeps the checks.
"""

from __future__ import annotations

from typing import Any


def require(condition: Any, message: str) -> None:
    """Raise `AssertionError(message)` when `condition` is false."""
    if not condition:
        raise AssertionError(message)
