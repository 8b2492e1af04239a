"""HDF5 checkpoint storage: legacy layout and loaded types (§9.2), atomic no-clobber saves, file objects, clear
errors for missing / truncated / foreign files; the ``checkpoint.layout`` key names and helpers and the ``_utils``
key and dtype helpers (§9.1, §10)."""

from __future__ import annotations

import io
import os
import pickle
import stat
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from legacy_checkpoint_files import adam_state, linear_weights, trainer_options, write_checkpoint

import orttrainer.checkpoint as orttrainer_checkpoint
from orttrainer import _checkpoint_storage, _utils
from orttrainer.checkpoint import _atomic, layout, storage
from orttrainer.checkpoint.storage import CheckpointNotFoundError


def _sample() -> dict:
    return {
        "int1": 1,
        "int_list": [1, 2, 3, 5, 6],
        "dict1": {"np_array": np.arange(100), "dict2": {"int3": 3, "int4": 4}, "str1": "onnxruntime"},
        "bool1": True,
        "float1": 2.345,
        "np_array_float_3_dim": np.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]]),
    }


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory))


# --- layout and types ---------------------------------------------------------------------------------------------


def test_round_trip_gives_legacy_types(tmp_path):
    path = tmp_path / "c.ortcp"
    storage.save(_sample(), path)
    loaded = storage.load(path)
    assert set(loaded) == {"int1", "int_list", "dict1", "bool1", "float1", "np_array_float_3_dim"}
    assert type(loaded["int1"]) is np.int64 and loaded["int1"] == 1
    assert type(loaded["float1"]) is np.float64 and loaded["float1"] == 2.345
    assert type(loaded["bool1"]) is np.bool_ and loaded["bool1"]
    assert isinstance(loaded["int_list"], np.ndarray) and loaded["int_list"].tolist() == [1, 2, 3, 5, 6]
    assert loaded["dict1"]["str1"] == b"onnxruntime"  # str comes back as bytes, as in legacy
    assert loaded["dict1"]["dict2"] == {"int3": 3, "int4": 4}
    np.testing.assert_array_equal(loaded["dict1"]["np_array"], np.arange(100))
    assert loaded["np_array_float_3_dim"].shape == (2, 2, 2)


@pytest.mark.parametrize(
    "dtype, np_dtype",
    [
        (torch.int64, np.int64),
        (torch.int32, np.int32),
        (torch.int16, np.int16),
        (torch.int8, np.int8),
        (torch.float64, np.float64),
        (torch.float32, np.float32),
        (torch.float16, np.float16),
    ],
)
def test_tensors_keep_dtype_and_shape(tmp_path, dtype, np_dtype):
    tensor = torch.arange(24).reshape(2, 3, 4).to(dtype)
    storage.save({"t": tensor}, tmp_path / "c.ortcp")
    loaded = storage.load(tmp_path / "c.ortcp")["t"]
    assert isinstance(loaded, np.ndarray) and loaded.dtype == np_dtype and loaded.shape == (2, 3, 4)
    np.testing.assert_array_equal(loaded, tensor.numpy())


def test_tensor_that_requires_grad_is_saved(tmp_path):
    # legacy handed the tensor to h5py, which fails on "Can't call numpy() on Tensor that requires grad"
    weight = torch.nn.Parameter(torch.tensor([1.5, -2.0]))
    storage.save({"w": weight}, tmp_path / "c.ortcp")
    np.testing.assert_array_equal(storage.load(tmp_path / "c.ortcp")["w"], np.array([1.5, -2.0], np.float32))


@pytest.mark.parametrize("saved", [{}, {"a": {}}, {"a": {"b": {}}}])
def test_empty_dicts_round_trip(tmp_path, saved):
    storage.save(saved, tmp_path / "c.ortcp")
    assert storage.load(tmp_path / "c.ortcp") == saved


def test_groups_and_datasets_on_disk(tmp_path):
    storage.save({"a": {"b": np.ones(2)}, "s": "text", "x/y": 3}, tmp_path / "c.ortcp")
    with h5py.File(tmp_path / "c.ortcp", "r") as handle:
        assert isinstance(handle["a"], h5py.Group) and isinstance(handle["a/b"], h5py.Dataset)
        assert h5py.check_string_dtype(handle["s"].dtype) is not None and handle["s"].shape == ()
        assert isinstance(handle["x"], h5py.Group)  # a '/' in a key makes nested groups, as in legacy
        assert handle["x/y"][()] == 3


