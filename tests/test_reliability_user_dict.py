"""A checkpoint cannot run code: user_dict is stored without pickle where it is plain data, and loading unpickles
only plain data unless the caller passes trusted=True (legacy hex pickles included). Also the experimental
torch.save files: torch.load(weights_only=True) unless trusted."""

from __future__ import annotations

import collections
import io
import os
import pickle
import warnings

import h5py
import numpy as np
import pytest
import torch
from helpers import make_trainer, trainer_weights
from legacy_checkpoint_files import adam_state, write_checkpoint
from models import MLP, mlp_desc

from orttrainer import ORTTrainerOptions, checkpoint, optim
from orttrainer.checkpoint import cli, safe_pickle, storage
from orttrainer.checkpoint.safe_pickle import UnsafePickleError
from orttrainer.checkpoint.user_dict import FORMAT, decode_user_dict, encode_user_dict

CE = torch.nn.functional.cross_entropy


class _Payload:
    """Unpickling it writes a file: the proof that a load ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


class _Config:
    def __init__(self, lr: float = 0.1) -> None:
        self.lr = lr

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Config) and other.lr == self.lr


def _plain_values() -> dict:
    """One of every plain kind, including what a naive JSON encoding would get wrong."""
    return {
        "epoch": 3,
        "lr": 0.5,
        "nan": float("nan"),
        "huge": 10**30,
        "flag": True,
        "nothing": None,
        "text": "résumé \udc80",
        "raw": b"\x00\xffbytes",
        "complex": 1 - 2j,
        "pair": (1, [2, (3.5, "x")]),
        7: "int key",
        (1, "a"): "tuple key",
        "nested": {"a": {"b": []}},
        "array": np.arange(6, dtype=">i4").reshape(2, 3),
        "zero_d": np.array(7, dtype=np.int16),
        "scalar": np.float32(1.5),
        "bools": np.array([True, False]),
        "half": np.ones(3, np.float16),
        "tensor": torch.arange(4.0).reshape(2, 2).requires_grad_(),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "parameter": torch.nn.Parameter(torch.zeros(2)),
        "ints": torch.tensor([[1, 2]], dtype=torch.int64),
        "state_dict": torch.nn.Linear(2, 2).state_dict(),
    }


def _assert_same(actual, expected, where="user_dict"):
    assert type(actual) is type(expected), (where, type(actual), type(expected))
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual.detach(), expected.detach()) and actual.requires_grad == expected.requires_grad
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        np.testing.assert_array_equal(actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        assert vars(actual) == vars(expected) if isinstance(expected, collections.OrderedDict) else True
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{index}]")
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, where
    else:
        assert actual == expected, where


def _trained(config=None):
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), config or optim.AdamConfig(lr=1e-2), CE)
    trainer.train_step(torch.randn(8, 32), torch.randint(0, 10, (8,)))
    return trainer


def _legacy_file(path, user_dict_hex: str) -> None:
    """A checkpoint in the original layout for MLP, with the given hex string as its user_dict."""
    torch.manual_seed(0)
    weights = {n: p.detach().numpy() for n, p in MLP().named_parameters()}
    write_checkpoint(path, weights=weights, optimizer=adam_state(weights))
    with h5py.File(path, "a") as handle:
        handle["user_dict"] = user_dict_hex


# --- the trainer --------------------------------------------------------------------------------------------------


def test_crafted_checkpoint_runs_no_code_on_load(tmp_path):
    marker = tmp_path / "ran.txt"
    path = tmp_path / "crafted.ortcp"
    _legacy_file(path, pickle.dumps({"epoch": 1, "payload": _Payload(str(marker))}).hex())
    trainer = _trained()
    before = trainer_weights(trainer)
    with pytest.raises(UnsafePickleError) as error:
        trainer.load_checkpoint(str(path))
    message = str(error.value)
    assert "user_dict['payload'] needs builtins.exec" in message and str(path) in message
    assert "trusted=True" in message
    assert not marker.exists()
    for name, value in trainer_weights(trainer).items():  # refused before the state was touched
        np.testing.assert_array_equal(value, before[name])


def test_plain_user_dict_is_saved_without_pickle_and_round_trips(tmp_path):
    path = tmp_path / "c.ortcp"
    saved = _plain_values()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plain data: no "needs trusted=True" warning
        _trained().save_checkpoint(str(path), user_dict=saved)
    with h5py.File(path, "r") as handle:
        group = handle["user_dict"]
        assert isinstance(group, h5py.Group) and group["format"][()] == FORMAT.encode()
        assert '"pickle"' not in group["tree"][()].decode()
    loaded = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE).load_checkpoint(str(path))
    _assert_same(loaded, saved)


def test_a_value_that_is_not_plain_is_pickled_alone_and_needs_trust(tmp_path):
    path = tmp_path / "c.ortcp"
    with pytest.warns(UserWarning, match=r"user_dict\['cfg'\] needs .*_Config.*trusted=True"):
        _trained().save_checkpoint(str(path), user_dict={"epoch": 2, "cfg": _Config(0.3)})
    fresh = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE)
    with pytest.raises(UnsafePickleError, match=r"user_dict\['cfg'\] needs .*_Config"):
        fresh.load_checkpoint(str(path))
    assert fresh.load_checkpoint(str(path), trusted=True) == {"epoch": 2, "cfg": _Config(0.3)}


def test_a_value_that_cannot_be_saved_is_named():
    with pytest.raises(TypeError, match=r"Cannot save user_dict\['fn'\]\[0\]: a function is neither plain data"):
        encode_user_dict({"fn": [lambda: 1]})


def test_legacy_hex_user_dict_with_plain_data_loads_without_trust(tmp_path):
    path = tmp_path / "legacy.ortcp"
    user_dict = {"epoch": 2, "t": torch.arange(3.0), "a": np.ones((2, 2), np.float32), "s": {1, 2}}
    _legacy_file(path, pickle.dumps(user_dict).hex())
    loaded = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE).load_checkpoint(str(path))
    assert loaded["epoch"] == 2 and loaded["s"] == {1, 2} and torch.equal(loaded["t"], torch.arange(3.0))
    np.testing.assert_array_equal(loaded["a"], np.ones((2, 2), np.float32))


# --- the format and the restricted unpickler ----------------------------------------------------------------------


def test_user_dict_format_round_trips_through_storage():
    buffer = io.BytesIO()
    saved = _plain_values()
    storage.save({"user_dict": encode_user_dict(saved)}, buffer)
    _assert_same(decode_user_dict(storage.load(buffer)["user_dict"]), saved)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_restricted_unpickler_loads_plain_data_of_every_protocol(protocol):
    saved = {k: v for k, v in _plain_values().items() if k != "text"}  # protocol 0 cannot write lone surrogates
    saved["array"] = saved["array"].astype(np.int32)  # numpy itself drops '>' byte order from pickles before 5
    saved.update(
        {"set": {1, 2}, "frozen": frozenset({3}), "size": torch.Size([2, 3]), "dtype": torch.float16},
        strings=np.array(["a", "bc"]),
        objects=np.array([1, "x"], dtype=object),
        bytearray=bytearray(b"q"),
    )
    loaded = safe_pickle.loads(pickle.dumps(saved, protocol=protocol), where="test", path="user_dict")
    for key in ("set", "frozen", "size", "dtype", "bytearray"):
        assert loaded[key] == saved[key] and type(loaded[key]) is type(saved[key])
    for key in ("strings", "objects"):
        np.testing.assert_array_equal(loaded[key], saved[key])
    _assert_same(
        {k: loaded[k] for k in _plain_values() if k != "text"}, {k: saved[k] for k in _plain_values() if k != "text"}
    )


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_restricted_unpickler_names_every_refused_global_and_runs_none(tmp_path, protocol):
    marker = tmp_path / "ran.txt"
    data = pickle.dumps({"ok": 1, "deep": [0, {"x": _Payload(str(marker))}], "cfg": _Config()}, protocol=protocol)
    with pytest.raises(UnsafePickleError) as error:
        safe_pickle.loads(data, where="file.ortcp", path="user_dict")
    assert "user_dict['deep'][1]['x'] needs builtins.exec" in str(error.value)
    assert "user_dict['cfg'] needs" in str(error.value) and "_Config" in str(error.value)
    assert not marker.exists()
    assert pickle.loads(data)["cfg"] == _Config() and marker.exists()  # what trusted=True does


class _Reduces:
    """Pickles as ``reduction``: lets a test write the pickles an attacker would."""

    def __init__(self, *reduction) -> None:
        self.reduction = reduction

    def __reduce__(self):
        return self.reduction


def test_restricted_unpickler_sets_state_only_on_plain_types():
    tensor_func, tensor_args = torch.ones(2).__reduce_ex__(2)
    for value, refused in [
        (_Reduces(tensor_func, tensor_args, {"evil": 1}), "torch.Tensor"),  # Tensor.__setstate__ is not for us
        (_Reduces(collections.OrderedDict, (), ({}, {"x": 1})), "collections.OrderedDict"),  # setattr slot state
    ]:
        with pytest.raises(UnsafePickleError, match=f"the state of a {refused}"):
            safe_pickle.loads(pickle.dumps({"v": value}), where="f", path="user_dict")


def test_storage_bytes_inside_a_tensor_pickle_are_not_unpickled_freely(tmp_path):
    """torch's own _load_from_bytes runs torch.load(weights_only=False): a second pickle inside the first."""
    marker = tmp_path / "ran.txt"
    inner = io.BytesIO()
    torch.save(_Payload(str(marker)), inner)
    data = pickle.dumps({"t": _Reduces(torch.storage._load_from_bytes, (inner.getvalue(),))})
    with pytest.raises(ValueError, match="Weights only load failed"):
        safe_pickle.loads(data, where="f", path="user_dict")
    assert not marker.exists()


