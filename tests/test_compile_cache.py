"""The persistent compile cache (orttrainer/trainer/compile/cache.py, build/cached.py): a second trainer of the same
model (as a second process would) gets its graphs from the cache and trains exactly as a fresh build does; any
change of what the key covers is a miss; a corrupt entry is rebuilt; writes are atomic; the cache can be off."""

from __future__ import annotations

import logging
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import make_trainer, max_difference, needs_training_build, trainer_weights
from models import MLP, DoubledGradient, mlp_desc
from torch import nn

from orttrainer import optim
from orttrainer.trainer.compile import cache as cache_module
from orttrainer.trainer.runtime import ort as ort_module
from orttrainer.trainer.runtime.ort import ONNXRUNTIME_GRAPHS, Device, OptimizedGraphs, create_session

HIT = "the compiled graphs come from the compile cache"
CE = nn.functional.cross_entropy
BUILDERS = [pytest.param("ort", marks=needs_training_build), "torch"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv("ORTTRAINER_COMPILE_CACHE", str(directory))
    return directory


def _entries(directory) -> list[str]:
    """The trainers' entries (not ONNX Runtime's optimised graphs, runtime/ort.OptimizedGraphs)."""
    found = directory.rglob("*.entry") if directory.exists() else []
    return sorted(str(p) for p in found if ONNXRUNTIME_GRAPHS not in p.relative_to(directory).parts)


def _batches(n: int = 3, size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 32, generator=g), torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


MISS = "compile cache miss"


def _train(model_factory, builder: str, caplog, data=None, extra=None, config=None, loss_fn=CE):
    """A trainer of a fresh model (seed 0) trained on `data`; returns (trainer, losses, hit)."""
    torch.manual_seed(0)
    model = model_factory()
    extra = extra or {}
    options = {
        **extra,
        "_internal_use": {"gradient_builder": builder, **extra.get("_internal_use", {})},
        "utils": {"grad_norm_clip": False, **extra.get("utils", {})},
    }
    trainer = make_trainer(model, mlp_desc(), config or optim.AdamConfig(lr=1e-2), loss_fn, options)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        losses = [float(trainer.train_step(x, y)[0]) for x, y in data or _batches()]
    return trainer, losses, HIT in caplog.text


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_second_trainer_gets_the_graphs_from_the_cache_and_trains_the_same(builder, cache_dir, caplog):
    first, losses, hit = _train(MLP, builder, caplog)
    assert not hit and len(_entries(cache_dir)) >= 1
    second, cached_losses, hit = _train(MLP, builder, caplog)
    assert hit and cached_losses == losses
    assert max_difference(trainer_weights(first), trainer_weights(second)) == 0.0
    assert second._built.builder == first._built.builder
    x, y = _batches(1)[0]  # the eval graph and state_dict work on the cached build
    np.testing.assert_allclose(first.eval_step(x, y)[1].numpy(), second.eval_step(x, y)[1].numpy())
    assert second.state_dict()["model"]["full_precision"].keys() == first.state_dict()["model"]["full_precision"].keys()
    # what the dry run learned: the typed model_desc from the entry, PyTorch's first outputs run when read
    assert second._built.model_desc.outputs == first._built.model_desc.outputs
    for ours, theirs in zip(second.torch_sample_outputs, first.torch_sample_outputs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_cached_build_runs_the_dry_run_only_when_its_outputs_are_read(builder, cache_dir, caplog, monkeypatch):
    from orttrainer.trainer.build import export

    _train(MLP, builder, caplog)
    runs = []
    real = export._dry_run
    monkeypatch.setattr(export, "_dry_run", lambda *args: runs.append(args) or real(*args))
    trainer, _, hit = _train(MLP, builder, caplog)
    assert hit and runs == []  # three steps, and PyTorch never ran the model's eval-mode copy
    outputs = trainer.torch_sample_outputs
    assert len(runs) == 1 and outputs[0].dim() == 0  # read: run once (the loss first), then kept
    assert trainer.torch_sample_outputs is outputs and len(runs) == 1


@pytest.mark.parametrize("builder", BUILDERS)
def test_batch_norm_statistics_move_the_same_on_a_cached_build(builder, cache_dir, caplog):
    first, losses, _ = _train(Normalised, builder, caplog)
    second, cached_losses, hit = _train(Normalised, builder, caplog)
    assert hit and cached_losses == losses
    before, after = (t.state_dict()["model"]["full_precision"] for t in (first, second))
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= after.keys()
    assert max_difference(before, after) == 0.0 and int(after["bn.num_batches_tracked"]) == 3
    assert float(np.abs(np.asarray(after["bn.running_mean"])).max()) > 0  # they moved (tests/test_batch_norm.py
    # checks how against PyTorch)


@pytest.mark.parametrize("builder", BUILDERS)
def test_save_as_onnx_after_a_cached_build(builder, cache_dir, caplog, tmp_path):
    _train(MLP, builder, caplog)
    trainer, _, hit = _train(MLP, builder, caplog)
    assert hit
    trainer.save_as_onnx(str(tmp_path / "model.onnx"))  # the forward model is exported when first asked
    import onnx

    saved = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "model.onnx")).graph.initializer}
    weights = trainer_weights(trainer)
    assert max_difference({k: saved[k] for k in weights}, weights) == 0.0


