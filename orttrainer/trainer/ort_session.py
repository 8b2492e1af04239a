"""Creating ONNX Runtime sessions for the trainer's graphs: session options, execution providers and the
`provider_options` option, checked so that nothing asked for is silently dropped."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import onnx
import torch

from .config import CPU_PROVIDER, Device, checked_provider_options

# ONNX Runtime's inference-only fusions, off for training graphs: their fused CPU kernels declare the optional
# outputs a gradient reads (a LayerNormalization's inverse standard deviation, for InvertibleLayerNormalizationGrad)
# without computing them ("Missing Input" at run time). They fire once input shapes are static (docs/engine.md §14).
TRAINING_UNSAFE_FUSIONS = ("SkipLayerNormFusion", "EmbedLayerNormFusion", "AttentionFusion")


def create_session(
    model: onnx.ModelProto,
    options: Any,
    providers: list,
    device: Device,
    optimized_model_path: str,
    disabled_optimizers: Sequence[str] = (),
) -> Any:
    """An `onnxruntime.InferenceSession` for `model`; `optimized_model_path` (may be "") receives the optimized
    graph; `disabled_optimizers` names ONNX Runtime graph transformers not to run. Every provider option asked for
    must be in effect, and `device.id` cuda must run on CUDA."""
    import onnxruntime as ort

    saved = (options.optimized_model_filepath, options.enable_mem_pattern)
    options.optimized_model_filepath = optimized_model_path  # read once, at session creation
    # The memory pattern (one block per run, planned from the first run) is off: on a graph with static shapes ONNX
    # Runtime keeps that block besides the first run's arena chunks (docs/engine.md §14: +120 MB on the benchmark
    # transformer), and it was not faster on the dynamic graph either.
    options.enable_mem_pattern = False
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=providers, disabled_optimizers=list(disabled_optimizers)
        )
    finally:
        options.optimized_model_filepath, options.enable_mem_pattern = saved
    if device.type == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(
            f"options device.id is cuda:{device.index} but ONNX Runtime's CUDAExecutionProvider could not "
            "be used on this machine (onnxruntime-training 1.19.2 needs CUDA 11.8 and cuDNN 8). Set options "
            "{'device': {'id': 'cpu'}} to train on the CPU."
        )
    _check_options_in_effect(session, providers)
    return session


def writable_debug_path(path: str, option: str) -> str:
    """`path` when a file can be written there, else "" with a warning naming the option: a debug dump that cannot
    be written does not stop training (as in the original)."""
    if not path:
        return ""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(directory) and os.access(directory, os.W_OK) and not os.path.isdir(path):
        return path
    warnings.warn(
        f"options {option}={path!r} cannot be written (no such directory, or not writable); training "
        "goes on without that file",
        stacklevel=3,
    )
    return ""


def session_options(user_options: Any, deterministic: bool, device: Device, mem_limit: int) -> Any:
    """The user's SessionOptions (modified in place, as the legacy trainer did) or new ones."""
    import onnxruntime as ort

    options = user_options
    if options is None:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # ORT warns about every unused initializer otherwise
    options.use_deterministic_compute = deterministic
    if device.type == "cpu" and mem_limit > 0:
        from .cpu_memory import cap_cpu_arena

        cap_cpu_arena(options, mem_limit)
    return options


def providers_for(device: Device, mem_limit: int, provider_options: dict[str, Any]) -> list:
    """Providers for `device.id`, then `provider_options` (EP name -> options) merged in or put first."""
    providers = _device_providers(device, mem_limit)
    import onnxruntime as ort

    available = ort.get_available_providers()
    for name, opts in provider_options.items():
        options = checked_provider_options(name, opts, available)
        names = [p[0] for p in providers]
        if name in names:
            i = names.index(name)
            providers[i] = (name, {**providers[i][1], **options})
        else:
            providers.insert(0, (name, options))
    return providers


def _device_providers(device: Device, mem_limit: int) -> list:
    import onnxruntime as ort

    if device.type != "cuda":
        return [(CPU_PROVIDER, {})]
    if "CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available():
        raise RuntimeError(
            f"options device.id asks for CUDA ({device.type}:{device.index}) but CUDA is not available here. "
            "Set options {'device': {'id': 'cpu'}} to train on the CPU."
        )
    cuda: dict[str, Any] = {"device_id": device.index}
    if mem_limit > 0:
        cuda["gpu_mem_limit"] = mem_limit
    return [("CUDAExecutionProvider", cuda), (CPU_PROVIDER, {})]


def _check_options_in_effect(session: Any, providers: list) -> None:
    """Every option asked for must show in `session.get_provider_options()`: ONNX Runtime drops unknown ones
    silently."""
    in_effect = session.get_provider_options()
    for name, asked in providers:
        if name == CPU_PROVIDER or name not in in_effect:
            continue
        dropped = sorted(set(asked) - set(in_effect[name]))
        if dropped:
            raise ValueError(
                f"options provider_options.{name}: {dropped} are not options of {name} (ONNX Runtime "
                f"ignored them); it takes {sorted(in_effect[name])}"
            )


def optimized_model(model: onnx.ModelProto, options: Any, providers: list) -> onnx.ModelProto:
    """`model` after ONNX Runtime's graph optimisations up to the extended level (constant folding, fusions; no
    layout changes; not the inference-only fusions, `TRAINING_UNSAFE_FUSIONS`), as ONNX Runtime writes it
    (`SessionOptions.optimized_model_filepath`). `options` (the trainer's session options, possibly the user's) is
    restored afterwards."""
    import onnxruntime as ort

    saved = (options.optimized_model_filepath, options.graph_optimization_level)
    extended = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    with tempfile.TemporaryDirectory(prefix="orttrainer_") as directory:
        path = os.path.join(directory, "optimized.onnx")
        options.optimized_model_filepath = path
        if saved[1] == ort.GraphOptimizationLevel.ORT_ENABLE_ALL:
            options.graph_optimization_level = extended
        try:
            ort.InferenceSession(
                model.SerializeToString(), options, providers=providers, disabled_optimizers=TRAINING_UNSAFE_FUSIONS
            )
        finally:
            options.optimized_model_filepath, options.graph_optimization_level = saved
        return onnx.load(path)
