"""The deprecated torch.save-based checkpoint API (docs/legacy_api.md §9.3), against a small fake trainer that
honours the trainer contract documented in orttrainer.checkpoint.experimental."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch

from orttrainer import ORTTrainerOptions, checkpoint
from orttrainer.checkpoint import _CombineZeroCheckpoint, _get_checkpoint_name, _split_state_dict


class FakeTrainer:
    """Holds a flat state like a trainer's session; ``start()`` plays the first train_step."""

    def __init__(self, state=None, *, zero_stage=0, rank=0, world_size=1, torch_keys=None):
        self.options = ORTTrainerOptions(
            {
                "distributed": {
                    "world_rank": rank,
                    "world_size": world_size,
                    "deepspeed_zero_optimization": {"stage": zero_stage},
                }
            }
        )
        self._training_session = None
        self._torch_state_dict_keys = torch_keys
        self._state = dict(state or {})
        self._state_dict = None  # parked before the session exists, as ORTTrainer parks it
        self._load_state_dict_strict = False
        self.loads: list[tuple[dict, bool]] = []

    def start(self):
        self._training_session = object()
        if self._state_dict is not None:
            parked, self._state_dict = self._state_dict, None
            self._load_flat_state(parked, self._load_state_dict_strict)
        return self

    def _flat_state(self):
        return {name: value.clone() for name, value in self._state.items()}

    def _load_flat_state(self, state, strict):
        if self._training_session is None:
            self._state_dict, self._load_state_dict_strict = state, strict
            return
        self.loads.append((state, strict))
        self._state.update(state)


def _adam_state(scale=1.0):
    return {
        "fc.weight": torch.arange(6.0).reshape(2, 3) * scale,
        "fc.bias": torch.tensor([0.5, -0.5]) * scale,
        "Moment_1_fc.weight": torch.full((2, 3), 0.1),
        "Moment_2_fc.weight": torch.full((2, 3), 0.01),
        "Update_Count_fc.weight": torch.tensor([3]),
        "Step": torch.tensor([3]),
    }


def _deprecations(record, name):
    return [
        str(w.message)
        for w in record
        if w.category is DeprecationWarning
        and str(w.message) == f"experimental_{name}() will be deprecated soon. Please use ORTTrainer.{name}() instead."
    ]


def _assert_same(actual: dict, expected: dict):
    assert set(actual) == set(expected)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


# --- state dict ---------------------------------------------------------------------------------------------------


def test_state_dict_before_first_step_warns_and_is_empty():
    with pytest.warns(Warning) as record:
        assert checkpoint.experimental_state_dict(FakeTrainer(_adam_state())) == {}
    assert _deprecations(record, "state_dict")
    assert any(
        str(w.message) == "ONNX Runtime training session is not initialized yet. "
        "Please run train_step or eval_step at least once before calling state_dict()."
        for w in record
    )


def test_state_dict_returns_weights_and_optimizer_tensors():
    trainer = FakeTrainer(_adam_state()).start()
    with pytest.warns(DeprecationWarning) as record:
        state = checkpoint.experimental_state_dict(trainer)
    assert _deprecations(record, "state_dict")
    _assert_same(state, _adam_state())


def test_state_dict_without_optimizer_state():
    with_keys = FakeTrainer(_adam_state(), torch_keys=["fc.weight", "fc.bias", "not.in.session"]).start()
    with pytest.warns(DeprecationWarning):
        state = checkpoint.experimental_state_dict(with_keys, include_optimizer_state=False)
    assert list(state) == ["fc.weight", "fc.bias"]
    without_keys = FakeTrainer({**_adam_state(), "fc.weight_fp16": torch.ones(2, 3).half()}).start()
    with pytest.warns(DeprecationWarning):
        state = checkpoint.experimental_state_dict(without_keys, include_optimizer_state=False)
    assert set(state) == {"fc.weight", "fc.bias", "fc.weight_fp16"}  # legacy kept the optimizer tensors here


def test_load_state_dict_before_first_step_is_applied_at_start():
    trainer = FakeTrainer(_adam_state())
    new = _adam_state(scale=2.0)
    with pytest.warns(DeprecationWarning) as record:
        assert checkpoint.experimental_load_state_dict(trainer, new, strict=True) is None
    assert _deprecations(record, "load_state_dict")
    assert trainer.loads == [] and trainer._state_dict is new and trainer._load_state_dict_strict is True
    with pytest.warns(Warning) as record:
        assert checkpoint.experimental_state_dict(trainer) is new  # the pending state, as in legacy
    assert any("training session is not initialized yet" in str(w.message) for w in record)
    trainer.start()
    assert trainer.loads == [(new, True)] and trainer._state_dict is None
    assert torch.equal(trainer._state["fc.bias"], torch.tensor([1.0, -1.0]))