def test_legacy_trainer_file_loads(tmp_path):
    weights = linear_weights()
    path = tmp_path / "legacy.ortcp"
    write_checkpoint(path, weights=weights, optimizer=adam_state(weights), user_dict={"epoch": 3})
    loaded = storage.load(path)
    assert set(loaded) == {"model", "optimizer", "trainer_options", "train_step_info", "user_dict"}
    np.testing.assert_array_equal(loaded["model"]["full_precision"]["fc.weight"], weights["fc.weight"])
    assert loaded["model"]["full_precision"]["fc.weight"].dtype == np.float32
    assert loaded["optimizer"]["fc.bias"]["Update_Count"].tolist() == [5]
    assert loaded["optimizer"]["fc.bias"]["Update_Count"].dtype == np.int64
    assert loaded["trainer_options"]["optimizer_name"] == b"AdamOptimizer"
    assert type(loaded["trainer_options"]["mixed_precision"]) is np.bool_
    assert loaded["train_step_info"] == {"optimization_step": 5, "step": 20}
    assert storage.from_serialized_hex(loaded["user_dict"]) == {"epoch": 3}


# --- key ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, expected",
    [
        ("int1", 1),
        ("dict1/dict2", {"int3": 3, "int4": 4}),
        ("dict1/dict2/int4", 4),
        ("dict1/str1", b"onnxruntime"),
        ("bool1", True),
    ],
)
def test_load_with_key_descends(tmp_path, key, expected):
    storage.save(_sample(), tmp_path / "c.ortcp")
    assert storage.load(tmp_path / "c.ortcp", key=key) == expected


def test_load_with_missing_key_names_key_and_file(tmp_path):
    path = tmp_path / "c.ortcp"
    storage.save(_sample(), path)
    with pytest.raises(KeyError) as error:
        storage.load(path, key="dict1/nope")
    assert "'dict1/nope'" in str(error.value) and str(path) in str(error.value)


# --- save errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("not_a_dict", [[1, 2, 3], 2.352, "text"])
def test_save_requires_a_mapping(tmp_path, not_a_dict):
    with pytest.raises(ValueError, match="^Object to be saved must be a dictionary$"):
        storage.save(not_a_dict, tmp_path / "c.ortcp")
    assert _files(tmp_path) == []


def test_save_refuses_existing_file_and_keeps_it(tmp_path):
    path = tmp_path / "c.ortcp"
    storage.save({"version": 1}, path)
    before = path.read_bytes()
    with pytest.raises(FileExistsError) as error:
        storage.save({"version": 2}, path)
    assert error.value.filename == str(path) and str(path) in str(error.value)
    assert path.read_bytes() == before and storage.load(path) == {"version": 1}
    assert _files(tmp_path) == ["c.ortcp"]  # no temporary file left behind


def test_existing_file_is_detected_before_an_unstorable_value(tmp_path):
    path = tmp_path / "c.ortcp"
    storage.save({"version": 1}, path)
    with pytest.raises(FileExistsError):
        storage.save({"bad": {1, 2}}, path)
    assert storage.load(path) == {"version": 1}


@pytest.mark.parametrize("bad, type_name", [({1, 2, 3}, "set"), ({"one", "two"}, "set"), (None, "NoneType")])
def test_failed_save_leaves_no_file_and_earlier_checkpoint_intact(tmp_path, bad, type_name):
    earlier = tmp_path / "earlier.ortcp"
    storage.save({"weights": np.arange(4)}, earlier)
    before = earlier.read_bytes()
    target = tmp_path / "new.ortcp"
    # the good values are written before the bad one is reached: the failure is mid-write
    with pytest.raises(TypeError) as error:
        storage.save({"model": {"w": np.ones(3)}, "deep": {"bad": bad}}, target)
    assert "'deep/bad'" in str(error.value) and type_name in str(error.value) and str(target) in str(error.value)
    assert not target.exists()
    assert _files(tmp_path) == ["earlier.ortcp"]
    assert earlier.read_bytes() == before