def test_from_serialized_hex_is_safe_by_default(tmp_path):
    marker = tmp_path / "ran.txt"
    text = storage.to_serialized_hex({"p": _Payload(str(marker))})
    with pytest.raises(UnsafePickleError, match=r"user_dict\['p'\] needs builtins.exec"):
        storage.from_serialized_hex(text)
    assert not marker.exists()
    assert storage.from_serialized_hex(storage.to_serialized_hex({"epoch": 1})) == {"epoch": 1}


@pytest.mark.parametrize(
    "tree, detail",
    [
        ('{"nope": 1}', "unknown node"),
        ('{"ndarray": 5}', "no array 5"),
        ('{"tensor": 0, "dtype": "load"}', "'load' is not a torch dtype"),
        ('{"dict": [[1]]}', "ValueError"),
        ("{not json", "does not parse"),
    ],
)
def test_malformed_user_dict_is_an_error_naming_where(tree, detail):
    stored = {"format": FORMAT.encode(), "tree": tree.encode(), "arrays": {"0": np.zeros(2)}}
    with pytest.raises(ValueError, match="user_dict of f.ortcp is malformed") as error:
        decode_user_dict(stored, shown_as="f.ortcp")
    assert detail in str(error.value)


def test_cli_info_describes_user_dict_without_unpickling(tmp_path, capsys):
    marker = tmp_path / "ran.txt"
    path = tmp_path / "c.ortcp"
    with pytest.warns(UserWarning, match="trusted=True"):
        user_dict = encode_user_dict({"epoch": 1, "payload": _Payload(str(marker))})
    storage.save({"user_dict": user_dict}, path)
    assert cli.main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"user_dict: present ({FORMAT}, keys 'epoch', 'payload'; 1 array, 1 pickled value" in out
    assert not marker.exists()


