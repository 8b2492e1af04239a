"""Faults and bad input at the trainer: a step that raises changes nothing, bad batches and calls are refused
before anything runs, and debug dumps that cannot be written do not stop training."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from helpers import make_trainer, needs_training_build
from models import MLP, mlp_desc

from orttrainer import optim

CE = torch.nn.functional.cross_entropy


def _batch(seed: int = 0, label: int | None = None):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (8,), generator=g) if label is None else torch.full((8,), label)
    return torch.randn(8, 32, generator=g), y


def _snapshot(trainer) -> tuple[dict, tuple]:
    info = trainer._train_step_info
    counters = (info.step, info.optimization_step, trainer._state.counters.optimizer_updates)
    return trainer._training_session.get_state(), counters


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def _fail_once(monkeypatch):
    """ONNX Runtime raises in the next training run (a fault injected at the one call into its run API)."""
    from orttrainer.trainer.runtime import ort_private

    real = ort_private.run_with_ort_values
    calls = {"n": 0}

    def run(session, feeds, fetches, run_options):
        calls["n"] += 1
        if calls["n"] == 1:
            real(session, feeds, fetches, run_options)  # the kernels run (dropout draws), then the step fails
            raise RuntimeError("injected fault after the run")
        return real(session, feeds, fetches, run_options)

    monkeypatch.setattr(ort_private, "run_with_ort_values", run)


@pytest.mark.parametrize("fault", ["label_out_of_range", "injected"])
def test_a_step_that_fails_inside_onnxruntime_changes_nothing(monkeypatch, fault):
    """An out-of-range label fails inside ONNX Runtime (the graph's range check, graph/class_labels.py), as does an
    injected fault after the kernels ran; the model has dropout, so the stream must not move either."""
    options = {"batch": {"gradient_accumulation_steps": 2}, "_internal_use": {"gradient_builder": "torch"}}
    trainers = []
    for _ in range(2):
        torch.manual_seed(0)
        trainers.append(make_trainer(DropoutMLP(), mlp_desc(), optim.AdamConfig(lr=1e-2), CE, options))
    trainer, reference = trainers
    for t in trainers:
        t.train_step(*_batch(1))  # mid accumulation window
    before = _snapshot(trainer)
    bad = _batch(2, label=99) if fault == "label_out_of_range" else _batch(2)
    if fault == "injected":
        _fail_once(monkeypatch)
    with pytest.raises(Exception, match="PyTorch refuses it|injected fault"):
        trainer.train_step(*bad)
    after = _snapshot(trainer)
    assert after[1] == before[1] == (1, 0, 0) and _same(after[0], before[0])
    for t in trainers:
        t.train_step(*_batch(3))  # completes the window as if the failed step never happened
    assert _same(trainer._training_session.get_state(), reference._training_session.get_state())
    assert trainer.step == reference.step == 2 and trainer.optimization_step == 1


class DropoutMLP(MLP):
    def forward(self, x):
        return torch.nn.functional.dropout(super().forward(x), 0.3, self.training)


def test_empty_and_meta_batches_are_refused_before_anything_runs():
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE)
    with pytest.raises(ValueError, match=r"input 'x' is empty \(shape \[0, 32\]\); a step needs at least one sample"):
        trainer.train_step(torch.zeros(0, 32), torch.zeros(0, dtype=torch.int64))
    assert trainer._training_session is None and trainer.step == 0  # not even exported
    x, y = _batch()
    trainer.train_step(x, y)
    with pytest.raises(ValueError, match="is empty"):
        trainer.train_step(torch.zeros(0, 32), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="input 'x' is on the meta device and holds no data"):
        trainer.train_step(x.to("meta"), y)
    assert trainer.step == 1


def test_save_checkpoint_before_the_first_step_is_refused_and_writes_nothing(tmp_path):
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    path = tmp_path / "early.ortcp"
    with pytest.raises(RuntimeError, match="save_checkpoint before the first train_step or eval_step"):
        trainer.save_checkpoint(str(path))
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_an_sgd_checkpoint_into_an_adam_trainer_is_an_optimizer_mismatch(tmp_path):
    sgd = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE)
    sgd.train_step(*_batch())
    sgd.save_checkpoint(str(tmp_path / "sgd.ortcp"))
    adam = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    adam.train_step(*_batch())
    with pytest.raises(AssertionError, match="^Optimizer mismatch: expected AdamOptimizer, got SGDOptimizer$"):
        adam.load_checkpoint(str(tmp_path / "sgd.ortcp"))


def test_debug_graph_dumps_that_cannot_be_written_warn_and_training_goes_on(tmp_path):
    missing = str(tmp_path / "no" / "such" / "dir")
    paths = {
        "model_after_graph_transforms_path": f"{missing}/a.onnx",
        "model_with_gradient_graph_path": str(tmp_path),  # a directory, not a file
        "model_with_training_graph_path": f"{missing}/c.onnx",
        "model_with_training_graph_after_optimization_path": f"{missing}/d.onnx",
    }
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"debug": {"graph_save_paths": paths}})
    with pytest.warns(UserWarning, match="cannot be written") as seen:
        loss = trainer.train_step(*_batch())[0]
    named = {key for key in paths for w in seen if f"debug.graph_save_paths.{key}=" in str(w.message)}
    assert named == set(paths) and torch.isfinite(loss)


@needs_training_build
def test_extra_postprocess_must_return_a_model_on_the_pytorch_path_too():
    options = {"_internal_use": {"extra_postprocess": lambda model: None}}
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, options)
    with pytest.raises(AssertionError, match=r"options _internal_use.extra_postprocess returned NoneType"):
        trainer.train_step(*_batch())


class NoParameters(torch.nn.Module):
    def forward(self, x):
        return x.mean()


@pytest.mark.parametrize("config", [optim.AdamConfig(), optim.LambConfig(), optim.SGDConfig()], ids=lambda c: c.name)
def test_a_model_without_trainable_parameters_trains_with_clipping_on(config):
    """From ONNX Runtime's legacy ORTTrainer tests: loss = mean of an input, grad_norm_clip at its default."""
    desc = {"inputs": [("x", ["batch", 4])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(NoParameters(), desc, config)
    assert float(trainer.train_step(torch.ones(2, 4))) == 1.0 and trainer.optimization_step == 1
    assert isinstance(trainer._onnx_model, onnx.ModelProto)