def test_save_into_missing_directory_names_the_target(tmp_path):
    target = tmp_path / "absent" / "c.ortcp"
    with pytest.raises(FileNotFoundError) as error:
        storage.save({"a": 1}, target)
    assert error.value.filename == str(target) and "Directory for the checkpoint file does not exist" in str(
        error.value
    )
    assert _files(tmp_path) == []


def test_non_string_key_is_refused(tmp_path):
    with pytest.raises(TypeError, match="key 'a/1' is a int"):
        storage.save({"a": {1: 2}}, tmp_path / "c.ortcp")
    assert _files(tmp_path) == []


def test_bfloat16_tensor_is_refused_with_advice(tmp_path):
    with pytest.raises(TypeError, match="'w'.*convert the tensor to float32"):
        storage.save({"w": torch.ones(2, dtype=torch.bfloat16)}, tmp_path / "c.ortcp")
    assert _files(tmp_path) == []


def test_file_appearing_during_save_is_not_clobbered(tmp_path, monkeypatch):
    path = tmp_path / "c.ortcp"
    real_fsync = _atomic._fsync

    def someone_else_writes_first(fd):
        real_fsync(fd)
        path.write_bytes(b"another writer")

    monkeypatch.setattr(_atomic, "_fsync", someone_else_writes_first)
    with pytest.raises(FileExistsError):
        storage.save({"a": 1}, path)
    assert path.read_bytes() == b"another writer"
    assert _files(tmp_path) == ["c.ortcp"]


