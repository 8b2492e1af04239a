"""ONNX Runtime as the trainer uses it: which distribution is installed, the device, session options, execution
providers and the `provider_options` option (checked so that nothing asked for is silently dropped), the CPU arena
cap of `device.mem_limit`, and session creation (with ONNX Runtime's optimised graphs kept in the compile cache,
`OptimizedGraphs`).

Installed runtimes: three distributions provide the `onnxruntime` module: `onnxruntime` (the maintained CPU build),
`onnxruntime-gpu` (the maintained CUDA build) and `onnxruntime-training` (1.19.2, the last training build: ONNX
Runtime's gradient builder and training kernels, Python <= 3.11). They write the same files, so two of them in one
environment leave a module made of both: `check_runtime` refuses that mix, and the absence of any, with the
commands that fix it.

`device.mem_limit` on the CPU caps ONNX Runtime's CPU arena. With CUDA the option is the CUDA provider's
`gpu_mem_limit` (per session). ONNX Runtime's CPU provider takes no arena options per session; the one way to cap
its arena from Python is an environment-wide allocator, `create_and_register_allocator(OrtMemoryInfo('Cpu', arena),
OrtArenaCfg(max_mem=mem_limit))`, which sessions use when their option `session.use_env_allocators` is 1. It covers
what the trainer's sessions allocate — a step's intermediate tensors and the updated state they return — so a step
that needs more fails with ONNX Runtime's "Available memory of N is smaller than requested bytes of M". There is one
such allocator per process and it cannot be replaced: every CPU trainer with a mem_limit in the process shares it,
so they must ask for the same limit.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import torch

from ...schema.options import ORTTrainerOptions
from ..graph.nchwc import NCHWC_DOMAIN, blocked_convolutions
from ..graph.passes import rewrite_enabled
from . import eager_ops, ort_private

_logger = logging.getLogger(__name__)

DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training")
EXTRAS = {"onnxruntime": "cpu", "onnxruntime-gpu": "gpu", "onnxruntime-training": "ort-training"}
TRAINING_EXTRA_HINT = "pip install 'orttrainer[ort-training]' (Python 3.11; it replaces the maintained onnxruntime)"


def installed_runtimes() -> list[str]:
    """The ONNX Runtime distributions installed, as 'name==version'."""
    found = []
    for name in DISTRIBUTIONS:
        try:
            found.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def check_runtime() -> None:
    """Raise ImportError when no ONNX Runtime, or more than one of its distributions, is installed."""
    found = installed_runtimes()
    if not found:
        raise ImportError(
            "no ONNX Runtime is installed: pip install 'orttrainer[cpu]' (the maintained onnxruntime), "
            "'orttrainer[gpu]' (onnxruntime-gpu, CUDA 12) or 'orttrainer[ort-training]' (onnxruntime-training "
            "1.19.2, Python 3.11)"
        )
    if len(found) > 1:
        names = [f.partition("==")[0] for f in found]
        raise ImportError(
            f"{found} are installed together, but they own the same Python module 'onnxruntime', so it is now a "
            f"mix of both. Keep exactly one: pip uninstall -y {' '.join(names)}, then pip install one of them "
            f"(orttrainer's extras: {', '.join(f'[{EXTRAS[n]}]' for n in names)})"
        )


def has_training_build() -> bool:
    """Whether ONNX Runtime's gradient builder and training kernels are available."""
    return ort_private.has_training_build()


@dataclass(frozen=True)
class Device:
    """`device.id` parsed: 'cpu', or 'cuda' with an index."""

    type: str
    index: int = 0

    @classmethod
    def parse(cls, device_id: str) -> Device:
        """'cpu', 'cuda' or 'cuda:<index>' (case and surrounding spaces ignored); ValueError otherwise."""
        text = device_id.strip().lower()
        if text == "cpu":
            return cls("cpu")
        if text == "cuda" or text.startswith("cuda:"):
            index = text.partition(":")[2]
            if index and not index.isdigit():
                raise ValueError(f"options device.id {device_id!r}: expected 'cpu', 'cuda' or 'cuda:<index>'")
            return cls("cuda", int(index or 0))
        raise ValueError(f"options device.id {device_id!r}: expected 'cpu', 'cuda' or 'cuda:<index>'")

    @property
    def torch_device(self) -> torch.device:
        """The same device as a `torch.device`."""
        return torch.device(self.type, self.index) if self.type == "cuda" else torch.device("cpu")