# --- the experimental torch.save API ------------------------------------------------------------------------------


class _FlatTrainer:
    """The experimental API's trainer contract, minimally (see checkpoint/experimental.py)."""

    def __init__(self) -> None:
        self.options = ORTTrainerOptions({})
        self._training_session = object()
        self._state_dict = None
        self._torch_state_dict_keys = None
        self.state = {"fc.weight": torch.ones(2, 2)}

    def _flat_state(self):
        return dict(self.state)

    def _load_flat_state(self, state, strict):
        self.state = dict(state)


def test_experimental_checkpoint_loads_plain_data_only_unless_trusted(tmp_path):
    trainer = _FlatTrainer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        plain = {"epoch": 3, "array": np.arange(3), "scalar": np.float64(2.5)}
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), "plain", plain)
        loaded = checkpoint.experimental_load_checkpoint(trainer, str(tmp_path), "plain")
        assert loaded["epoch"] == 3 and loaded["scalar"] == 2.5
        np.testing.assert_array_equal(loaded["array"], np.arange(3))

        marker = tmp_path / "ran.txt"
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), "evil", {"p": _Payload(str(marker))})
        with pytest.raises(UnsafePickleError, match=r"it needs (builtins\.)?exec.*trusted=True to experimental_load"):
            checkpoint.experimental_load_checkpoint(trainer, str(tmp_path), "evil")
        assert not marker.exists()
        checkpoint.experimental_save_checkpoint(trainer, str(tmp_path), "cfg", {"cfg": _Config(0.2)})
        loaded = checkpoint.experimental_load_checkpoint(trainer, str(tmp_path), "cfg", trusted=True)
        assert loaded == {"cfg": _Config(0.2)}
    assert os.path.exists(tmp_path / "cfg.ort.pt")
