"""The errors of the graph-pass contract (`passes.py`): both name the pass."""

from __future__ import annotations


class PassPreconditionError(ValueError):
    """A pass was given a model (or arguments) it is not defined for; `problem` says what is wrong."""

    def __init__(self, pass_name: str, problem: str) -> None:
        super().__init__(f"graph pass {pass_name!r}: {problem}")
        self.pass_name = pass_name
        self.problem = problem


class PassVerificationError(RuntimeError):
    """A pass broke its contract: its result is not a valid, sorted model, or it modified an input it declared it
    would copy. A bug in the pass, not in the caller's model."""

    def __init__(self, pass_name: str, problem: str) -> None:
        super().__init__(f"graph pass {pass_name!r}: {problem}")
        self.pass_name = pass_name
        self.problem = problem
