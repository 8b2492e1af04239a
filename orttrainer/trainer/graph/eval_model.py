"""The eval graph: the forward graph as `eval_step` runs it."""

from __future__ import annotations

import onnx

from .class_labels import GUARD_CLASS_LABELS
from .fixups import BATCHNORM_TO_INFERENCE, DROPOUT_TO_IDENTITY
from .outputs import keep_outputs_pass
from .passes import GraphPass, run_passes
from .state_inputs import move_initializers_to_inputs_pass

__all__ = ["build_eval_model", "eval_model_passes"]


def eval_model_passes(state: list[str], outputs: list[str]) -> list[GraphPass]:
    """The passes of `build_eval_model`, in order."""
    return [
        move_initializers_to_inputs_pass(state),
        DROPOUT_TO_IDENTITY,
        BATCHNORM_TO_INFERENCE,
        keep_outputs_pass(outputs),
        GUARD_CLASS_LABELS,  # labels range-checked as PyTorch does (class_labels.py)
    ]


def build_eval_model(forward: onnx.ModelProto, state: list[str], outputs: list[str]) -> onnx.ModelProto:
    """Rule: the forward graph for `eval_step`: the `state` initializers become graph inputs (fed per step, like
    the training graph's), every Dropout becomes an Identity, BatchNormalization runs on its running statistics,
    and only the graph outputs in `outputs` (the model_desc outputs) remain, in the graph's order; the class labels
    of its losses are range-checked (class_labels.py). `forward` is not modified.

    Precondition: those of the passes (`eval_model_passes`): in particular, every name in `outputs` is a graph
    output and no Dropout mask or BatchNormalization running statistic is read."""
    return run_passes(forward, eval_model_passes(state, outputs))