CPU_PROVIDER = "CPUExecutionProvider"


def checked_provider_options(name: object, opts: object, available: list[str]) -> dict[str, str]:
    """Rules: the provider is a str this onnxruntime build provides (ONNX Runtime would only log a warning and drop
    it); its options are a dict of str keys to str, int, float or bool values; the CPU provider takes none from
    Python (its arena is `device.mem_limit` / SessionOptions)."""
    if not isinstance(name, str) or name not in available:
        raise ValueError(
            f"options provider_options names {name!r}, which this onnxruntime build does not provide; "
            f"available: {available}"
        )
    if not isinstance(opts, dict):
        raise ValueError(
            f"options provider_options.{name} must be a dict of option names to values, got {type(opts).__name__}"
        )
    bad = [k for k, v in opts.items() if not isinstance(k, str) or not isinstance(v, (str, int, float, bool))]
    if bad:
        raise ValueError(
            f"options provider_options.{name}: option names must be str and values str, int, float or "
            f"bool; these are not: {bad}"
        )
    if name == CPU_PROVIDER and opts:
        raise ValueError(
            f"options provider_options.{CPU_PROVIDER}={opts!r}: ONNX Runtime's CPU provider takes no options "
            "from Python and would ignore them; cap its memory with options device.mem_limit"
        )
    return {k: str(v) for k, v in opts.items()}


def check_provider_options(options: ORTTrainerOptions) -> None:
    """`provider_options` by the rules of `checked_provider_options`, at construction."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    for name, opts in options._validated_opts["provider_options"].items():
        checked_provider_options(name, opts, available)


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
    memory_reuse: bool = True,
    optimized_graphs: OptimizedGraphs | None = None,
) -> Any:
    """An `onnxruntime.InferenceSession` for `model`; `optimized_model_path` (may be "") receives the optimized
    graph; `disabled_optimizers` names ONNX Runtime graph transformers not to run; `memory_reuse` False turns off
    the allocation planner's buffer reuse (`SessionOptions.enable_mem_reuse`) for this session, which is off on the
    CPU in any case; `optimized_graphs` keeps ONNX Runtime's optimised graph of `model` for the next process. Every
    provider option asked for must be in effect, and `device.id` cuda must run on CUDA."""
    import onnxruntime as ort

    eager_ops.prepare_options(model, options)  # ops PyTorch runs inside the graph (gradient/eager_fallback.py)
    if (
        device.type == "cpu"
        and options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        and any(node.op_type in ("Conv", "ConvTranspose") for node in model.graph.node)
        and rewrite_enabled("blocked_convolutions")
        and (block := nchwc_block()) is not None
    ):
        model = blocked_convolutions(model, block)  # ONNX Runtime's own NCHWc pass needs constant weights
    saved = (options.optimized_model_filepath, options.enable_mem_pattern, options.enable_mem_reuse)
    options.optimized_model_filepath = optimized_model_path  # read once, at session creation
    # The memory pattern (one block per run, planned from the first run) is off: on a graph with static shapes ONNX
    # Runtime keeps that block besides the first run's arena chunks (docs/engine.md §14: +120 MB on the benchmark
    # transformer), and it was not faster on the dynamic graph either.
    options.enable_mem_pattern = False
    # The buffer-reuse plan keeps a freed buffer allocated until the tensor planned into it is written; without it
    # each buffer goes back to the arena when its tensor dies. On the CPU that is smaller and faster for every
    # session (docs/engine.md §24: the benchmark transformer's step 27% less memory, 4% faster), so it is off there;
    # on CUDA, not measured, the memory options turn it off (docs/engine.md §16).
    if device.type == "cpu" or not memory_reuse:
        options.enable_mem_reuse = False
    try:
        serialized = model.SerializeToString()
        if optimized_graphs is not None and not optimized_model_path and optimized_graphs.serves(model, options):
            session = optimized_graphs.session(serialized, options, providers, disabled_optimizers)
        else:
            session = ort.InferenceSession(
                serialized, options, providers=providers, disabled_optimizers=list(disabled_optimizers)
            )
    finally:
        options.optimized_model_filepath, options.enable_mem_pattern, options.enable_mem_reuse = saved
    if device.type == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(
            f"options device.id is cuda:{device.index} but ONNX Runtime's CUDAExecutionProvider could not "
            "be used on this machine (onnxruntime-training 1.19.2 needs CUDA 11.8 and cuDNN 8). Set options "
            "{'device': {'id': 'cpu'}} to train on the CPU."
        )
    _check_options_in_effect(session, providers)
    return session


@functools.cache
def nchwc_block() -> int | None:
    """ONNX Runtime's channel block size for its NCHWc convolutions on this machine (8 with AVX2, 16 with AVX-512),
    or None where it has none. Read from what its optimiser makes of a one-convolution model with a constant weight:
    the blocked weight it writes is the weight in the layout `graph/nchwc.py` writes for that block size."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    channels = 16
    weight = np.arange(channels * channels * 9, dtype=np.float32).reshape(channels, channels, 3, 3)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        "nchwc_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w")],
    )
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="orttrainer_") as directory:
        options.optimized_model_filepath = os.path.join(directory, "probe.onnx")
        ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath)
    if not any(n.domain == NCHWC_DOMAIN and n.op_type == "Conv" for n in optimized.graph.node):
        return None
    blocked = [
        numpy_helper.to_array(i).reshape(-1) for i in optimized.graph.initializer if tuple(i.dims) == weight.shape
    ]
    for block in (16, 8):
        blocks = channels // block
        expected = weight.reshape(blocks, block, blocks, block, 3, 3).transpose(0, 2, 4, 5, 3, 1)
        if any(np.array_equal(b, expected.reshape(-1)) for b in blocked):
            return block
    return None


