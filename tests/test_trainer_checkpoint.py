"""Persistence through the trainer: exact resume, PyTorch round trips, legacy files, and every error path."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
import torch
from helpers import clone, make_trainer, max_difference, torch_weights, trainer_weights
from models import MLP, TinyTransformer, mlp_batches, mlp_desc, transformer_desc, transformer_loss

from orttrainer import optim
from orttrainer.checkpoint import storage
from orttrainer.optim import CosineWarmupLRScheduler

CE = torch.nn.functional.cross_entropy
HERE = os.path.dirname(__file__)


def _options(accumulation: int) -> dict:
    return {
        "batch": {"gradient_accumulation_steps": accumulation},
        "lr_scheduler": CosineWarmupLRScheduler(total_steps=10, warmup=0.2),
    }


def _config(name: str):
    return optim.AdamConfig(lr=1e-2, lambda_coef=0.01) if name == "adam" else optim.LambConfig(lr=1e-2)


def _full_state(trainer) -> dict[str, np.ndarray]:
    """Every state tensor plus the step counters, flattened for comparison."""
    state = trainer._training_session.get_state()
    info = trainer._train_step_info
    state["counters"] = np.array([info.step, info.optimization_step, trainer._state.counters.optimizer_updates])
    return state


@pytest.mark.parametrize("accumulation", [1, 3], ids=["no_accumulation", "accumulation_mid_window"])
@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_resume_is_exact(tmp_path, optimizer, accumulation):
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(10, seed=3)
    straight = make_trainer(clone(model), mlp_desc(), _config(optimizer), CE, _options(accumulation))
    for x, y in batches:
        straight.train_step(x, y)

    first = make_trainer(clone(model), mlp_desc(), _config(optimizer), CE, _options(accumulation))
    for x, y in batches[:5]:  # with 3 accumulation steps, step 5 is in the middle of the second window
        first.train_step(x, y)
    path = str(tmp_path / "half.ortcp")
    first.save_checkpoint(path, user_dict={"epoch": 1, "note": "halfway"})

    resumed = make_trainer(MLP(), mlp_desc(), _config(optimizer), CE, _options(accumulation))
    assert resumed.load_checkpoint(path) == {"epoch": 1, "note": "halfway"}
    for x, y in batches[5:]:
        resumed.train_step(x, y)
    assert max_difference(_full_state(resumed), _full_state(straight)) <= 1e-6


def test_resume_in_a_fresh_process_is_exact(tmp_path):
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(10, seed=3)
    torch.save({"model": model.state_dict(), "batches": batches}, tmp_path / "setup.pt")
    straight = make_trainer(clone(model), mlp_desc(), _config("lamb"), CE, _options(3))
    for x, y in batches:
        straight.train_step(x, y)
    first = make_trainer(clone(model), mlp_desc(), _config("lamb"), CE, _options(3))
    for x, y in batches[:5]:
        first.train_step(x, y)
    first.save_checkpoint(str(tmp_path / "half.ortcp"))

    script = f"""
import sys, json, torch, numpy as np
sys.path.insert(0, {HERE!r})
from helpers import make_trainer
from models import MLP, mlp_desc
from orttrainer import optim
from orttrainer.optim import CosineWarmupLRScheduler
setup = torch.load({str(tmp_path / "setup.pt")!r})
model = MLP(); model.load_state_dict(setup["model"])
options = {{"batch": {{"gradient_accumulation_steps": 3}},
            "lr_scheduler": CosineWarmupLRScheduler(total_steps=10, warmup=0.2)}}
trainer = make_trainer(model, mlp_desc(), optim.LambConfig(lr=1e-2), torch.nn.functional.cross_entropy, options)
trainer.load_checkpoint({str(tmp_path / "half.ortcp")!r})
for x, y in setup["batches"][5:]:
    trainer.train_step(x, y)