def test_save_without_hard_links_still_publishes(tmp_path, monkeypatch):
    def no_links(src, dst, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    storage.save({"a": 1}, tmp_path / "c.ortcp")
    assert storage.load(tmp_path / "c.ortcp") == {"a": 1}
    assert _files(tmp_path) == ["c.ortcp"]


def test_saved_file_has_ordinary_permissions(tmp_path):
    storage.save({"a": 1}, tmp_path / "c.ortcp")
    (tmp_path / "plain").write_bytes(b"")
    mode = stat.S_IMODE(os.stat(tmp_path / "c.ortcp").st_mode)
    assert mode == stat.S_IMODE(os.stat(tmp_path / "plain").st_mode)  # not mkstemp's 0600


# --- load errors --------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "absent.ortcp"
    with pytest.raises(FileNotFoundError) as error:
        storage.load(path)
    assert isinstance(error.value, CheckpointNotFoundError)
    assert isinstance(error.value, ValueError)  # what legacy raised
    assert error.value.filename == str(path) and str(path) in str(error.value)


def test_truncated_file(tmp_path):
    path = tmp_path / "c.ortcp"
    weights = linear_weights()
    write_checkpoint(path, weights=weights, optimizer=adam_state(weights))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated or corrupt") as error:
        storage.load(path)
    assert str(path) in str(error.value)


def test_text_file_is_not_hdf5(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a checkpoint\n")
    with pytest.raises(ValueError) as error:
        storage.load(path)
    assert str(error.value) == f"{path} is not an HDF5 checkpoint file"


def test_torch_save_file_gets_a_hint(tmp_path):
    path = tmp_path / "model.ort.pt"
    torch.save({"model": {"w": torch.ones(2)}}, path)
    with pytest.raises(ValueError, match="is not an HDF5 checkpoint file.*torch.save file") as error:
        storage.load(path)
    assert str(path) in str(error.value)


def test_empty_file_and_directory(tmp_path):
    (tmp_path / "empty.ortcp").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.ortcp is empty"):
        storage.load(tmp_path / "empty.ortcp")
    with pytest.raises(ValueError, match="is a directory"):
        storage.load(tmp_path)


def test_location_of_wrong_type():
    with pytest.raises(TypeError, match="path or a binary file object, not int"):
        storage.load(42)


# --- file objects -------------------------------------------------------------------------------------------------


def test_bytesio_round_trip():
    buffer = io.BytesIO()
    storage.save(_sample(), buffer)
    assert buffer.getvalue().startswith(b"\x89HDF")
    loaded = storage.load(buffer)
    assert loaded["dict1"]["dict2"] == {"int3": 3, "int4": 4}
    assert storage.load(buffer, key="dict1/str1") == b"onnxruntime"
    assert not buffer.closed


def test_open_files_round_trip_with_paths(tmp_path):
    path = tmp_path / "c.ortcp"
    with open(path, "wb") as handle:
        storage.save({"w": np.arange(3.0)}, handle)
    np.testing.assert_array_equal(storage.load(path)["w"], np.arange(3.0))  # written to an object, read by path
    with open(path, "rb") as handle:
        np.testing.assert_array_equal(storage.load(handle)["w"], np.arange(3.0))


def test_failed_save_leaves_file_object_untouched():
    buffer = io.BytesIO(b"previous")
    with pytest.raises(TypeError):
        storage.save({"ok": 1, "bad": {1}}, buffer)
    assert buffer.getvalue() == b"previous"


def test_file_object_that_is_not_hdf5(tmp_path):
    with pytest.raises(ValueError, match="is not an HDF5 checkpoint file"):
        storage.load(io.BytesIO(b"garbage" * 10))
    with pytest.raises(ValueError, match="is empty"):
        storage.load(io.BytesIO())
    path = tmp_path / "notes.txt"
    path.write_text("not hdf5")
    with open(path, "rb") as handle, pytest.raises(ValueError) as error:
        storage.load(handle)
    assert str(path) in str(error.value)


def test_truncated_file_object():
    buffer = io.BytesIO()
    storage.save({"w": np.arange(1000.0)}, buffer)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        storage.load(io.BytesIO(buffer.getvalue()[:3000]))


# --- user_dict serialisation and the legacy module path -----------------------------------------------------------


class _Custom:
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Custom) and other.epoch == self.epoch


def test_serialized_hex_round_trip(tmp_path):
    user_dict = {"tensor": torch.arange(5.0), "custom": _Custom(12)}
    text = storage.to_serialized_hex(user_dict)
    assert text == pickle.dumps(user_dict).hex()
    storage.save({"user_dict": text}, tmp_path / "c.ortcp")
    raw = storage.load(tmp_path / "c.ortcp")["user_dict"]
    assert isinstance(raw, bytes)
    # a class of the caller's needs trust: unpickling it could run code (see test_reliability_checkpoints.py)
    with pytest.raises(storage.safe_pickle.UnsafePickleError, match=r"user_dict\['custom'\] needs .*_Custom"):
        storage.from_serialized_hex(raw)
    restored = storage.from_serialized_hex(raw, trusted=True)
    assert torch.equal(restored["tensor"], torch.arange(5.0)) and restored["custom"] == _Custom(12)
    assert storage.from_serialized_hex(text, trusted=True)["custom"] == _Custom(12)


def test_legacy_module_path_exports_storage():
    assert _checkpoint_storage.save is storage.save
    assert _checkpoint_storage.load is storage.load
    assert _checkpoint_storage.to_serialized_hex is storage.to_serialized_hex
    assert _checkpoint_storage.from_serialized_hex is storage.from_serialized_hex


# --- _utils -------------------------------------------------------------------------------------------------------


def test_state_dict_key_names():
    assert _utils.state_dict_model_key() == "model"
    assert _utils.state_dict_optimizer_key() == "optimizer"
    assert _utils.state_dict_partition_info_key() == "partition_info"
    assert _utils.state_dict_trainer_options_key() == "trainer_options"
    assert _utils.state_dict_full_precision_key() == "full_precision"
    assert _utils.state_dict_original_dimension_key() == "original_dim"
    assert _utils.state_dict_sharded_optimizer_keys() == {"Moment_1", "Moment_2"}
    assert _utils.state_dict_user_dict_key() == "user_dict"
    assert _utils.state_dict_train_step_info_key() == "train_step_info"
    assert _utils.state_dict_train_step_info_optimization_step_key() == "optimization_step"
    assert _utils.state_dict_train_step_info_step_key() == "step"
    options = trainer_options()
    names = [
        _utils.state_dict_trainer_options_mixed_precision_key(),
        _utils.state_dict_trainer_options_zero_stage_key(),
        _utils.state_dict_trainer_options_world_rank_key(),
        _utils.state_dict_trainer_options_world_size_key(),
        _utils.state_dict_trainer_options_optimizer_name_key(),
        _utils.state_dict_trainer_options_data_parallel_size_key(),
        _utils.state_dict_trainer_options_horizontal_parallel_size_key(),
    ]
    assert sorted(names) == sorted(options)


# --- checkpoint.layout ----------------------------------------------------------------------------------------------


def test_layout_constants_are_the_legacy_key_names():
    assert (layout.MODEL, layout.FULL_PRECISION, layout.LEGACY_FULL_PRECISION) == ("model", "full_precision", "fp32")
    assert (layout.OPTIMIZER, layout.SHARED_OPTIMIZER_STATE) == ("optimizer", "shared_optimizer_state")
    assert (layout.MOMENT_1, layout.MOMENT_2, layout.UPDATE_COUNT, layout.STEP) == (
        "Moment_1",
        "Moment_2",
        "Update_Count",
        "Step",
    )
    assert (layout.TRAIN_STEP_INFO, layout.OPTIMIZATION_STEP, layout.TRAIN_STEP) == (
        "train_step_info",
        "optimization_step",
        "step",
    )
    assert (layout.PARTITION_INFO, layout.ORIGINAL_DIM, layout.MEGATRON_ROW_PARTITION) == (
        "partition_info",
        "original_dim",
        "megatron_row_partition",
    )
    assert (layout.GRADIENT_ACCUMULATION, layout.LOSS_SCALER, layout.LOSS_SCALE, layout.STABLE_STEPS) == (
        "gradient_accumulation",
        "loss_scaler",
        "loss_scale",
        "stable_steps",
    )
    assert (layout.TRAINER_OPTIONS, layout.USER_DICT) == ("trainer_options", "user_dict")
    written = layout.trainer_options(
        mixed_precision=False,
        zero_stage=0,
        world_rank=0,
        world_size=1,
        optimizer_name="AdamOptimizer",
        data_parallel_size=1,
        horizontal_parallel_size=1,
    )
    assert list(written.items()) == list(trainer_options().items())  # the legacy keys, in the legacy order


def test_layout_helpers():
    assert layout.optimizer_name_of({"trainer_options": {"optimizer_name": b"LambOptimizer"}}) == "LambOptimizer"
    assert layout.optimizer_name_of({"trainer_options": {"optimizer_name": "SGDOptimizer"}}) == "SGDOptimizer"
    old = {"model": {"fp32": {"w": 1}}, "optimizer": {}}
    assert layout.normalise_precision_key(old) == {"model": {"full_precision": {"w": 1}}, "optimizer": {}}
    assert old == {"model": {"fp32": {"w": 1}}, "optimizer": {}}  # the caller's dicts are left alone
    current = {"model": {"full_precision": {"w": 1}}}
    assert layout.normalise_precision_key(current) is current
    assert not layout.is_partitioned({}) and not layout.is_partitioned(trainer_options(world_size=4))
    assert layout.is_partitioned(trainer_options(zero_stage=1, world_size=2))
    assert layout.is_partitioned({"horizontal_parallel_size": np.int64(2)})


def test_layout_imports_neither_torch_nor_onnxruntime():
    # The module file on its own (its package imports torch): `sys.modules[name] = None` makes an import fail.
    code = (
        "import importlib.util, sys\n"
        "sys.modules['torch'] = sys.modules['onnxruntime'] = None\n"
        f"spec = importlib.util.spec_from_file_location('layout', {layout.__file__!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_training_without_checkpoints_loads_no_hdf5_and_a_checkpoint_loads_it_when_first_needed(tmp_path):
    # A fresh interpreter: this one has imported h5py already. docs/engine.md §24.
    code = (
        "import sys, torch, orttrainer.checkpoint as checkpoint\n"
        "from orttrainer import ORTTrainer, ORTTrainerOptions, optim\n"
        "model = torch.nn.Linear(4, 3)\n"
        "desc = {'inputs': [('input', ['n', 4]), ('t', ['n'])], 'outputs': [('loss', [], True)]}\n"
        "trainer = ORTTrainer(model, desc, optim.SGDConfig(), loss_fn=torch.nn.functional.cross_entropy,\n"
        "                     options=ORTTrainerOptions({'device': {'id': 'cpu'}}))\n"
        "trainer.train_step(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))\n"
        "assert 'h5py' not in sys.modules, 'a train_step imported h5py'\n"
        "assert checkpoint.CheckpointNotFoundError is checkpoint.storage.CheckpointNotFoundError\n"
        f"trainer.save_checkpoint({str(tmp_path / 'c.ortcp')!r})\n"
        "assert 'h5py' in sys.modules\n"
        f"trainer.load_checkpoint({str(tmp_path / 'c.ortcp')!r})\n"
    )
    env = {**os.environ, "ORTTRAINER_COMPILE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "c.ortcp").is_file()
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        orttrainer_checkpoint.nothing  # noqa: B018 - the attribute read is the test


def test_device_index():
    assert _utils.get_device_index("cpu") == 0
    assert _utils.get_device_index("cuda:1") == 1
    assert _utils.get_device_index(3) == 3
    assert _utils.get_device_index(torch.device("cuda", 2)) == 2
    assert _utils.get_device_index_from_input(torch.ones(1)) == 0
    assert _utils.get_device_index_from_input([torch.ones(1), torch.ones(2)]) == 0


@pytest.mark.parametrize(
    "torch_dtype, np_dtype",
    [
        (torch.float64, np.float64),
        (torch.float32, np.float32),
        (torch.float16, np.float16),
        (torch.bfloat16, np.float16),
        (torch.int64, np.longlong),
        (torch.int32, np.int32),
        (torch.int16, np.int16),
        (torch.int8, np.int8),
        (torch.uint8, np.uint8),
        (torch.complex32, np.complex64),
        (torch.complex64, np.complex64),
        (torch.complex128, np.complex128),
        (torch.bool, np.bool_),
    ],
)
def test_dtype_torch_to_numpy(torch_dtype, np_dtype):
    assert _utils.dtype_torch_to_numpy(torch_dtype) is np_dtype


def test_dtype_torch_to_numpy_unsupported():
    with pytest.raises(ValueError, match=r"^torch_dtype \(torch.float8_e4m3fn\) type is not supported by Numpy$"):
        _utils.dtype_torch_to_numpy(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "onnx_type, expected",
    [
        (0, None),
        (1, torch.float32),
        ("uint8", torch.uint8),  # legacy gave torch.int8
        (3, torch.int8),
        ("UINT16", torch.int16),
        (6, torch.int32),
        ("uint32", torch.int32),
        ("Int64", torch.int64),
        (13, torch.int64),
        ("STRING", str),
        (9, torch.bool),
        ("float16", torch.float16),
        (11, torch.float64),
        (14, torch.complex64),
        ("COMPLEX128", torch.complex128),
        (16, torch.bfloat16),  # legacy raised AttributeError (torch.bfloat)
        ("bfloat16", torch.bfloat16),
    ],
)
def test_dtype_onnx_to_torch(onnx_type, expected):
    assert _utils.dtype_onnx_to_torch(onnx_type) is expected


def test_dtype_onnx_to_torch_errors():
    with pytest.raises(AssertionError, match="^Invalid onnx_type integer$"):
        _utils.dtype_onnx_to_torch(17)
    with pytest.raises(AssertionError, match="^Invalid onnx_type integer$"):
        _utils.dtype_onnx_to_torch(-1)
    with pytest.raises(AssertionError, match="^Invalid onnx_type string$"):
        _utils.dtype_onnx_to_torch("float128")
    with pytest.raises(ValueError, match="must be an ONNX type represented by either a string or integer"):
        _utils.dtype_onnx_to_torch(1.0)


def test_static_vars_and_import_module_from_file(tmp_path, monkeypatch):
    # registers the entry with monkeypatch, so that the module imported below is removed after the test
    monkeypatch.setitem(sys.modules, "sample_model", None)

    @_utils.static_vars(counter=0)
    def count():
        count.counter += 1
        return count.counter

    assert (count(), count()) == (1, 2)
    source = tmp_path / "sample_model.py"
    source.write_text("VALUE = 42\n")
    module = _utils.import_module_from_file(str(source))
    assert module.__name__ == "sample_model" and module.VALUE == 42
    with pytest.raises(AssertionError, match="'file_path' must be a full path string"):
        _utils.import_module_from_file(str(tmp_path / "absent.py"))
