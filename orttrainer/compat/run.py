"""Run a legacy training script unchanged, with `orttrainer.compat.install()` applied first.

    python -m orttrainer.run script.py [args...]
    python -m orttrainer.run -m package.module [args...]

Rules: the script runs as `__main__` exactly as `python script.py args...` would run it — `sys.argv` is
`[script.py, args...]`, `sys.path[0]` is the script's directory (for `-m`: the current directory, and `sys.argv[0]`
the module's file) — except that `onnxruntime.training` and `onnxruntime.capi.ort_trainer` resolve to orttrainer.
The script's exit status is the command's.

There is deliberately no environment variable: it would need a `.pth` start-up hook in site-packages, run by every
Python process of the environment. `python -m orttrainer.run` touches nothing outside the one process.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m orttrainer.run script.py [args...]\n       python -m orttrainer.run -m module [args...]"


def main(argv: list[str] | None = None) -> None:
    """Parse `[-m] target [args...]`, install the compat aliases and run the target as `__main__`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    as_module = argv[0] == "-m"
    if as_module:
        argv = argv[1:]
        if not argv:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
    target, args = argv[0], argv[1:]
    if not as_module and not os.path.exists(target):
        print(f"python -m orttrainer.run: can't open file {target!r}: no such file", file=sys.stderr)
        raise SystemExit(2)

    from orttrainer.compat import install  # absolute: this module also runs as `orttrainer.run`

    install()
    if as_module:
        sys.argv = [target, *args]  # runpy replaces argv[0] with the module's file
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
