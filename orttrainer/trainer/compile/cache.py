"""The persistent compile cache: compiled training graphs on disk, so that a second process skips export, tracing
and compilation.

Where: `ORTTRAINER_COMPILE_CACHE` names the directory; unset or empty, `$XDG_CACHE_HOME/orttrainer/compile`
(`~/.cache/orttrainer/compile`); `off` (or `0`, `false`, `no`) turns the cache off. Entries are never evicted:
delete the directory to reclaim the space.

The key (`TrainerKey`) covers everything a compiled graph depends on; any change gives another key, a miss:
- the model: the aten-level dataflow of one training-mode forward and backward of the model and its loss on the
  batch (`torch_private.dataflow_digest`: every op, its arguments wired by role — input, named state tensor (the
  state_dict's), earlier result, constant by value — so the architecture, its hyper-parameters, the loss and
  constants such as a loss's class weights or a non-persistent buffer (a rotary table) all count; the backward by
  its autograd graph, or by its ops when Python can run in it; an eval graph's: the eval-mode forward's,
  build/cached.py),
  the source of the model's and loss function's own classes and functions, every parameter's and buffer's name,
  shape, dtype and `requires_grad`, and the modules' train/eval modes;
- the input shapes and dtypes (in the dataflow, and in each graph's key);
- the options that change a graph: every trainer option (the learning-rate scheduler and the loss scaler's
  state excepted), the optimizer configuration, model_desc, the device, the gradient-builder choice and the
  environment switches `ORTTRAINER_OPTIMIZER_UPDATE` and `ORTTRAINER_DISABLE_REWRITES`;
- the versions of Python, torch, onnx, onnxscript, onnxruntime (and which build: training or not), numpy, and a
  digest of orttrainer's own source.
What the key cannot see is not cached: a trainer with `_internal_use.extra_postprocess` (a user function), debug
options that write files or compare exports, orttrainer.debug statistics, data parallelism or an ONNX model as
input builds as before. A model whose traced graph depends on something outside the model (a file, an
environment variable read only while exporting), or whose forward hooks an autograd node directly
(`grad_fn.register_hook`: `torch_private.dataflow_digest` cannot see it), must not use the cache.

An entry (`CompileCache.store`) is one file, written to a temporary name and renamed into place (atomic): a header
with the key, what the trainer needs besides the graphs (`meta`), and for each stored model its size and sha256.
`load` checks all of them; a file that fails a check is removed and reported as a miss, so the graph is built
again and the entry rewritten — a corrupt entry is never used. `load` reads only this user's own regular file,
writable by nobody else; a symlink, a FIFO or another user's file at an entry's name is a miss with a warning, and
the new entry replaces it. Failures to read or write the directory are warnings: training goes on without the cache.

The folder `onnxruntime` holds entries of the same layout with ONNX Runtime's optimised graphs, keyed by their
input's bytes (runtime/ort.OptimizedGraphs).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import platform
import stat
import struct
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

_logger = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "ORTTRAINER_COMPILE_CACHE"
_OFF = {"off", "0", "false", "no"}
FORMAT = 1  # the entry layout; a new layout is a new format, and old entries then miss
_MAGIC = b"orttrainer compile cache\n"
_HEADER = struct.Struct("<Q")


def cache_directory() -> str | None:
    """The cache directory by the rule above, or None when the cache is off."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if value.lower() in _OFF:
        return None
    if value:
        return os.path.abspath(os.path.expanduser(value))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "orttrainer", "compile")


@dataclass(frozen=True)
class Entry:
    """A loaded entry: what the trainer recorded next to the graphs, and the stored blobs by name."""

    meta: dict[str, Any]
    blobs: dict[str, bytes]


