"""TrainStepInfo: legacy (1.13.1) validation and messages, plus the fixed shared-default `fetches` list."""

from __future__ import annotations

import inspect

import pytest

import orttrainer
from orttrainer import TrainStepInfo, optim
from orttrainer import train_step_info as train_step_info_module


def test_valid_initialisation():
    config = optim.LambConfig()
    fetches = ["out1", "out2"]
    info = TrainStepInfo(optimizer_config=config, all_finite=False, fetches=fetches, optimization_step=123, step=456)
    assert info.optimizer_config is config
    assert info.all_finite is False
    assert info.fetches is fetches  # a list the caller passes is kept, as in the legacy API
    assert (info.optimization_step, info.step) == (123, 456)


def test_defaults():
    config = optim.SGDConfig()
    info = TrainStepInfo(config)
    assert info.optimizer_config is config
    assert info.all_finite is True
    assert info.fetches == []
    assert (info.optimization_step, info.step) == (0, 0)


def test_positional_order():
    config = optim.AdamConfig()
    info = TrainStepInfo(config, False, ["loss"], 3, 4)
    assert (info.all_finite, info.fetches, info.optimization_step, info.step) == (False, ["loss"], 3, 4)


def test_each_instance_gets_its_own_fetches_list():
    # Legacy used one shared `fetches=[]` default: appending to one instance's list leaked into all later ones.
    first = TrainStepInfo(optim.SGDConfig())
    first.fetches.append("loss")
    second = TrainStepInfo(optim.SGDConfig())
    assert second.fetches == []
    assert first.fetches is not second.fetches
    assert inspect.signature(TrainStepInfo).parameters["fetches"].default is None


@pytest.mark.parametrize("config", [-1, "Hello", None, {"lr": 0.1}, optim.AdamConfig])
def test_invalid_optimizer_config(config):
    with pytest.raises(AssertionError) as e:
        TrainStepInfo(optimizer_config=config)
    assert str(e.value) == "optimizer_config must be a optim._OptimizerConfig"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"all_finite": -1}, "all_finite must be a bool"),
        ({"all_finite": "Hello"}, "all_finite must be a bool"),
        ({"all_finite": 1}, "all_finite must be a bool"),
        ({"all_finite": None}, "all_finite must be a bool"),
        ({"fetches": -1}, "fetches must be a list of str"),
        ({"fetches": "Hello"}, "fetches must be a list of str"),
        ({"fetches": ("loss",)}, "fetches must be a list of str"),
        ({"fetches": ["loss", 1]}, "fetches must be a list of str"),
        ({"optimization_step": -1}, "optimization_step must be a positive int"),
        ({"optimization_step": "Hello"}, "optimization_step must be a positive int"),
        ({"optimization_step": 1.0}, "optimization_step must be a positive int"),
        ({"step": -1}, "step must be a positive int"),
        ({"step": "Hello"}, "step must be a positive int"),
        ({"step": 2.0}, "step must be a positive int"),
    ],
)
def test_invalid_fields(kwargs, message):
    with pytest.raises(AssertionError) as e:
        TrainStepInfo(optim.SGDConfig(), **kwargs)
    assert str(e.value) == message


def test_attributes_are_plain_and_unvalidated_after_construction():
    # The trainer stores the graph's all-finite output (a one-element tensor) and bumps the counters in place.
    info = TrainStepInfo(optim.SGDConfig())
    flag = object()
    info.all_finite = flag
    info.fetches = ["loss"]
    info.step += 1
    info.optimization_step += 2
    assert (info.all_finite, info.fetches, info.step, info.optimization_step) == (flag, ["loss"], 1, 2)


def test_exported_from_package():
    assert orttrainer.TrainStepInfo is train_step_info_module.TrainStepInfo
    assert "TrainStepInfo(" in repr(TrainStepInfo(optim.SGDConfig()))


def test_drives_scheduler_and_scaler_together():
    info = TrainStepInfo(optim.LambConfig(lr=2.0))
    scheduler = optim.LinearWarmupLRScheduler(total_steps=4, warmup=0.5)
    scaler = orttrainer.amp.DynamicLossScaler(loss_scale=4.0, up_scale_window=2)
    lrs, scales = [], []
    for _ in range(4):
        info.step += 1
        lrs.append(scheduler._step(info)[0])
        scales.append(scaler.update(info))
        info.optimization_step += 1
    assert lrs == [0.0, 1.0, 2.0, 1.0]
    assert scales == [4.0, 8.0, 8.0, 16.0]