def test_load_state_dict_after_first_step():
    trainer = FakeTrainer(_adam_state()).start()
    with pytest.warns(DeprecationWarning):
        checkpoint.experimental_load_state_dict(trainer, {"fc.bias": torch.tensor([7.0, 8.0])})
    assert trainer.loads[-1][1] is False
    assert torch.equal(trainer._state["fc.bias"], torch.tensor([7.0, 8.0]))


def test_strict_load_rejects_unknown_tensor():
    trainer = FakeTrainer(_adam_state()).start()
    with pytest.warns(DeprecationWarning), pytest.raises(RuntimeError) as error:
        checkpoint.experimental_load_state_dict(
            trainer, {"fc.bias": torch.zeros(2), "extra": torch.zeros(1)}, strict=True
        )
    assert str(error.value) == "Checkpoint tensor: extra is not present in the model."
    assert trainer.loads == []


# --- save / load checkpoint ---------------------------------------------------------------------------------------


def test_checkpoint_names():
    assert _get_checkpoint_name("ORT_checkpoint", False) == "ORT_checkpoint.ort.pt"
    assert _get_checkpoint_name("ckpt", 1, 2, 4) == "ckpt.ZeRO.2.3.ort.pt"


def test_save_checkpoint_writes_model_and_user_state(tmp_path):
    trainer = FakeTrainer(_adam_state()).start()
    extra = {"epoch": 4}
    with pytest.warns(DeprecationWarning) as record:
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), checkpoint_state_dict=extra)
    assert _deprecations(record, "save_checkpoint")
    assert extra == {"epoch": 4}  # the caller's dict is not modified (legacy added 'model' to it)
    assert os.listdir(tmp_path) == ["ORT_checkpoint.ort.pt"]
    saved = torch.load(tmp_path / "ORT_checkpoint.ort.pt", weights_only=False)
    assert saved["epoch"] == 4
    _assert_same(saved["model"], _adam_state())


def test_save_checkpoint_overwrites_with_warning_atomically(tmp_path):
    trainer = FakeTrainer(_adam_state()).start()
    with pytest.warns(DeprecationWarning):
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), "ck")
    path = tmp_path / "ck.ort.pt"
    trainer._state["fc.bias"] = torch.tensor([9.0, 9.0])
    with pytest.warns(Warning) as record:
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), "ck")
    assert f"{path} already exists, overwriting." in [str(w.message) for w in record]
    assert torch.equal(torch.load(path, weights_only=False)["model"]["fc.bias"], torch.tensor([9.0, 9.0]))
    before = path.read_bytes()
    with pytest.warns(Warning), pytest.raises((AttributeError, pickle.PicklingError)):
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), "ck", {"unpicklable": lambda: 0})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ck.ort.pt"]


def test_save_checkpoint_needs_the_directory(tmp_path):
    missing = str(tmp_path / "absent")
    trainer = FakeTrainer(_adam_state()).start()
    with pytest.warns(DeprecationWarning), pytest.raises(AssertionError) as error:
        checkpoint.experimental_save_checkpoint(trainer, missing)
    assert str(error.value) == f"checkpoint_dir ({missing}) directory doesn't exist"


def test_save_checkpoint_zero_name(tmp_path):
    trainer = FakeTrainer(_adam_state(), zero_stage=1, rank=1, world_size=2).start()
    with pytest.warns(DeprecationWarning):
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), "ck")
    assert os.listdir(tmp_path) == ["ck.ZeRO.1.1.ort.pt"]


def test_load_checkpoint_round_trip(tmp_path):
    source = FakeTrainer(_adam_state(scale=3.0)).start()
    with pytest.warns(DeprecationWarning):
        checkpoint.experimental_save_checkpoint(source, str(tmp_path), checkpoint_state_dict={"epoch": 2})
    target = FakeTrainer(_adam_state()).start()
    with pytest.warns(DeprecationWarning) as record:
        extra = checkpoint.experimental_load_checkpoint(target, str(tmp_path), strict=True)
    assert _deprecations(record, "load_checkpoint")
    assert extra == {"epoch": 2}
    _assert_same(target._state, _adam_state(scale=3.0))
    assert target.loads[-1][1] is True


def test_load_checkpoint_without_files(tmp_path):
    with pytest.warns(DeprecationWarning), pytest.raises(AssertionError) as error:
        checkpoint.experimental_load_checkpoint(FakeTrainer().start(), str(tmp_path), "nothing")
    assert str(error.value) == f"No checkpoint found with prefix 'nothing' at '{tmp_path}'"


def _zero_rank_states():
    """Two ZeRO ranks: fc.weight (2x3) is sharded into 3-element views, its fp16 copy is whole on each rank."""
    full = torch.arange(6.0).reshape(2, 3)
    ranks = []
    for rank in range(2):
        ranks.append(
            {
                "fc.weight_fp16": full.half(),
                f"fc.weight_view_{rank}": full.reshape(-1)[3 * rank : 3 * rank + 3],
                f"Moment_1_fc.weight_view_{rank}": torch.full((3,), float(rank)),
                f"Update_Count_fc.weight_view_{rank}": torch.tensor([10 + rank]),
                "fc.bias": torch.tensor([1.0, 2.0]),
                "Step": torch.tensor([4]),
            }
        )
    return full, ranks


