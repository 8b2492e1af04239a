"""Where the optimizer update runs — `"graph"`, `"fused"` or `"torch"` (graph/training.py's module docstring) — and
the parameter groups it updates (`param_groups`).

Chosen once per trainer, when it compiles, from the environment variable `ORTTRAINER_OPTIMIZER_UPDATE`:
- `auto` (default): `"torch"` — a gradient-only graph, then torch's fused Adam (foreach SGD and LAMB) in place on
  the same buffers. Measured the fastest on the CPU with either runtime (README § Benchmarks) and the only fused
  update the maintained `onnxruntime` can run (it has no training kernels). `"graph"` for the one configuration
  the torch update does not cover exactly (`torch_fused.supports`).
- `graph`: plain ONNX ops in the training graph (the update before this switch; every runtime and provider).
- `fused`: ONNX Runtime's `AdamOptimizer` kernel in the graph for Adam (weight-decay mode 0); needs the training
  build (`onnxruntime-training`), whose CPU build has no LAMB kernel, so SGD and LAMB stay plain ops.
- `torch`: as `auto` chooses it, but an error where it does not apply.

The switch is an environment variable, not a trainer option: it changes how, not what, the trainer computes (every
path is checked against PyTorch by the same parity tests), and the option schema is the legacy one.
"""

from __future__ import annotations

import os

from ...optim.config import _OptimizerConfig
from ..compile.contract import UPDATE_PATHS, ParamGroup
from ..runtime import ort_private
from .torch_fused import supports

ENVIRONMENT_VARIABLE = "ORTTRAINER_OPTIMIZER_UPDATE"


def choose_update_path(optimizer_name: str, groups: list[ParamGroup]) -> str:
    """The update path for this optimizer and its groups (module docstring); ValueError for an unknown or
    inapplicable request."""
    asked = os.environ.get(ENVIRONMENT_VARIABLE, "auto") or "auto"
    if asked not in ("auto", *UPDATE_PATHS):
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={asked!r}: expected one of {['auto', *UPDATE_PATHS]}")
    if asked == "graph":
        return "graph"
    if asked == "fused":
        if not ort_private.has_training_build():
            raise ValueError(
                f"{ENVIRONMENT_VARIABLE}=fused needs onnxruntime-training (ONNX Runtime's AdamOptimizer kernel); "
                "this onnxruntime has no training kernels: use 'torch' or 'graph'"
            )
        return "fused"
    if supports(optimizer_name, groups):
        return "torch"
    if asked == "torch":
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}=torch: torch's fused Adam cannot drop the bias correction when alpha or beta is "
            "1 or more; use 'graph' or 'auto'"
        )
    return "graph"


def param_groups(optim_config: _OptimizerConfig, trainable: list[str]) -> list[ParamGroup]:
    """Group trainable tensors by their resolved hyper-parameters (legacy per-weight attribute rules)."""
    groups: dict[tuple, ParamGroup] = {}
    for name in trainable:
        floats, ints = optim_config.hyper_parameters(name)
        hyper = {**floats, **ints}
        key = tuple(sorted(hyper.items()))
        groups.setdefault(key, ParamGroup(hyper, []))
        groups[key].params.append(name)
    return list(groups.values())
