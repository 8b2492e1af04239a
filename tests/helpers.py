"""Small helpers shared by trainer tests."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import pytest
import torch

from orttrainer import ORTTrainer, ORTTrainerOptions
from orttrainer.trainer.runtime import has_training_build

# The one reason a test skips in the maintained-runtime lane (`make test-maintained`): it exercises what only
# onnxruntime-training has (README: Installation).
needs_training_build = pytest.mark.skipif(
    not has_training_build(),
    reason="needs onnxruntime-training (the 'ort' gradient builder / ONNX Runtime training ops)",
)


def cpu_options(extra: dict | None = None) -> ORTTrainerOptions:
    """Options on the CPU with `extra` merged in (one level deep per group)."""
    opts: dict = {"device": {"id": "cpu"}}
    for key, value in (extra or {}).items():
        if isinstance(value, dict):
            opts.setdefault(key, {}).update(value)
        else:
            opts[key] = value
    return ORTTrainerOptions(opts)


def make_trainer(model, desc, config, loss_fn=None, extra: dict | None = None) -> ORTTrainer:
    return ORTTrainer(model, desc, config, loss_fn=loss_fn, options=cpu_options(extra))


def trainer_weights(trainer: ORTTrainer) -> dict[str, np.ndarray]:
    return trainer._training_session.get_state(list(trainer._built.compiled.trainable))


def torch_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def export_training_onnx(
    module: torch.nn.Module,
    args: tuple,
    input_names: list[str],
    output_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
    opset_version: int = 14,
) -> onnx.ModelProto:
    """`module` (returning the loss first) as an ONNX model the way legacy users made theirs: the TorchScript
    exporter in training mode, no constant folding."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's, chosen on purpose
        torch.onnx.export(
            module,
            args,
            buffer,
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            opset_version=opset_version,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            dynamo=False,
        )
    return onnx.load_from_string(buffer.getvalue())
