"""The older API's pieces without a training session: descriptions, generate_sample, the legacy LossScaler (and its
bridge to amp), the constructor-argument mapping and the positional input rule."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from models import MLP

from orttrainer import TrainStepInfo, amp, optim
from orttrainer.capi import (
    IODescription,
    LossScaler,
    ModelDescription,
    dtype_torch_to_numpy,
    generate_sample,
    resolve_symbolic_dimensions,
)
from orttrainer.capi import argument_mapping as args_mod
from orttrainer.capi.descriptions import to_model_desc
from orttrainer.capi.input_matching import legacy_input_model
from orttrainer.capi.loss_scaler import CallerFedLossScale, as_new_loss_scaler


# --- descriptions -------------------------------------------------------------------------------------------------
def _desc():
    return ModelDescription(
        [IODescription("input1", ["batch", 8], torch.float32), IODescription("label", ["batch"], torch.int64, 10)],
        [IODescription("loss", [], torch.float32), IODescription("probs", ["batch", 10], torch.float32)],
    )


def test_descriptions_keep_legacy_attributes_and_convert_with_the_first_output_as_loss():
    desc = _desc()
    label = desc.inputs_[1]
    assert (label.name_, label.shape_, label.dtype_, label.num_classes_) == ("label", ["batch"], torch.int64, 10)
    assert to_model_desc(desc) == {
        "inputs": [("input1", ["batch", 8]), ("label", ["batch"])],
        "outputs": [("loss", [], True), ("probs", ["batch", 10], False)],
    }
    with pytest.raises(TypeError, match="ModelDescription"):
        to_model_desc({"inputs": [], "outputs": []})
    with pytest.raises(TypeError, match="IODescription"):
        to_model_desc(ModelDescription([("x", [1])], []))
    with pytest.raises(ValueError, match="first output must be the loss"):
        to_model_desc(ModelDescription([], []))


def test_generate_sample():
    torch.manual_seed(0)
    ints = generate_sample(IODescription("label", ["batch", 3], torch.int64, num_classes=4), "cpu")
    assert ints.shape == (1, 3) and ints.dtype == torch.int64 and 0 <= int(ints.min()) and int(ints.max()) < 4
    floats = generate_sample(IODescription("x", [2, "seq"], torch.float64))
    assert floats.shape == (2, 1) and floats.dtype == torch.float64


def test_resolve_symbolic_dimensions_and_dtype_map():
    inputs = [torch.zeros(3, 8), torch.zeros(3, dtype=torch.int64)]
    loss, probs = resolve_symbolic_dimensions(inputs, _desc().inputs_, _desc().outputs_)
    assert loss.shape_ == [] and probs.shape_ == [3, 10]
    with pytest.raises(ValueError, match="'batch' is 3 in one input and 4"):
        resolve_symbolic_dimensions([torch.zeros(3, 8), torch.zeros(4)], _desc().inputs_, [])
    with pytest.raises(ValueError, match=r"\['seq'\] are bound by no input"):
        resolve_symbolic_dimensions(inputs, _desc().inputs_, [IODescription("y", ["seq"])])
    assert dtype_torch_to_numpy(torch.float16) is np.float16
    with pytest.raises(Exception, match="mapping unavailable for: torch.uint8"):
        dtype_torch_to_numpy(torch.uint8)


# --- loss scaler ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"loss_scale": 3, "up_scale_window": 7, "min_loss_scale": 0.5, "max_loss_scale": 10.0},
        {"loss_scale": 8.0, "up_scale_window": 1},
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_legacy_loss_scaler_equals_dynamic_loss_scaler(params, seed):
    rng = random.Random(seed)
    legacy = LossScaler("loss_scale_input_name", True, **params)
    dynamic = amp.DynamicLossScaler(**params)
    info = TrainStepInfo(optim.SGDConfig())
    for step in range(6000):
        flag = rng.random() < 0.999 if step % 1500 else False
        info.all_finite = flag
        legacy.update_loss_scale(torch.tensor([flag]) if step % 2 else flag)
        assert legacy.loss_scale_ == dynamic.update(info), step
        assert legacy.stable_steps_ == dynamic._stable_steps_count
    legacy.reset()
    assert (legacy.loss_scale_, legacy.stable_steps_) == (legacy.initial_loss_scale_, 0)


def test_static_legacy_loss_scaler_never_changes():
    scaler = LossScaler("ls", False, loss_scale=128.0)
    for flag in (False, True, False):
        scaler.update_loss_scale(flag)
    assert scaler.loss_scale_ == 128.0 and scaler.loss_scale_input_name_ == "ls" and not scaler.is_dynamic_scale_


def test_loss_scaler_bridges_to_the_new_trainer_interface():
    legacy = LossScaler("ls", True, loss_scale=4.0, up_scale_window=1)
    bridged = as_new_loss_scaler(legacy)
    assert isinstance(bridged, amp.LossScaler) and bridged.loss_scale == 4.0
    info = TrainStepInfo(optim.SGDConfig(), all_finite=True)
    assert bridged.update(info) == 8.0 and legacy.loss_scale_ == 8.0  # the legacy object holds the state
    bridged.input_name = "loss_scale"
    bridged.reset()
    assert legacy.loss_scale_ == 4.0
    fed = as_new_loss_scaler(None)
    assert isinstance(fed, CallerFedLossScale)
    fed.loss_scale = 512.0
    assert fed.update(TrainStepInfo(optim.SGDConfig(), all_finite=False)) == 512.0
    with pytest.raises(TypeError, match="LossScaler"):
        as_new_loss_scaler(amp.DynamicLossScaler())


# --- constructor arguments ------------------------------------------------------------------------------------------
def test_every_mapped_argument_is_a_valid_option():
    from orttrainer import ORTTrainerOptions

    values = {
        "device": "cpu",
        "gradient_accumulation_steps": 3,
        "world_rank": 0,
        "world_size": 1,
        "use_mixed_precision": False,
        "loss_scaler": None,
        "allreduce_post_accumulation": False,
        "deepspeed_zero_stage": 0,
        "enable_adasum": False,
        "enable_grad_norm_clip": False,
        "frozen_weights": ["fc1.bias"],
        "use_memory_efficient_gradient": False,
        "run_symbolic_shape_infer": True,
        "_use_deterministic_compute": True,
        "optimized_model_filepath": "x.onnx",
        "_opset_version": 13,
        "_enable_internal_postprocess": False,
        "_extra_postprocess": print,
    }
    assert set(values) == set(args_mod.OPTION_OF_ARGUMENT)
    options = ORTTrainerOptions(args_mod.options_dict(values))
    for argument, path in args_mod.OPTION_OF_ARGUMENT.items():
        node = options._validated_opts
        for key in path.split("."):
            node = node[key]
        assert node == values[argument], argument


def test_device_ids():
    assert args_mod.device_id(torch.device("cpu")) == "cpu"
    assert args_mod.device_id("cuda") == "cuda:0" and args_mod.device_id(torch.device("cuda", 1)) == "cuda:1"
    with pytest.raises(ValueError, match="'cpu' or 'cuda"):
        args_mod.device_id("meta")


def test_optimizer_config_groups_weights_by_attributes():
    weights = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    attributes = lambda name: {"alpha": 0.9, "lambda": 0.0 if "bias" in name else 0.01}  # noqa: E731
    config = args_mod.optimizer_config("LambOptimizer", attributes, weights)
    assert isinstance(config, optim.LambConfig)
    assert config.hyper_parameters("fc2.bias")[0]["lambda"] == 0.0
    assert config.hyper_parameters("fc2.weight")[0]["lambda"] == 0.01
    assert [g["params"] for g in config.params] == [["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"]]
    assert args_mod.optimizer_config("AdamOptimizer", None, weights).params == []
    assert args_mod.optimizer_config("SGDOptimizer", lambda n: {}, weights).params == []


@pytest.mark.parametrize(
    "name, attributes, message",
    [
        ("AdamW", None, "training_optimizer_name 'AdamW'"),
        ("AdamOptimizer", {"lr": 0.1}, "per-weight learning rates are not supported"),
        ("AdamOptimizer", {"gamma": 0.1}, r"returned \['gamma'\], which AdamOptimizer does not take"),
        ("SGDOptimizer", {"alpha": 0.9}, "SGDOptimizer does not take .*attributes: none"),
        ("LambOptimizer", {"alpha": "0.9"}, "Optimizer attributes must be either float or int"),
    ],
)
def test_optimizer_config_errors(name, attributes, message):
    with pytest.raises(ValueError, match=message):
        args_mod.optimizer_config(name, lambda n: attributes, ["w"])


# --- positional input rule ------------------------------------------------------------------------------------------
class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.scale = 2.0

    def forward(self, x, y=None):
        return self.fc(x) * self.scale + (0 if y is None else y)


def test_matching_names_keep_the_model():
    model = TwoInputs()
    ce = torch.nn.functional.cross_entropy
    assert legacy_input_model(model, None, ["x", "y"]) is model
    assert legacy_input_model(model, ce, ["x", "target"]) is model
    assert legacy_input_model(model, ce, ["y", "x", "target"]) is not model  # full count: positional, as legacy
    assert legacy_input_model(model, ce, ["y", "target"]) is model  # a reordered subset: by name


def test_positional_adapter_shares_the_model_state():
    model = TwoInputs()
    adapter = legacy_input_model(model, torch.nn.functional.cross_entropy, ["input1", "input2", "label"])
    assert isinstance(adapter, TwoInputs) and adapter.fc is model.fc and adapter.scale == 2.0
    assert list(adapter.state_dict()) == list(model.state_dict())
    a, b = torch.randn(2, 4), torch.randn(2, 3)
    assert torch.equal(adapter(input1=a, input2=b), model(a, b))
    adapter.eval()
    assert not model.training and not model.fc.training
    with pytest.raises(ValueError, match="takes 2 positional arguments"):
        legacy_input_model(model, None, ["a", "b", "c"])
    with pytest.raises(ValueError, match="must be Python identifiers"):
        legacy_input_model(MLP(), None, ["input:0"])


# --- the former package name --------------------------------------------------------------------------------------
def test_former_orttrainer_legacy_path_still_imports_the_same_objects():
    import importlib

    import orttrainer.legacy
    from orttrainer.legacy import IODescription as OldIODescription
    from orttrainer.legacy import ORTTrainer as OldORTTrainer
    from orttrainer.legacy import arguments, positional
    from orttrainer.legacy.loss_scaler import CallerFedLossScale as OldCallerFedLossScale

    import orttrainer.capi

    assert OldIODescription is IODescription and OldCallerFedLossScale is CallerFedLossScale
    assert OldORTTrainer is orttrainer.capi.ORTTrainer and OldORTTrainer.__module__ == "orttrainer.capi.ort_trainer"
    assert arguments is args_mod and positional.legacy_input_model is legacy_input_model
    renamed = {"trainer": "ort_trainer", "arguments": "argument_mapping", "positional": "input_matching"}
    for old in ("trainer", "arguments", "positional", "checkpointing", "descriptions", "loss_scaler"):
        new = importlib.import_module(f"orttrainer.capi.{renamed.get(old, old)}")
        assert importlib.import_module(f"orttrainer.legacy.{old}") is new, old
    assert orttrainer.legacy.__all__ == orttrainer.capi.__all__