class CompileCache:
    """The entries under `directory` (module docstring)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], f"{key}.entry")

    def load(self, key: str) -> Entry | None:
        """The entry stored under `key`, or None (absent; not this user's regular file: warned, left alone; corrupt:
        removed)."""
        path = self.path(key)
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as err:  # ELOOP: a symlink at the entry's name
            _warn(f"cannot read the compile cache entry {path} ({err}); the graph is built again")
            return None
        with os.fdopen(fd, "rb") as f:
            refused = _not_this_users(os.fstat(f.fileno()))
            if refused:
                _warn(f"compile cache entry {path} {refused}: not used, the graph is built again")
                return None
            try:
                data = f.read()
            except OSError as err:
                _warn(f"cannot read the compile cache entry {path} ({err}); the graph is built again")
                return None
        try:
            return _parse(data, key)
        except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as err:
            _logger.warning("compile cache entry %s is corrupt (%s): removed, the graph is built again", path, err)
            with contextlib.suppress(OSError):
                os.remove(path)
            return None

    def store(self, key: str, meta: dict[str, Any], blobs: dict[str, bytes]) -> None:
        """Write the entry atomically (a temporary file renamed into place); a failure warns and is ignored."""
        path = self.path(key)
        listing = [{"name": n, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in blobs.items()]
        header = json.dumps({"format": FORMAT, "key": key, "meta": meta, "blobs": listing}, sort_keys=True).encode()
        temporary = ""
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".entry", dir=os.path.dirname(path))
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + _HEADER.pack(len(header)) + header)
                for blob in blobs.values():
                    f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        except OSError as err:
            _warn(f"cannot write the compile cache entry {path} ({err}); training goes on without it")
            if temporary:
                with contextlib.suppress(OSError):
                    os.remove(temporary)


# Opening an entry follows no symlink and does not wait on a FIFO planted at its name (docs/reliability.md §6).
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _not_this_users(info: os.stat_result) -> str | None:
    """Rule: an entry is read only when it is a regular file that this user owns and only this user can write
    (`store` makes it so: mode 0600). Why: the directory may be shared, or writable by others, and a graph planted
    there would train with other numbers than the model's (docs/reliability.md §6). What is wrong, else None."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by other users"
    return None


def _parse(data: bytes, key: str) -> Entry:
    if not data.startswith(_MAGIC):
        raise ValueError("not a compile cache entry")
    start = len(_MAGIC) + _HEADER.size
    (length,) = _HEADER.unpack(data[len(_MAGIC) : start])
    header = json.loads(data[start : start + length].decode())
    if header["format"] != FORMAT or header["key"] != key:
        raise ValueError(f"entry of format {header['format']} for key {header['key']}")
    offset, blobs = start + length, {}
    for blob in header["blobs"]:
        content = data[offset : offset + int(blob["size"])]
        if len(content) != int(blob["size"]) or hashlib.sha256(content).hexdigest() != blob["sha256"]:
            raise ValueError(f"blob {blob['name']!r} does not match its digest")
        blobs[str(blob["name"])] = content
        offset += len(content)
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} bytes after the last blob")
    return Entry(dict(header["meta"]), blobs)


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def digest(*parts: Any) -> str:
    """sha256 of the JSON text of `parts`."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# -- what a key is made of -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, str]:
    """The versions a compiled graph depends on, and a digest of orttrainer's own source."""
    from importlib import metadata

    import numpy
    import onnx
    import onnxruntime

    from ..runtime.ort import has_training_build

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnxruntime_training": str(has_training_build()),
        "numpy": numpy.__version__,
    }
    try:
        versions["onnxscript"] = metadata.version("onnxscript")
    except metadata.PackageNotFoundError:
        versions["onnxscript"] = ""
    versions["orttrainer"] = _source_digest()
    return versions


def _source_digest() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the orttrainer package
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


class Uncacheable(ValueError):
    """An option value the key cannot describe (a user function, an object): the trainer is not cached."""


def describe_options(options: dict[str, Any], path: str = "") -> Any:
    """The validated options as JSON values, by the module docstring's rules; Uncacheable for a value it cannot
    describe."""
    if path in ("lr_scheduler", "mixed_precision.loss_scaler"):  # fed per step: no graph depends on them
        return None if options is None else type(options).__qualname__
    if path == "session_options":  # ONNX Runtime's optimiser level shapes the specialised graphs
        return None if options is None else str(getattr(options, "graph_optimization_level", ""))
    if isinstance(options, dict):
        return {k: describe_options(v, f"{path}.{k}" if path else k) for k, v in sorted(options.items())}
    if isinstance(options, (list, tuple)):
        return [describe_options(v, path) for v in options]
    if isinstance(options, Enum):
        return f"{type(options).__qualname__}.{options.name}"
    if options is None or isinstance(options, (bool, int, float, str)):
        return options
    raise Uncacheable(f"option {path} is a {type(options).__qualname__}")


def _source(obj: Any) -> str:
    """The source of a class or function that is not torch's own (torch's is covered by its version)."""
    module = getattr(obj, "__module__", "") or ""
    if module == "torch" or module.startswith("torch."):
        return ""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return getattr(obj, "__qualname__", type(obj).__qualname__)