ONNXRUNTIME_GRAPHS = "onnxruntime"  # the compile cache's folder for ONNX Runtime's optimised graphs


class OptimizedGraphs:
    """ONNX Runtime's optimised graph of each session's model, kept in the compile cache's folder `onnxruntime`
    (compile/cache.py) so that another process loads it with the optimiser off instead of optimising again: for
    the LSTM benchmark's ~7,500 nodes that is 0.28 s instead of 0.81 s (docs/engine.md §22).

    Rule: an entry's key is the sha256 of the model's bytes and of everything else the optimiser reads — the
    onnxruntime version and build, the providers and their options, the optimisation level, the disabled
    optimisers, deterministic compute, and the processor (model and feature flags: the NCHWc layout and some
    fusions depend on the instruction set). So a cached graph is ONNX Runtime's output for exactly this input,
    and no option of the trainer needs to be in the key. Served only where all of that is known: on the CPU
    provider, with orttrainer's own SessionOptions (a user's may hold config entries that Python cannot read
    back), on Linux (where /proc/cpuinfo names the processor), for graphs of at most `MAX_BYTES`, and for graphs
    without Dropout nodes (their seeds, drawn per trainer, are in the bytes: each process would write a new
    entry)."""

    # Larger graphs are not kept: the training graphs take the state as inputs, so a graph this large carries
    # weights as initializers (an ONNX model's frozen ones), which every process would hash and the cache copy
    # for little gain: ONNX Runtime's optimiser takes time by nodes, not bytes (the LSTM's 7,500 nodes: 1.2 MB).
    MAX_BYTES = 64 << 20

    def __init__(self, cache: Any) -> None:
        self._cache = cache  # compile/cache.CompileCache

    @classmethod
    def for_sessions(cls, user_options: Any, device: Device) -> OptimizedGraphs | None:
        """The cache for sessions made with `user_options` (None: orttrainer's own) on `device`, or None."""
        from ..compile.cache import CompileCache, cache_directory

        directory = cache_directory()
        if directory is None or user_options is not None or device.type != "cpu" or processor() is None:
            return None
        return cls(CompileCache(os.path.join(directory, ONNXRUNTIME_GRAPHS)))

    def serves(self, model: onnx.ModelProto, options: Any) -> bool:
        import onnxruntime as ort

        level = options.graph_optimization_level
        return (
            level != ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            and model.ByteSize() <= self.MAX_BYTES
            and not any(n.op_type == "Dropout" for n in model.graph.node)
        )

    def key(self, serialized: bytes, options: Any, providers: list, disabled_optimizers: Sequence[str]) -> str:
        import onnxruntime as ort

        from ..compile.cache import digest

        return digest(
            "onnxruntime optimised graph",
            hashlib.sha256(serialized).hexdigest(),
            ort.__version__,
            has_training_build(),
            providers,
            str(options.graph_optimization_level),
            sorted(disabled_optimizers),
            options.use_deterministic_compute,
            processor(),
        )

    def session(self, serialized: bytes, options: Any, providers: list, disabled_optimizers: Sequence[str]) -> Any:
        """A session for the model `serialized`: from its stored optimised graph, optimiser off; or optimised
        here, and that graph stored. An entry ONNX Runtime cannot load is logged and replaced."""
        import onnxruntime as ort

        key = self.key(serialized, options, providers, disabled_optimizers)
        entry = self._cache.load(key)
        if entry is not None:
            level = options.graph_optimization_level
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            try:
                return ort.InferenceSession(entry.blobs["model"], options, providers=providers)
            except Exception as err:  # optimised again below, and the entry replaced
                path = self._cache.path(key)
                _logger.warning("ONNX Runtime cannot load the cached optimised graph %s (%s)", path, err)
            finally:
                options.graph_optimization_level = level
        with tempfile.TemporaryDirectory(prefix="orttrainer_") as directory:
            options.optimized_model_filepath = os.path.join(directory, "optimized.onnx")
            try:
                session = ort.InferenceSession(
                    serialized, options, providers=providers, disabled_optimizers=list(disabled_optimizers)
                )
                with open(options.optimized_model_filepath, "rb") as f:
                    optimized = f.read()
            except Exception as err:  # writing the optimised graph failed (the disk, say): a session without it
                _logger.info("ONNX Runtime's optimised graph is not kept (%s)", err)
                options.optimized_model_filepath = ""
                return ort.InferenceSession(
                    serialized, options, providers=providers, disabled_optimizers=list(disabled_optimizers)
                )
        self._cache.store(key, {}, {"model": optimized})
        return session