def _write_zero_files(directory, prefix="ck"):
    full, ranks = _zero_rank_states()
    for rank, state in enumerate(ranks):
        torch.save(
            {"model": state, "epoch": 5, f"only_rank_{rank}": rank}, f"{directory}/{prefix}.ZeRO.{rank}.1.ort.pt"
        )
    return full


def test_combine_zero_checkpoint(tmp_path):
    full = _write_zero_files(tmp_path)
    files = sorted(str(p) for p in tmp_path.iterdir())
    with pytest.warns(
        DeprecationWarning, match=r"^_CombineZeroCheckpoint.aggregate_checkpoints\(\) will be deprecated"
    ):
        state = _CombineZeroCheckpoint(files).aggregate_checkpoints()
    assert set(state) == {
        "fc.weight_fp16",
        "fc.weight",
        "Moment_1_fc.weight",
        "Update_Count_fc.weight",
        "fc.bias",
        "Step",
    }
    assert torch.equal(state["fc.weight"], full)  # shards concatenated, then given the fp16 copy's shape
    assert torch.equal(state["Moment_1_fc.weight"], torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    assert torch.equal(state["Update_Count_fc.weight"], torch.tensor([10]))  # the first shard's count
    assert torch.equal(state["Step"], torch.tensor([4]))


def test_combine_zero_checkpoint_errors(tmp_path):
    _write_zero_files(tmp_path)
    files = sorted(str(p) for p in tmp_path.iterdir())
    with pytest.raises(AssertionError, match="^Could not find 2 files$"):
        _CombineZeroCheckpoint(files[:1])
    with pytest.raises(AssertionError, match="^No checkpoint files passed$"):
        _CombineZeroCheckpoint([])
    with pytest.raises(ValueError, match="is not named like a ZeRO checkpoint"):
        _CombineZeroCheckpoint([str(tmp_path / "plain.ort.pt")])
    state = torch.load(files[1], weights_only=False)
    state["model"]["fc.bias"] = torch.tensor([1.0, 3.0])
    torch.save(state, files[1])
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(AssertionError, match="^Unsharded params must have the same value: fc.bias$"),
    ):
        _CombineZeroCheckpoint(files).aggregate_checkpoints()


def test_load_zero_files_into_a_trainer_without_zero(tmp_path):
    full = _write_zero_files(tmp_path)
    trainer = FakeTrainer().start()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        extra = checkpoint.experimental_load_checkpoint(trainer, str(tmp_path), "ck")
    assert any("Found more than one file with prefix ck" in str(w.message) for w in record)
    assert extra == {"epoch": 5, "only_rank_0": 0, "only_rank_1": 1}
    assert torch.equal(trainer._state["fc.weight"], full)


def test_zero_trainer_loads_its_own_rank(tmp_path):
    _, ranks = _zero_rank_states()
    _write_zero_files(tmp_path)
    trainer = FakeTrainer(zero_stage=1, rank=1, world_size=2).start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = checkpoint.experimental_load_checkpoint(trainer, str(tmp_path), "ck")
    assert extra == {"epoch": 5, "only_rank_1": 1}
    _assert_same(trainer._state, ranks[1])
    lonely = FakeTrainer(zero_stage=1, rank=3, world_size=4).start()
    with warnings.catch_warnings(), pytest.raises(AssertionError) as error:
        warnings.simplefilter("ignore")
        checkpoint.experimental_load_checkpoint(lonely, str(tmp_path), "ck")
    assert str(error.value).startswith(f"Couldn't find checkpoint file {tmp_path}/ck.ZeRO.3.3.ort.pt.")
    assert str(error.value).endswith("for rank 3 of 4")


def test_split_state_dict():
    state = {
        "w": 1,
        "w_fp16": 2,
        "Moment_1_w": 3,
        "Moment_2_w": 4,
        "Update_Count_w": 5,
        "Step": 6,
    }
    assert _split_state_dict(state) == {
        "optimizer": {"Moment_1_w": 3, "Moment_2_w": 4, "Update_Count_w": 5, "Step": 6},
        "fp32_param": {"w": 1},
        "fp16_param": {"w_fp16": 2},
    }


def test_rank_files_list_in_numeric_order(tmp_path):
    for rank in (10, 2, 0, 1):
        (tmp_path / f"ck.ZeRO.{rank}.10.ort.pt").write_bytes(b"")
    names = [os.path.basename(p) for p in checkpoint._list_checkpoint_files(str(tmp_path), "ck")]
    assert names == ["ck.ZeRO.0.10.ort.pt", "ck.ZeRO.1.10.ort.pt", "ck.ZeRO.2.10.ort.pt", "ck.ZeRO.10.10.ort.pt"]