trainer.save_checkpoint({str(tmp_path / "end.ortcp")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    end = storage.load(str(tmp_path / "end.ortcp"))
    expected = straight.state_dict()
    for name, value in expected["model"]["full_precision"].items():
        np.testing.assert_allclose(end["model"]["full_precision"][name], value, atol=1e-6, rtol=0)
    for weight, entry in expected["optimizer"].items():
        for key, value in entry.items():
            np.testing.assert_allclose(end["optimizer"][weight][key], value, atol=1e-6, rtol=0)
    assert end["train_step_info"] == {"optimization_step": 3, "step": 10}


def test_state_dict_has_the_legacy_layout():
    torch.manual_seed(0)
    adam = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    lamb = make_trainer(MLP(), mlp_desc(), optim.LambConfig(), CE)
    sgd = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE)
    for trainer in (adam, lamb, sgd):
        trainer.train_step(*mlp_batches(1, seed=3)[0])
    state = adam.state_dict()
    assert set(state) == {"model", "optimizer", "trainer_options", "train_step_info"}
    assert sorted(state["model"]["full_precision"]) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert set(state["optimizer"]["fc1.weight"]) == {"Moment_1", "Moment_2", "Update_Count"}
    assert state["optimizer"]["fc1.weight"]["Update_Count"].tolist() == [2]
    assert state["trainer_options"] == {
        "mixed_precision": False,
        "zero_stage": 0,
        "world_rank": 0,
        "world_size": 1,
        "optimizer_name": "AdamOptimizer",
        "data_parallel_size": 1,
        "horizontal_parallel_size": 1,
    }
    assert state["train_step_info"] == {"optimization_step": 1, "step": 1}
    assert lamb.state_dict()["optimizer"]["shared_optimizer_state"]["Step"].tolist() == [2]
    assert "Update_Count" not in lamb.state_dict()["optimizer"]["fc1.weight"]
    assert sgd.state_dict()["optimizer"] == {}


def test_pytorch_format_round_trips_through_the_original_module():
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.1)
    trainer = make_trainer(model, transformer_desc(), optim.AdamConfig(lr=1e-2), transformer_loss)
    tokens, target = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
    for _ in range(3):
        trainer.train_step(tokens, target)
    fresh = TinyTransformer(dropout=0.1)
    fresh.load_state_dict(trainer.state_dict(pytorch_format=True))  # strict: every key, nothing extra
    fresh.eval()
    loss, logits = trainer.eval_step(tokens, target)
    torch.testing.assert_close(fresh(tokens), logits, rtol=1e-4, atol=1e-5)


def test_a_pytorch_state_dict_loads_into_the_trainer():
    torch.manual_seed(0)
    source = MLP()
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    x, y = mlp_batches(1, seed=3)[0]
    trainer.eval_step(x, y)
    trainer.load_state_dict(source.state_dict())
    torch.testing.assert_close(trainer.eval_step(x, y)[1], source(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"Missing keys: \['fc2.bias'\] in state_dict"):
        trainer.load_state_dict({k: v for k, v in source.state_dict().items() if k != "fc2.bias"})
    with pytest.raises(RuntimeError, match=r"Unexpected keys: \['extra'\] in state_dict"):
        trainer.load_state_dict({**source.state_dict(), "extra": torch.zeros(1)})


def test_load_state_dict_before_the_first_step_is_applied_with_its_checks_and_counters():
    torch.manual_seed(0)
    donor = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    x, y = mlp_batches(1, seed=3)[0]
    for _ in range(4):
        donor.train_step(x, y)
    state = donor.state_dict()
    fresh = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    with pytest.warns(UserWarning, match="training session is not initialized yet"):
        assert fresh.state_dict() == {}
    fresh.load_state_dict(state)
    with pytest.warns(UserWarning, match="training session is not initialized yet"):
        assert fresh.state_dict() is state
    assert torch.equal(fresh.eval_step(x, y)[1], donor.eval_step(x, y)[1])
    assert (fresh._train_step_info.step, fresh._train_step_info.optimization_step) == (4, 4)

    broken = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    broken.load_state_dict({**state, "model": {"full_precision": {}}})
    with pytest.raises(RuntimeError, match="Missing keys"):  # the original skipped these checks when deferred
        broken.eval_step(x, y)


def _trained(config=None):
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), config or optim.AdamConfig(), CE)
    trainer.train_step(*mlp_batches(1, seed=3)[0])
    return trainer


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s["model"].update({"half": {}}), r"Unexpected keys: \['half'\] in state_dict\[model\]"),
        (
            lambda s: s["model"]["full_precision"].pop("fc1.bias"),
            r"Missing keys: \['fc1.bias'\] in state_dict\[model\]\[full_precision\]",
        ),
        (
            lambda s: s["model"]["full_precision"].update({"fc3.bias": np.zeros(1)}),
            r"Unexpected keys: \['fc3.bias'\] in state_dict\[model\]\[full_precision\]",
        ),
        (lambda s: s["optimizer"].pop("fc2.weight"), r"Missing keys: \['fc2.weight'\] in state_dict\[optimizer\]"),
        (
            lambda s: s["optimizer"]["fc2.weight"].pop("Moment_2"),
            r"Missing keys: \['Moment_2'\] in state_dict\[optimizer\]\[fc2.weight\]",
        ),
        (
            lambda s: s["optimizer"]["fc2.weight"].update({"Moment_3": np.zeros(1)}),
            r"Unexpected keys: \['Moment_3'\] in state_dict\[optimizer\]\[fc2.weight\]",
        ),
    ],
)
def test_strict_loading_reports_missing_then_unexpected_keys_and_changes_nothing(mutate, message):
    trainer = _trained()
    state = trainer.state_dict()
    before = trainer_weights(trainer)
    mutate(state)
    with pytest.raises(RuntimeError, match=message):
        trainer.load_state_dict(state)
    assert max_difference(trainer_weights(trainer), before) == 0.0