def test_the_torch_builders_graphs_for_other_shapes_are_cached_too(cache_dir, caplog):
    sizes = (8, 5, 3, 6, 4)  # 8, 5 and 3 traced for their shapes, 6 with dynamic dims, which serve 4
    data = [batch for seed, size in enumerate(sizes) for batch in _batches(1, size=size, seed=seed)]
    _, losses, _ = _train(MLP, "torch", caplog, data)
    trainer, cached_losses, hit = _train(MLP, "torch", caplog, data)
    assert hit and cached_losses == losses
    assert "tracing and compiling" not in caplog.text
    assert caplog.text.count("the training graph comes from the compile cache") == 4
    assert trainer._training_session.training_graph_count == 4  # 6 and 4: one dynamic-dims graph, one session


EVAL_HIT = "the eval graph comes from the compile cache"


def _evaluated(trainer, caplog, monkeypatch) -> tuple[list[np.ndarray], int]:
    """The logits of eval steps on batches of 8 and 5, and how many eval graphs were traced for them."""
    from orttrainer.trainer.build import torch_route

    traces = []
    trace = torch_route.build_torch_forward_graph
    monkeypatch.setattr(torch_route, "build_torch_forward_graph", lambda *a: traces.append(a) or trace(*a))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        logits = [trainer.eval_step(x, y)[1].numpy() for x, y in [*_batches(1, size=8), *_batches(1, size=5)]]
    return logits, len(traces)


def test_the_torch_routes_traced_eval_graphs_are_cached(cache_dir, caplog, monkeypatch):
    first, _, _ = _train(Normalised, "torch", caplog)
    want, traced = _evaluated(first, caplog, monkeypatch)
    assert traced == 2 and EVAL_HIT not in caplog.text
    second, _, hit = _train(Normalised, "torch", caplog)
    got, traced = _evaluated(second, caplog, monkeypatch)
    assert hit and traced == 0 and caplog.text.count(EVAL_HIT) == 2
    for ours, theirs in zip(got, want, strict=True):
        np.testing.assert_array_equal(ours, theirs)


class EvalScaled(MLP):
    """MLP whose output is scaled in eval mode only: the training graph and its digest do not see the scale."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x):
        logits = super().forward(x)
        return logits if self.training else logits * self.scale


def test_an_eval_graph_is_keyed_by_the_eval_mode_forward(cache_dir, caplog, monkeypatch):
    first, _, _ = _train(lambda: EvalScaled(1.0), "torch", caplog)
    want, _ = _evaluated(first, caplog, monkeypatch)
    second, _, hit = _train(lambda: EvalScaled(2.0), "torch", caplog)
    got, traced = _evaluated(second, caplog, monkeypatch)
    assert hit and traced == 2 and EVAL_HIT not in caplog.text  # the training graph is the same, not the eval graph
    for ours, theirs in zip(got, want, strict=True):
        np.testing.assert_allclose(ours, 2 * theirs, rtol=1e-6)


@needs_training_build
def test_the_ort_builders_specialised_graph_is_cached(cache_dir, caplog):
    _train(MLP, "ort", caplog)
    assert "specialising the training graph" in caplog.text
    _, _, hit = _train(MLP, "ort", caplog)
    assert hit and "specialising the training graph" not in caplog.text


# every part of the key -------------------------------------------------------------------------------------------


class Wider(MLP):
    def __init__(self) -> None:
        super().__init__(hidden=48)


class OtherActivation(MLP):
    """Same parameters and shapes as MLP; the forward differs."""

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Renamed(nn.Module):
    """MLP's computation with other parameter names."""

    def __init__(self) -> None:
        super().__init__()
        base = MLP()
        self.first, self.second = base.fc1, base.fc2

    def forward(self, x):
        return self.second(nn.functional.gelu(self.first(x)))