def model_description(module: torch.nn.Module, loss_fn: Callable | None) -> dict[str, Any]:
    """The model's own code and state layout (module docstring)."""
    classes = sorted({type(m) for m in module.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}")
    loss = [] if loss_fn is None else [type(loss_fn) if isinstance(loss_fn, torch.nn.Module) else loss_fn]
    return {
        "classes": [[f"{c.__module__}.{c.__qualname__}", _source(c)] for c in classes],
        "loss_fn": [[getattr(f, "__qualname__", repr(f)), _source(f)] for f in loss],
        "parameters": [
            [n, list(p.shape), str(p.dtype), p.requires_grad]
            for n, p in module.named_parameters(remove_duplicate=False)
        ],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in module.named_buffers(remove_duplicate=False)],
        "modes": [[n, m.training] for n, m in module.named_modules()],
    }


def dataflow(
    module: torch.nn.Module,
    loss_fn: Callable | None,
    input_names: Sequence[str],
    inputs: Sequence[torch.Tensor],
    traced_as: Callable[[], contextlib.AbstractContextManager],
) -> str:
    """`torch_private.dataflow_digest` of one forward (the module with its loss, as the builders export it) and the
    backward of the loss to the parameters that require grad, in the module's own mode and under `traced_as()`
    (what the tracer sets: the SDPA backend, export flags). Nothing of it stays: torch's random state, the
    buffers and every `.grad` are as before."""
    from ..build.export import _ModelWithLoss
    from ..gradient import torch_private
    from ..gradient.torch_trace import flatten_tensors

    wrapper = _ModelWithLoss(module, loss_fn, list(input_names))
    # the trainer's state, which every step feeds, by name; a non-persistent buffer (transformers' rotary `inv_freq`)
    # is no trainer state: the graphs hold its values (graph/state_inputs.bind_foreign_state), so the digest takes
    # it as a constant, by its bytes
    state = dict(module.state_dict(keep_vars=True))
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    params = [p for p in module.parameters() if p.requires_grad]
    copies = [t.detach().clone() for t in inputs]
    devices = sorted({t.device.index or 0 for t in [*copies, *params] if t.device.type == "cuda"})

    def forward() -> torch.Tensor | None:
        outputs = flatten_tensors(wrapper(*copies))
        return outputs[0] if outputs and outputs[0].requires_grad else None

    hooks = torch_private.backward_hooks_outside(module)
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), traced_as():
            return torch_private.dataflow_digest(forward, copies, state, params, python_backward=hooks)
    finally:
        with torch.no_grad():
            for name, value in module.named_buffers():
                if name in saved:
                    value.copy_(saved[name])


@dataclass(frozen=True)
class TrainerKey:
    """The key material one trainer's graphs share (everything but the batch) and the cache they live in."""

    cache: CompileCache
    shared: str  # digest of the options, versions, switches and model description

    def for_batch(self, kind: str, batch_digest: str, signature: Any) -> str:
        """The key of a graph of `kind` for a batch of `signature` whose dataflow digest is `batch_digest`."""
        return digest(FORMAT, self.shared, kind, batch_digest, signature)


def trainer_key(
    cache: CompileCache, config: Any, module: torch.nn.Module, extra: dict[str, Any] | None = None
) -> TrainerKey:
    """The shared key material of a trainer (`config`: trainer/config.TrainerConfig); Uncacheable when an option
    cannot be described."""
    options = describe_options(config.options._validated_opts)
    optimizer = {
        k: describe_options(v, f"optim.{k}") for k, v in sorted(vars(config.optim_config).items()) if k != "params"
    }
    groups = [describe_options(dict(g), "optim.params") for g in config.optim_config.params]
    switches = {n: os.environ.get(n, "") for n in ("ORTTRAINER_OPTIMIZER_UPDATE", "ORTTRAINER_DISABLE_REWRITES")}
    material = {
        "environment": environment(),
        "switches": switches,
        "options": options,
        "optimizer": [type(config.optim_config).__qualname__, optimizer, groups],
        "model_desc": [
            [[d.name, list(d.shape)] for d in config.model_desc.inputs],
            [[d.name, list(d.shape), bool(getattr(d, "is_loss", False))] for d in config.model_desc.outputs],
        ],
        "device": [config.device.type, config.device.index],
        "model": model_description(module, config.loss_fn),
        **(extra or {}),
    }
    return TrainerKey(cache, digest(FORMAT, material))