def test_non_strict_loading_and_optimizer_mismatch():
    trainer = _trained()
    state = trainer.state_dict()
    state["model"]["full_precision"]["fc3.bias"] = np.zeros(1)
    state["model"]["full_precision"].pop("fc1.bias")
    trainer.load_state_dict(state, strict=False)
    lamb = _trained(optim.LambConfig())
    with pytest.raises(AssertionError, match="^Optimizer mismatch: expected LambOptimizer, got AdamOptimizer$"):
        lamb.load_state_dict(trainer.state_dict())


def test_a_wrong_shape_is_rejected_without_partial_loading():
    trainer = _trained()
    state = trainer.state_dict()
    state["model"]["full_precision"]["fc2.bias"] = np.zeros(3, np.float32)
    before = trainer_weights(trainer)
    with pytest.raises(ValueError, match=r"state 'fc2.bias': shape \(3,\) does not match \(10,\)"):
        trainer.load_state_dict(state)
    assert max_difference(trainer_weights(trainer), before) == 0.0


def test_checkpoint_without_optimizer_states_restores_weights_only(tmp_path):
    trainer = _trained()
    path = str(tmp_path / "weights.ortcp")
    trainer.save_checkpoint(path, include_optimizer_states=False)
    assert "optimizer" not in storage.load(path)
    fresh = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    fresh.eval_step(*mlp_batches(1, seed=3)[0])
    with pytest.warns(UserWarning, match="Missing key: optimizer in state_dict"):
        fresh.load_checkpoint(path)
    assert max_difference(trainer_weights(fresh), trainer_weights(trainer)) == 0.0


def test_save_checkpoint_refuses_an_existing_file_and_leaves_it_intact(tmp_path):
    trainer = _trained()
    path = tmp_path / "exists.ortcp"
    path.write_bytes(b"earlier")
    with pytest.raises(FileExistsError, match="exists.ortcp"):
        trainer.save_checkpoint(str(path))
    assert path.read_bytes() == b"earlier"


def test_a_failed_save_leaves_no_file_and_an_earlier_checkpoint_intact(tmp_path, monkeypatch):
    trainer = _trained()
    earlier = tmp_path / "earlier.ortcp"
    trainer.save_checkpoint(str(earlier))
    earlier_bytes = earlier.read_bytes()
    original = h5py.Group.create_dataset
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(h5py.Group, "create_dataset", failing)
    monkeypatch.setattr(h5py.Group, "__setitem__", lambda self, k, v: failing(self, k, data=v))
    target = tmp_path / "new.ortcp"
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.ortcp"]
    assert earlier.read_bytes() == earlier_bytes