class Normalised(MLP):
    """BatchNorm between the layers: its running statistics are `<buffer>__updated` outputs of the graph."""

    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(64, momentum=momentum)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.bn(self.fc1(x))))


class CumulativeNormalised(Normalised):
    def __init__(self) -> None:
        super().__init__(momentum=None)


def _weighted(weights: list[float]):
    table = torch.tensor(weights)

    def loss(logits, target):
        return nn.functional.cross_entropy(logits, target, weight=table)

    return loss


class _Tripled(DoubledGradient):
    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class Through(MLP):
    """MLP with a custom autograd.Function between the layers, chosen by an argument: the class's source is the
    same, so only the dataflow (the Function's backward) tells two of them apart."""

    def __init__(self, function: type[torch.autograd.Function] = DoubledGradient) -> None:
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.fc2(self.function.apply(nn.functional.gelu(self.fc1(x))))


class Scaled(MLP):
    """The hidden activations scaled by their mean magnitude, with or without its gradient: the same forward ops."""

    def __init__(self, scale_gradient: bool = True) -> None:
        super().__init__()
        self.scale_gradient = scale_gradient

    def forward(self, x):
        h = nn.functional.gelu(self.fc1(x))
        with torch.set_grad_enabled(self.scale_gradient):
            scale = h.abs().mean()
        return self.fc2(h * scale)


class Rotated(MLP):
    """The hidden activations rotated pairwise by a table kept as a non-persistent buffer, as transformers' rotary
    embeddings keep `inv_freq` (real) and torchtitan its `freqs_cis` (complex): no trainer state, so the graphs
    hold its values. `theta` changes the values, not the shapes."""

    def __init__(self, theta: float = 10000.0, complex_table: bool = False) -> None:
        super().__init__()
        angles = torch.arange(32.0) / theta ** (torch.arange(32.0) / 32)
        self.complex_table = complex_table
        table = torch.polar(torch.ones(32), angles) if complex_table else angles
        self.register_buffer("table", table, persistent=False)

    def forward(self, x):
        h = nn.functional.gelu(self.fc1(x))
        pairs = h.float().view(h.shape[0], 32, 2)
        if self.complex_table:
            rotated = torch.view_as_real(torch.view_as_complex(pairs) * self.table)
        else:
            cos, sin = self.table.cos().unsqueeze(-1), self.table.sin().unsqueeze(-1)
            rotated = torch.cat(
                [pairs[..., :1] * cos - pairs[..., 1:] * sin, pairs[..., :1] * sin + pairs[..., 1:] * cos], -1
            )
        return self.fc2(rotated.flatten(1))


CHANGES = {
    "model structure (width)": {"model": Wider},
    "model structure (same parameters, another forward)": {"model": OtherActivation},
    "parameter names": {"model": Renamed},
    "parameter dtypes": {"model": lambda: MLP().double(), "data": [(x.double(), y) for x, y in _batches()]},
    "a frozen parameter": {"extra": {"utils": {"frozen_weights": ["fc1.bias"]}}},
    "an option (accumulation)": {"extra": {"batch": {"gradient_accumulation_steps": 2}}},
    "an option (clipping)": {"extra": {"utils": {"grad_norm_clip": True}}},
    "the optimizer": {"config": optim.AdamConfig(lr=1e-2, alpha=0.8)},
    "the input shapes": {"data": _batches(size=6)},
    "a constant of the loss": {"loss_fn": _weighted([2.0] + [1.0] * 9)},
    "BatchNorm's momentum": {"model": CumulativeNormalised},
    "a custom Function's backward": {"model": lambda: Through(_Tripled)},
    "a gradient not taken (no_grad)": {"model": lambda: Scaled(scale_gradient=False)},
    "a non-persistent buffer's values": {"model": lambda: Rotated(theta=500000.0)},
    "a complex non-persistent buffer's values": {"model": lambda: Rotated(theta=500000.0, complex_table=True)},
}
BASES = {
    "a constant of the loss": {"loss_fn": _weighted([1.0] * 10)},
    "BatchNorm's momentum": {"model": Normalised},
    "a custom Function's backward": {"model": Through},
    "a gradient not taken (no_grad)": {"model": Scaled},
    "a non-persistent buffer's values": {"model": Rotated},
    "a complex non-persistent buffer's values": {"model": lambda: Rotated(complex_table=True)},
}
# the 'ort' builder refuses custom Functions and a gradient not taken (its exporter writes the ops under no_grad as
# plain ops: docs/engine.md §42); its exporter, complex values
TORCH_ONLY = (
    "parameter dtypes",
    "a custom Function's backward",
    "a gradient not taken (no_grad)",
    "a complex non-persistent buffer's values",
)


