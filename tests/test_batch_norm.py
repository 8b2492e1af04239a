"""Buffers the forward updates: BatchNorm's running statistics and batch counter move exactly as PyTorch moves them,
on both gradient builders (issue: the `ort` builder used the population variance and never counted; the torch
builder moved nothing), and so do `eval_step`, `save_as_onnx` and checkpoints; any other buffer update is carried
(torch builder) or refused naming the buffer, never dropped."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import pytest
import torch
from helpers import make_trainer, needs_training_build
from onnx import numpy_helper
from torch import nn

from orttrainer import optim
from orttrainer.trainer.runtime import has_training_build

CE = nn.functional.cross_entropy
BUILDERS = ["torch", pytest.param("ort", marks=needs_training_build)]


class Net(nn.Module):
    """A convolution or a linear layer, then the norm layer under test, then a linear head."""

    def __init__(self, norm: nn.Module, dims: int) -> None:
        super().__init__()
        self.dims = dims
        self.body = nn.Linear(6, 4) if dims == 1 else [nn.Conv2d, nn.Conv3d][dims - 2](2, 4, 3, padding=1)
        self.norm = norm
        self.head = nn.Linear(4 if dims == 1 else 4 * 3**dims, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.body(x))).flatten(1))


def _desc(dims: int) -> dict:
    shape = ["batch", 6] if dims == 1 else ["batch", 2, *([3] * dims)]
    return {"inputs": [("x", shape), ("y", ["batch"])], "outputs": [("loss", [], True), ("logits", ["batch", 3])]}


def _batches(dims: int, n: int = 4, batch: int = 4):
    g = torch.Generator().manual_seed(3)
    shape = (batch, 6) if dims == 1 else (batch, 2, *([3] * dims))
    return [(torch.randn(*shape, generator=g) * 2 + 1, torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def _train_both(
    model: nn.Module, dims: int, builder: str, accumulation: int = 1, extra: dict | None = None, steps: int = 4
):
    """The trainer and PyTorch (SGD, the mean gradient of `accumulation` micro-batches) on the same batches."""
    reference = copy.deepcopy(model)
    options = {"batch": {"gradient_accumulation_steps": accumulation}, "_internal_use": {"gradient_builder": builder}}
    trainer = make_trainer(model, _desc(dims), optim.SGDConfig(lr=0.1), CE, {**options, **(extra or {})})
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_batches(dims, n=steps)):
        trainer.train_step(x, y)
        (CE(reference(x), y) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            sgd.step()
            sgd.zero_grad()
    return trainer, reference


def _assert_state_like(trainer, reference: nn.Module, atol: float = 1e-5) -> None:
    mine = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(mine[name].to(value.dtype), value, rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize(
    ("dims", "momentum", "accumulation"),
    [(1, 0.1, 1), (1, None, 2), (2, 0.3, 1), (2, None, 1), (3, 0.1, 2)],
)
def test_running_statistics_and_the_batch_counter_move_as_pytorch_moves_them(builder, dims, momentum, accumulation):
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims - 1](4, momentum=momentum)
    trainer, reference = _train_both(Net(norm, dims), dims, builder, accumulation)
    assert reference.norm.num_batches_tracked == 4
    _assert_state_like(trainer, reference)
    x, _ = _batches(dims, n=1, batch=5)[0]
    with torch.no_grad():
        expected = reference.eval()(x)
    torch.testing.assert_close(
        trainer.eval_step(x, torch.zeros(5, dtype=torch.long))[1], expected, atol=1e-5, rtol=1e-4
    )


@pytest.mark.parametrize("builder", BUILDERS)
def test_without_running_statistics_or_in_eval_mode_nothing_moves(builder):
    torch.manual_seed(0)
    untracked = Net(nn.BatchNorm2d(4, track_running_stats=False), 2)
    if builder == "ort":  # the TorchScript exporter cannot export it: named, and 'auto' takes the torch builder
        with pytest.raises(RuntimeError, match=r"\['norm'\] keep no running statistics.*gradient_builder='torch'"):
            _train_both(untracked, 2, builder)
        builder_for_untracked = "auto"
    else:
        builder_for_untracked = builder
    trainer, reference = _train_both(untracked, 2, builder_for_untracked)
    _assert_state_like(trainer, reference)
    frozen = Net(nn.BatchNorm2d(4), 2).eval()  # an eval-mode module trains on its running statistics
    with torch.no_grad():
        frozen.norm.running_mean.add_(0.5)
    trainer, reference = _train_both(frozen, 2, builder)
    _assert_state_like(trainer, reference)
    assert "norm.num_batches_tracked" not in trainer._training_session.state_names()
    assert int(trainer.state_dict(pytorch_format=True)["norm.num_batches_tracked"]) == 0


@pytest.mark.parametrize("builder", BUILDERS)
def test_the_statistics_reach_save_as_onnx_and_checkpoints(builder, tmp_path):
    torch.manual_seed(0)
    trainer, reference = _train_both(Net(nn.BatchNorm1d(4), 1), 1, builder)
    path = str(tmp_path / "model.onnx")
    trainer.save_as_onnx(path)
    saved = {i.name: numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}
    np.testing.assert_allclose(saved["norm.running_var"], reference.norm.running_var.numpy(), rtol=1e-4, atol=1e-6)
    trainer.save_checkpoint(str(tmp_path / "run.ortcp"))
    torch.manual_seed(1)
    options = {"_internal_use": {"gradient_builder": builder}}
    fresh = make_trainer(Net(nn.BatchNorm1d(4), 1), _desc(1), optim.SGDConfig(lr=0.1), CE, options)
    fresh.train_step(*_batches(1)[0])
    fresh.load_checkpoint(str(tmp_path / "run.ortcp"))
    _assert_state_like(fresh, reference)
    older = trainer.state_dict()  # a checkpoint saved before the batch counter was state
    del older["model"]["full_precision"]["norm.num_batches_tracked"]
    with pytest.warns(UserWarning, match=r"no \['norm.num_batches_tracked'\].*keep their values"):
        fresh.load_state_dict(older)


@pytest.mark.parametrize("builder", BUILDERS)
def test_under_mixed_precision_the_statistics_move_in_float32(builder):
    """One step: its statistics come from the initial weights alone (a loss scaler that skips an overflowing step
    would make later weights, and so later statistics, differ from float32 PyTorch's for reasons of its own)."""
    torch.manual_seed(0)
    trainer, reference = _train_both(
        Net(nn.BatchNorm1d(4), 1), 1, builder, extra={"mixed_precision": {"enabled": True}}, steps=1
    )
    state = trainer.state_dict(pytorch_format=True)
    assert state["norm.running_var"].dtype == torch.float32 and int(state["norm.num_batches_tracked"]) == 1
    for name in ("norm.running_mean", "norm.running_var"):
        torch.testing.assert_close(state[name], reference.state_dict()[name], rtol=5e-3, atol=5e-3, msg=name)


class Counting(nn.Module):
    """A module that counts its calls in a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x)


def test_another_buffer_the_forward_updates_is_carried_or_refused():
    """The torch builder carries any in-place buffer update; the TorchScript export the 'ort' builder trains from
    drops it, so 'ort' refuses the model naming the buffer and 'auto' trains it with the torch builder."""
    torch.manual_seed(0)
    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    for builder in ["torch", "auto"]:
        trainer = make_trainer(
            Counting(), desc, optim.SGDConfig(lr=0.1), CE, {"_internal_use": {"gradient_builder": builder}}
        )
        for x, y in _batches(1):
            trainer.train_step(x, y)
        assert trainer.gradient_builder == "torch"
        assert float(trainer.state_dict(pytorch_format=True)["calls"]) == 4
    if has_training_build():
        trainer = make_trainer(Counting(), desc, optim.SGDConfig(), CE, {"_internal_use": {"gradient_builder": "ort"}})
        with pytest.raises(RuntimeError, match=r"updates the buffers \['calls'\] in place.*gradient_builder='torch'"):
            trainer.train_step(*_batches(1)[0])


def test_instance_norm_with_running_statistics_moves_them():
    torch.manual_seed(0)
    model = Net(nn.InstanceNorm2d(4, affine=True, track_running_stats=True), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, reference = _train_both(model, 2, "auto")
    assert trainer.gradient_builder == "torch"  # the TorchScript export drops the update: 'auto' took the torch route
    _assert_state_like(trainer, reference)


def _onnx_batch_norm_model() -> onnx.ModelProto:
    """y = BatchNormalization(x W) in training mode (momentum 0.8: the old value's weight), loss = mean((y - t)²)."""
    h = onnx.helper
    nodes = [
        h.make_node("MatMul", ["x", "W"], ["h"]),
        h.make_node(
            "BatchNormalization",
            ["h", "scale", "bias", "mean", "var"],
            ["y", "mean_out", "var_out"],
            training_mode=1,
            momentum=0.8,
        ),
        h.make_node("Sub", ["y", "t"], ["d"]),
        h.make_node("Mul", ["d", "d"], ["d2"]),
        h.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((5, 4)).astype(np.float32), "W"),
        numpy_helper.from_array(np.ones(4, np.float32), "scale"),
        numpy_helper.from_array(np.zeros(4, np.float32), "bias"),
        numpy_helper.from_array(np.full(4, 0.5, np.float32), "mean"),
        numpy_helper.from_array(np.full(4, 2.0, np.float32), "var"),
    ]
    graph = h.make_graph(
        nodes,
        "bn",
        [h.make_tensor_value_info("x", 1, ["b", 5]), h.make_tensor_value_info("t", 1, ["b", 4])],
        [h.make_tensor_value_info("loss", 1, [])],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 15)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("builder", BUILDERS)
def test_an_onnx_model_s_batch_normalization_moves_its_statistics_by_the_onnx_specification(builder):
    """ONNX's semantics: `running = momentum · running + (1 - momentum) · batch`, the population variance."""
    desc = {"inputs": [("x", ["b", 5]), ("t", ["b", 4])], "outputs": [("loss", [], True)]}
    model = _onnx_batch_norm_model()
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.0), None, {"_internal_use": {"gradient_builder": builder}})
    weights = numpy_helper.to_array(model.graph.initializer[0])
    mean, var = np.full(4, 0.5, np.float32), np.full(4, 2.0, np.float32)
    g = np.random.default_rng(1)
    for _ in range(3):
        x = g.standard_normal((6, 5)).astype(np.float32)
        trainer.train_step(torch.from_numpy(x), torch.zeros(6, 4))
        h = x @ weights
        mean, var = 0.8 * mean + 0.2 * h.mean(0), 0.8 * var + 0.2 * h.var(0)
    state = trainer.state_dict()["model"]["full_precision"]
    np.testing.assert_allclose(state["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["var"], var, rtol=1e-5, atol=1e-6)
    assert set(state) >= {"mean", "var"} and "W" in trainer._built.compiled.trainable


def _hand_built_batch_norm() -> onnx.ModelProto:
    """X (N, 3, 4) → training-mode BatchNormalization over the state tensors mean/var (and a counter) → Y."""
    from onnx import TensorProto, helper

    inits = [
        numpy_helper.from_array(np.ones(3, np.float32), "scale"),
        numpy_helper.from_array(np.zeros(3, np.float32), "bias"),
        numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "mean"),
        numpy_helper.from_array(np.array([1.0, 2.0, 0.5], np.float32), "var"),
        numpy_helper.from_array(np.array(3, np.int64), "count"),
    ]
    node = helper.make_node(
        "BatchNormalization",
        ["X", "scale", "bias", "mean", "var"],
        ["Y", "batch_mean_out", "batch_var_out"],
        training_mode=1,
        momentum=0.9,
    )
    graph = helper.make_graph(
        [node],
        "bn",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3, 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("momentum", "unbiased"), [(0.1, True), (None, True), (0.1, False)])
def test_the_pass_on_a_hand_built_graph_outputs_pytorch_s_or_onnx_s_update(momentum, unbiased):
    from onnx.reference import ReferenceEvaluator

    from orttrainer.trainer.compile.contract import buffer_update_name
    from orttrainer.trainer.graph.batch_norm_statistics import BatchNormStatistics, update_batch_norm_statistics

    model = _hand_built_batch_norm()
    spec = BatchNormStatistics("mean", "var", "count" if unbiased else None, momentum, unbiased)
    updated = update_batch_norm_statistics(model, [spec])
    assert len(model.graph.output) == 1  # the input model is not modified
    outputs = [buffer_update_name(n) for n in ("mean", "var", "count" if unbiased else None) if n]
    assert sorted(o.name for o in updated.graph.output) == sorted(["Y", *outputs])
    x = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32) * 2 + 1
    y, *moved = ReferenceEvaluator(updated).run(["Y", *outputs], {"X": x})  # the ONNX specification's semantics
    batch_mean = x.mean(axis=(0, 2))
    batch_var = x.var(axis=(0, 2), ddof=1 if unbiased else 0)
    f = 1 / (3 + 1) if momentum is None else momentum
    np.testing.assert_allclose(moved[0], (1 - f) * np.array([0.5, -1.0, 2.0]) + f * batch_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(moved[1], (1 - f) * np.array([1.0, 2.0, 0.5]) + f * batch_var, rtol=1e-5, atol=1e-6)
    if unbiased:
        assert int(moved[2]) == 4
    normalized = (x - batch_mean[None, :, None]) / np.sqrt(x.var(axis=(0, 2))[None, :, None] + 1e-5)
    np.testing.assert_allclose(y, normalized, rtol=1e-4, atol=1e-4)  # the node still normalises by the batch