@functools.cache
def processor() -> str | None:
    """The processor as ONNX Runtime's CPU kernels see it: the machine, and the first processor's model name and
    feature flags from /proc/cpuinfo; None where that file cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return None
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")
    lines = [line.strip() for line in first.splitlines() if line.split(":")[0].strip() in wanted]
    return platform.machine() + "\n" + "\n".join(lines) if lines else None


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
    """The user's SessionOptions (modified in place, as the legacy trainer did) or new ones, whose thread pool
    does not spin between runs."""
    import onnxruntime as ort

    options = user_options
    if options is None:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # ORT warns about every unused initializer otherwise
        # The thread pool would spin after each run, on every core, while torch runs the rest of the step (the fused
        # update) and the user's loop: 16 cores gave an MLP step of 40 ms instead of 2.5-3 ms (docs/engine.md §3.3)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.use_deterministic_compute = deterministic
    if device.type == "cpu" and mem_limit > 0:
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

    eager_ops.prepare_options(model, options)
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


_registered_limit: int | None = None


def cap_cpu_arena(session_options, limit: int) -> None:
    """Make sessions created with `session_options` allocate from the process's CPU arena capped at `limit` bytes."""
    global _registered_limit
    import onnxruntime as ort

    check_cpu_arena_cap(limit)
    if _registered_limit is None:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(limit, -1, -1, -1))
        _registered_limit = limit
    session_options.add_session_config_entry("session.use_env_allocators", "1")


def check_cpu_arena_cap(limit: int) -> None:
    """ValueError when this process's CPU arena is already capped at another size (one cap per process)."""
    if _registered_limit is not None and _registered_limit != limit:
        raise ValueError(
            f"options device.mem_limit={limit}: this process already caps ONNX Runtime's shared CPU arena "
            f"at {_registered_limit} bytes, and the cap cannot change (one per process)"
        )
