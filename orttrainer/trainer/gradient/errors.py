"""The error every gradient builder raises when it cannot differentiate a model."""

from __future__ import annotations


class GradientBuildError(RuntimeError):
    """A gradient builder could not differentiate the model; the message names the op and node.

    `unreachable` lists the parameters without a differentiable path to the loss (the caller may freeze them);
    `op_type` names the op ONNX Runtime has no gradient for (the caller may switch to the torch builder).
    """

    def __init__(self, message: str, unreachable: list[str] | None = None, op_type: str | None = None) -> None:
        super().__init__(message)
        self.unreachable = unreachable or []
        self.op_type = op_type