# float64 needs the torch builder: ONNX Runtime's SoftmaxCrossEntropyLossGrad mixes float32 and float64
@pytest.mark.parametrize(
    "change, builder",
    [
        *(pytest.param(c, "ort", marks=needs_training_build) for c in CHANGES if c not in TORCH_ONLY),
        *((c, "torch") for c in CHANGES),
    ],
)
def test_a_change_of_what_the_key_covers_is_a_miss(change, builder, cache_dir, caplog):
    base = {"model": MLP, **BASES.get(change, {})}
    _train(base["model"], builder, caplog, loss_fn=base.get("loss_fn", CE))
    changed = {**base, **CHANGES[change]}
    before = _entries(cache_dir)

    def train():
        return _train(
            changed["model"],
            builder,
            caplog,
            data=changed.get("data"),
            extra=changed.get("extra"),
            config=changed.get("config"),
            loss_fn=changed.get("loss_fn", CE),
        )

    if change == "parameter dtypes":
        # the key is what is tested: the maintained runtime's session may refuse the float64 graph afterwards
        # (a float32 gradient output type), which is no part of the cache
        with caplog.at_level(logging.INFO, logger="orttrainer"):
            try:
                _, _, hit = train()
            except Exception:
                hit = HIT in caplog.text
        assert not hit and MISS in caplog.text
        return
    _, losses, hit = train()
    assert not hit and MISS in caplog.text and len(_entries(cache_dir)) > len(before)
    assert all(np.isfinite(losses))


def test_another_version_is_a_miss(cache_dir, caplog, monkeypatch):
    _train(MLP, "torch", caplog)
    versions = {**cache_module.environment(), "torch": "0.0.0"}
    monkeypatch.setattr(cache_module, "environment", lambda: versions)
    _, _, hit = _train(MLP, "torch", caplog)
    assert not hit


def test_another_switch_is_a_miss(cache_dir, caplog, monkeypatch):
    _train(MLP, "torch", caplog)
    monkeypatch.setenv("ORTTRAINER_OPTIMIZER_UPDATE", "graph")
    _, _, hit = _train(MLP, "torch", caplog)
    assert not hit


# robustness --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "empty", "another key's entry"])
def test_a_corrupt_entry_is_detected_rebuilt_and_rewritten(damage, cache_dir, caplog):
    _, losses, _ = _train(MLP, "torch", caplog)
    (path,) = _entries(cache_dir)
    data = bytearray(open(path, "rb").read())
    if damage == "flipped byte":
        data[-100] ^= 0xFF  # inside the training graph
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:  # a valid entry under the wrong name
        _train(Wider, "torch", caplog)
        other = next(p for p in _entries(cache_dir) if p != path)
        data = bytearray(open(other, "rb").read())
    with open(path, "wb") as f:
        f.write(bytes(data))
    _, rebuilt, hit = _train(MLP, "torch", caplog)
    assert not hit and rebuilt == losses
    assert "is corrupt" in caplog.text
    _, again, hit = _train(MLP, "torch", caplog)  # rewritten: a hit again
    assert hit and again == losses


@pytest.mark.parametrize("planted", ["another user's file", "writable by others", "symlink", "fifo"])
def test_an_entry_that_is_not_this_users_own_file_is_not_read(planted, cache_dir, caplog, monkeypatch, tmp_path):
    """A shared or world-writable cache directory: what someone else put at an entry's name is never read (a FIFO
    does not block the read); the graph is built again and the trainer's own entry replaces it."""
    _, losses, _ = _train(MLP, "torch", caplog)
    (path,) = _entries(cache_dir)
    reason = {
        "another user's file": "belongs to another user",
        "writable by others": "is writable by other users",
        "symlink": "cannot read the compile cache entry",
        "fifo": "is not a regular file",
    }[planted]
    real_getuid = os.getuid
    if planted == "another user's file":  # the same bytes, seen from another uid
        monkeypatch.setattr(cache_module.os, "getuid", lambda: real_getuid() + 1)
    elif planted == "writable by others":
        os.chmod(path, 0o666)
    elif planted == "symlink":  # to a valid entry of this key: still not read through the link
        target = tmp_path / "elsewhere.entry"
        os.replace(path, target)
        os.symlink(target, path)
    else:
        os.remove(path)
        os.mkfifo(path)
    with pytest.warns(RuntimeWarning, match=reason):
        _, rebuilt, hit = _train(MLP, "torch", caplog)
    assert not hit and rebuilt == losses
    monkeypatch.setattr(cache_module.os, "getuid", real_getuid)
    assert os.path.isfile(path) and not os.path.islink(path) and os.stat(path).st_mode & 0o077 == 0
    _, again, hit = _train(MLP, "torch", caplog)  # the trainer's own entry now
    assert hit and again == losses