def test_checkpoints_go_through_file_objects():
    trainer = _trained()
    buffer = io.BytesIO()
    trainer.save_checkpoint(buffer, user_dict={"k": [1, 2]})
    buffer.seek(0)
    fresh = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    fresh.eval_step(*mlp_batches(1, seed=3)[0])
    assert fresh.load_checkpoint(buffer) == {"k": [1, 2]}
    assert max_difference(trainer_weights(fresh), trainer_weights(trainer)) == 0.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no-such.ortcp"),
        (b"not an hdf5 file at all", "garbage.ortcp"),
        ("truncated", "truncated.ortcp"),
    ],
)
def test_missing_corrupt_or_truncated_checkpoints_are_named(tmp_path, content, message):
    trainer = _trained()
    if content == "truncated":
        trainer.save_checkpoint(str(tmp_path / "full.ortcp"))
        data = (tmp_path / "full.ortcp").read_bytes()
        (tmp_path / "truncated.ortcp").write_bytes(data[: len(data) // 2])
    elif content is not None:
        (tmp_path / "garbage.ortcp").write_bytes(content)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        trainer.load_checkpoint(str(tmp_path / message))


def _write_legacy_checkpoint(path: str, weights: dict[str, np.ndarray], optimizer: str, precision_key: str) -> None:
    """A checkpoint laid out exactly as the original ORTTrainer's _checkpoint_storage.save wrote it."""
    with h5py.File(path, "w-") as f:
        model = f.create_group("model").create_group(precision_key)
        for name, value in weights.items():
            model[name] = value
        opt = f.create_group("optimizer")
        for name, value in weights.items():
            group = opt.create_group(name)
            group["Moment_1"] = np.full_like(value, 0.01)
            group["Moment_2"] = np.full_like(value, 0.0004)
            if optimizer == "AdamOptimizer":
                group["Update_Count"] = np.array([8], dtype=np.int64)
        if optimizer == "LambOptimizer":
            opt.create_group("shared_optimizer_state")["Step"] = np.array([8], dtype=np.int64)
        options = f.create_group("trainer_options")
        for key, value in {
            "mixed_precision": np.bool_(False),
            "zero_stage": np.int64(0),
            "world_rank": np.int64(0),
            "world_size": np.int64(1),
            "data_parallel_size": np.int64(1),
            "horizontal_parallel_size": np.int64(1),
        }.items():
            options[key] = value
        options["optimizer_name"] = optimizer  # a variable-length string; reads back as bytes
        info = f.create_group("train_step_info")
        info["optimization_step"], info["step"] = np.int64(7), np.int64(7)
        f["user_dict"] = storage.to_serialized_hex({"epoch": 2})


@pytest.mark.parametrize("optimizer", ["AdamOptimizer", "LambOptimizer"])
@pytest.mark.parametrize("precision_key", ["full_precision", "fp32"])
def test_a_checkpoint_written_in_the_legacy_layout_loads(tmp_path, optimizer, precision_key):
    torch.manual_seed(0)
    weights = {n: p.detach().numpy() + 0.5 for n, p in MLP().named_parameters()}
    path = str(tmp_path / "legacy.ortcp")
    _write_legacy_checkpoint(path, weights, optimizer, precision_key)
    config = optim.AdamConfig() if optimizer == "AdamOptimizer" else optim.LambConfig()
    trainer = make_trainer(MLP(), mlp_desc(), config, CE)
    assert trainer.load_checkpoint(path) == {"epoch": 2}  # before the first step: applied at session creation
    x, y = mlp_batches(1, seed=3)[0]
    trainer.eval_step(x, y)
    assert max_difference(trainer_weights(trainer), weights) == 0.0
    assert trainer._training_session.get_state(["Moment_1_fc1.weight"])["Moment_1_fc1.weight"].max() == np.float32(0.01)
    assert (trainer._train_step_info.step, trainer._state.counters.optimizer_updates) == (7, 7)
    trainer.train_step(x, y)
    key = "Update_Count" if optimizer == "AdamOptimizer" else None
    state = trainer.state_dict()["optimizer"]
    counter = state["fc1.weight"][key] if key else state["shared_optimizer_state"]["Step"]
    assert counter.tolist() == [9]


def test_checkpoint_info_cli_reads_a_trainer_checkpoint(tmp_path):
    trainer = _trained()
    path = str(tmp_path / "c.ortcp")
    trainer.save_checkpoint(path, user_dict={"epoch": 1})
    out = tmp_path / "weights.pt"
    subprocess.run([sys.executable, "-m", "orttrainer.checkpoint", "to-pytorch", path, str(out)], check=True)
    model = MLP()
    model.load_state_dict(torch.load(out))
    assert max_difference(torch_weights(model), trainer_weights(trainer)) == 0.0
    info = subprocess.run(
        [sys.executable, "-m", "orttrainer.checkpoint", "info", path], check=True, capture_output=True, text=True
    ).stdout
    assert "fc1.weight" in info and "AdamOptimizer" in info


def test_state_dict_is_json_free_of_views():
    """state_dict values are copies: changing them does not touch the trainer."""
    trainer = _trained()
    state = trainer.state_dict()
    state["model"]["full_precision"]["fc1.weight"][:] = 0
    assert trainer_weights(trainer)["fc1.weight"].any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        json.dumps(state["train_step_info"])


def test_experimental_checkpoint_api_round_trips_through_a_real_trainer(tmp_path):
    from orttrainer import checkpoint

    trainer = _trained(optim.LambConfig())
    with pytest.warns(DeprecationWarning, match="experimental_save_checkpoint"):
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), checkpoint_state_dict={"epoch": 3})
    assert (tmp_path / "ORT_checkpoint.ort.pt").exists()
    flat = trainer._flat_state()
    assert flat["Step"].tolist() == [2] and "Moment_1_fc1.weight" in flat

    fresh = make_trainer(MLP(), mlp_desc(), optim.LambConfig(), CE)  # no session yet: applied on the first step
    with pytest.warns(DeprecationWarning):
        extra = checkpoint.experimental_load_checkpoint(fresh, str(tmp_path))
    assert extra == {"epoch": 3}
    fresh.eval_step(*mlp_batches(1, seed=3)[0])
    assert max_difference(trainer_weights(fresh), trainer_weights(trainer)) == 0.0
    assert fresh._state.counters.optimizer_updates == 1
