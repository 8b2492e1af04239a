"""File names from options, checked when the trainer is built rather than when the first file is written.

Rule (docs/reliability.md §5): a path in `debug.graph_save_paths` is a string without a NUL
character, whose every component fits the filesystem's NAME_MAX and whose whole length (as bytes, made absolute)
stays under its PATH_MAX; the limits are read with `os.pathconf` from the nearest existing directory of the path
(255 and 4096 where the system does not say). A path that breaks the rule raises ValueError naming the option;
ONNX Runtime would otherwise fail at the first step with "SystemError : 2" or "SystemError : 36", naming nothing.
Whether the directory exists and is writable stays a warning at the step (a debug dump never stops training).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["check_file_name", "check_graph_save_paths"]

_DEFAULT_NAME_MAX = 255
_DEFAULT_PATH_MAX = 4096


def check_graph_save_paths(options: Any) -> None:
    """`check_file_name` on every non-empty path of `options.debug.graph_save_paths` (an ORTTrainerOptions)."""
    paths = options.debug.graph_save_paths._validated_opts
    for key, path in paths.items():
        if path:
            check_file_name(path, f"debug.graph_save_paths.{key}")


def check_file_name(path: str, option: str) -> None:
    """Refuse a path the operating system cannot take (the rule in the module docstring); `option` names it."""
    if "\0" in path:
        raise ValueError(f"options {option}={path!r} contains a NUL character, which no file name can hold")
    absolute = os.path.abspath(path)
    existing = _nearest_directory(absolute)
    name_max = _limit(existing, "PC_NAME_MAX", _DEFAULT_NAME_MAX)
    path_max = _limit(existing, "PC_PATH_MAX", _DEFAULT_PATH_MAX)
    for component in absolute.split(os.sep):
        if len(os.fsencode(component)) > name_max:
            raise ValueError(
                f"options {option}: the path component {component[:40]!r}... is {len(os.fsencode(component))} "
                f"bytes long; this filesystem allows {name_max}"
            )
    if len(os.fsencode(absolute)) >= path_max:
        raise ValueError(
            f"options {option}: the path is {len(os.fsencode(absolute))} bytes long; this system allows {path_max - 1}"
        )


def _nearest_directory(path: str) -> str:
    directory = os.path.dirname(path)
    while not os.path.isdir(directory):
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return directory


def _limit(directory: str, name: str, default: int) -> int:
    try:
        return int(os.pathconf(directory, name))
    except (OSError, ValueError):
        return default