def test_writes_are_atomic(cache_dir, caplog, monkeypatch):
    """A write that fails before its rename leaves no entry and no temporary file; training goes on."""

    def failing_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.warns(RuntimeWarning, match="cannot write the compile cache entry"):
        _, losses, _ = _train(MLP, "torch", caplog)
    assert all(np.isfinite(losses))
    assert not [p for p in cache_dir.rglob("*") if p.is_file()]


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ORTTRAINER_COMPILE_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _train(MLP, "torch", caplog)
    _, _, hit = _train(MLP, "torch", caplog)
    assert not hit and not list(tmp_path.rglob("*.entry"))


def test_the_default_directory_is_under_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("ORTTRAINER_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_module.cache_directory() == os.path.join(str(tmp_path), "orttrainer", "compile")


@needs_training_build  # extra_postprocess transforms ONNX Runtime's gradient graph
def test_a_user_function_option_is_not_cached(cache_dir, caplog):
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        _, _, hit = _train(MLP, "ort", caplog, extra={"_internal_use": {"extra_postprocess": lambda m: m}})
    assert not hit and "compile cache not used: _internal_use.extra_postprocess" in caplog.text
    assert not _entries(cache_dir)


# ONNX Runtime's optimised graphs (runtime/ort.OptimizedGraphs) ---------------------------------------------------


def _affine(weight: float = 1.0, dropout: bool = False) -> onnx.ModelProto:
    """y = x @ w + b, which ONNX Runtime's optimiser fuses into one Gemm; with a Dropout after it if asked."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.full((3, 2), weight, dtype=np.float32), "w")
    b = numpy_helper.from_array(np.arange(2, dtype=np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    if dropout:
        nodes[-1].output[0] = "z"
        nodes.append(helper.make_node("Dropout", ["z"], ["y"], seed=1))
    graph = helper.make_graph(
        nodes,
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
        [w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _graphs_stored(directory) -> list[str]:
    return sorted(str(p) for p in (directory / ONNXRUNTIME_GRAPHS).rglob("*.entry"))


def _session(model, graphs, options=None, disabled=()):
    options = options or ort.SessionOptions()
    return create_session(model, options, [(ort_module.CPU_PROVIDER, {})], Device("cpu"), "", disabled, True, graphs)


def _levels_of_sessions(monkeypatch) -> list:
    """The optimisation level of every InferenceSession created from now on, and the model each was given."""
    made, real = [], ort.InferenceSession

    def recorded(model, options, **kwargs):
        made.append((options.graph_optimization_level, model))
        return real(model, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recorded)
    return made


def test_onnx_runtime_s_optimised_graph_is_stored_then_loaded_with_the_optimiser_off(cache_dir, monkeypatch):
    graphs = OptimizedGraphs.for_sessions(None, Device("cpu"))
    assert graphs is not None
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    expected = x @ np.ones((3, 2), np.float32) + np.arange(2, dtype=np.float32)
    first = _session(_affine(), graphs)
    (stored,) = _graphs_stored(cache_dir)
    assert not _entries(cache_dir)  # a trainer's entries are apart
    made = _levels_of_sessions(monkeypatch)
    options = ort.SessionOptions()
    second = _session(_affine(), graphs, options)
    ((level, model),) = made
    assert level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert [n.op_type for n in onnx.load_from_string(model).graph.node] == ["Gemm"]  # the optimiser's output
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # restored
    for session in (first, second):
        np.testing.assert_allclose(session.run(None, {"x": x})[0], expected)
    assert _graphs_stored(cache_dir) == [stored]


def test_the_optimised_graph_s_key_is_everything_the_optimiser_reads(cache_dir, monkeypatch):
    graphs = OptimizedGraphs.for_sessions(None, Device("cpu"))
    assert graphs is not None
    cpu = [(ort_module.CPU_PROVIDER, {})]

    def key(model=None, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, disabled=(), deterministic=False):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        options.use_deterministic_compute = deterministic
        return graphs.key((model or _affine()).SerializeToString(), options, cpu, disabled)

    base = key()
    assert key() == base
    changed = {
        "the model": key(_affine(weight=2.0)),
        "the level": key(level=ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
        "a disabled optimiser": key(disabled=["MatMulAddFusion"]),
        "deterministic compute": key(deterministic=True),
    }
    monkeypatch.setattr(ort_module, "processor", lambda: "another processor")
    changed["the processor"] = key()
    monkeypatch.setattr(ort, "__version__", "0.0.0")
    changed["the onnxruntime version"] = key()
    assert len({base, *changed.values()}) == len(changed) + 1, changed


def test_optimised_graphs_are_kept_only_where_their_key_is_complete(cache_dir, monkeypatch):
    graphs = OptimizedGraphs.for_sessions(None, Device("cpu"))
    assert graphs is not None
    options = ort.SessionOptions()
    assert graphs.serves(_affine(), options)
    assert not graphs.serves(_affine(dropout=True), options)  # seeds drawn per trainer are in its bytes
    with monkeypatch.context() as patched:
        patched.setattr(OptimizedGraphs, "MAX_BYTES", _affine().ByteSize() - 1)
        assert not graphs.serves(_affine(), options)  # a graph carrying large initializers
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert not graphs.serves(_affine(), options)  # nothing optimised to keep
    assert OptimizedGraphs.for_sessions(ort.SessionOptions(), Device("cpu")) is None  # the user's SessionOptions
    assert OptimizedGraphs.for_sessions(None, Device("cuda", 0)) is None
    _session(_affine(dropout=True), graphs)
    assert not _graphs_stored(cache_dir)
    with monkeypatch.context() as patched:
        patched.setattr(ort_module, "processor", lambda: None)  # no /proc/cpuinfo
        assert OptimizedGraphs.for_sessions(None, Device("cpu")) is None
    monkeypatch.setenv("ORTTRAINER_COMPILE_CACHE", "off")
    assert OptimizedGraphs.for_sessions(None, Device("cpu")) is None


def test_an_optimised_graph_onnx_runtime_cannot_load_is_replaced(cache_dir, caplog):
    graphs = OptimizedGraphs.for_sessions(None, Device("cpu"))
    assert graphs is not None
    _session(_affine(), graphs)
    (path,) = _graphs_stored(cache_dir)
    key = os.path.basename(path).removesuffix(".entry")
    cache_module.CompileCache(str(cache_dir / ONNXRUNTIME_GRAPHS)).store(key, {}, {"model": b"not an onnx model"})
    with caplog.at_level(logging.WARNING, logger="orttrainer"):
        session = _session(_affine(), graphs)
    assert "cannot load the cached optimised graph" in caplog.text
    x = np.ones((4, 3), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], [[3.0, 4.0]] * 4)
    assert onnx.load_from_string(graphs._cache.load(key).blobs["model"]).graph.node  # replaced by a real graph


def test_a_second_trainer_loads_onnx_runtime_s_optimised_graphs_and_trains_the_same(cache_dir, caplog, monkeypatch):
    _, losses, _ = _train(MLP, "torch", caplog)
    stored = _graphs_stored(cache_dir)
    assert stored
    made = _levels_of_sessions(monkeypatch)
    _, again, hit = _train(MLP, "torch", caplog)
    assert hit and again == losses
    assert made and all(level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL for level, _ in made)
    assert _graphs_stored(cache_dir) == stored


def test_a_session_opens_when_its_optimised_graph_cannot_be_written(cache_dir, monkeypatch):
    graphs = OptimizedGraphs.for_sessions(None, Device("cpu"))
    assert graphs is not None
    real = ort.InferenceSession

    def no_space(model, options, **kwargs):
        if options.optimized_model_filepath:
            raise RuntimeError("No space left on device")
        return real(model, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", no_space)
    session = _session(_affine(), graphs)
    np.testing.assert_allclose(session.run(None, {"x": np.ones((4, 3), np.float32)})[0], [[3.0, 4.0]] * 4)
    assert not _graphs_stored(cache_dir)
