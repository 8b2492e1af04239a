"""Loss scalers: the legacy (1.13.1) update algorithm and verified sequences, validation and the fixed bugs."""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest

from orttrainer import TrainStepInfo, amp, optim
from orttrainer.amp import loss_scaler


def _info(all_finite=True):
    info = TrainStepInfo(optim.LambConfig())
    info.all_finite = all_finite  # plain attribute: the trainer stores a tensor here, unvalidated
    return info


def _run(scaler, flags):
    return [scaler.update(_info(flag)) for flag in flags]


def test_defaults():
    scaler = amp.DynamicLossScaler()
    assert scaler.automatic_update is True
    assert scaler.loss_scale == 65536.0 and type(scaler.loss_scale) is float
    assert scaler.up_scale_window == 2000
    assert (scaler.min_loss_scale, scaler.max_loss_scale) == (1.0, 16777216.0)
    assert scaler.input_name is None
    assert scaler._stable_steps_count == 0
    assert isinstance(scaler, loss_scaler.LossScaler)


def test_default_growth_windows_reach_the_cap():
    scaler = amp.DynamicLossScaler()
    info = _info(True)
    expected_scale = 65536.0
    for block in range(1, 10):
        for i in range(1, 2000):
            assert scaler.update(info) == expected_scale
            assert scaler._stable_steps_count == i
        if block <= 8:
            expected_scale *= 2
        assert scaler.update(info) == expected_scale  # the 2000th finite update doubles (until the cap)
        assert scaler._stable_steps_count == 0
    assert expected_scale == 16777216.0 == 2.0**24

    for count in range(1, 2050):  # at the cap: the count still cycles, the scale stays
        assert scaler.update(info) == 16777216.0
        assert scaler._stable_steps_count == count % 2000


def test_block_values_after_each_window():
    scaler = amp.DynamicLossScaler()
    after_blocks = [_run(scaler, [True] * 2000)[-1] for _ in range(9)]
    assert after_blocks == [
        131072.0,
        262144.0,
        524288.0,
        1048576.0,
        2097152.0,
        4194304.0,
        8388608.0,
        16777216.0,
        16777216.0,
    ]


def test_overflows_halve_down_to_the_floor_then_stay():
    scaler = amp.DynamicLossScaler(loss_scale=float(1 << 24))
    scaler._stable_steps_count = 1234
    values = _run(scaler, [False] * 30)
    assert values[:24] == [2.0**23 / 2**k for k in range(24)]
    assert values[23] == 1.0
    assert values[24:] == [1.0] * 6
    assert scaler._stable_steps_count == 0


def test_custom_values_sequence():
    scaler = amp.DynamicLossScaler(loss_scale=3, up_scale_window=7, min_loss_scale=5, max_loss_scale=10)
    assert scaler.loss_scale == 3.0 and type(scaler.loss_scale) is float
    assert (scaler.up_scale_window, scaler.min_loss_scale, scaler.max_loss_scale) == (7, 5, 10)
    values = _run(scaler, [True] * 14)
    assert values == [3.0] * 6 + [6.0] * 7 + [10.0]
    assert all(type(v) is float for v in values)
    assert _run(scaler, [True] * 7) == [10.0] * 7  # capped
    assert _run(scaler, [False] * 2) == [5.0, 5.0]  # halving stops at min_loss_scale


def test_automatic_update_false_is_static():
    scaler = amp.DynamicLossScaler(
        automatic_update=False, loss_scale=3, up_scale_window=7, min_loss_scale=5, max_loss_scale=10
    )
    assert scaler.automatic_update is False
    assert _run(scaler, [True] * 20 + [False] * 5) == [3.0] * 25
    assert scaler._stable_steps_count == 0


def test_overflow_resets_the_stable_count():
    scaler = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=3)
    assert _run(scaler, [True, True, False, True, True, True]) == [8.0, 8.0, 4.0, 4.0, 4.0, 8.0]


def test_reset():
    scaler = amp.DynamicLossScaler(loss_scale=4, up_scale_window=2)
    _run(scaler, [True] * 5)
    assert (scaler.loss_scale, scaler._stable_steps_count) == (16.0, 1)
    scaler.reset()
    assert (scaler.loss_scale, scaler._stable_steps_count) == (4.0, 0)

    scaler.loss_scale = 100.0  # a manual scale is not the initial one: reset still goes back to 4.0
    scaler.reset()
    assert scaler.loss_scale == 4.0


def test_base_class():
    base = loss_scaler.LossScaler(loss_scale=2)
    assert base.loss_scale == 2.0 and type(base.loss_scale) is float
    base.loss_scale = 5
    base.reset()
    assert base.loss_scale == 2.0
    with pytest.raises(NotImplementedError):
        base.update(_info())


@pytest.mark.parametrize("value", [0, -1, -0.5, 0.0, "1", None, [1.0]])
def test_loss_scale_validation(value):
    with pytest.raises(AssertionError, match=r"^'loss_scale' must be a positive float$"):
        amp.DynamicLossScaler(loss_scale=value)
    scaler = amp.DynamicLossScaler()
    with pytest.raises(AssertionError, match=r"^'loss_scale' must be a positive float$"):
        scaler.loss_scale = value
    assert scaler.loss_scale == 65536.0


@pytest.mark.parametrize("value,stored", [(7, 7.0), (0.25, 0.25), (True, 1.0)])
def test_loss_scale_setter_stores_float(value, stored):
    scaler = amp.DynamicLossScaler()
    scaler.loss_scale = value
    assert scaler.loss_scale == stored and type(scaler.loss_scale) is float


def test_input_name_accepts_a_name():
    # Older legacy releases asserted `not input_name`, rejecting every real name.
    scaler = amp.DynamicLossScaler()
    scaler.input_name = "loss_scale_input_name"
    assert scaler.input_name == "loss_scale_input_name"


@pytest.mark.parametrize(
    "value,message",
    [
        ("", "'input_name' cannot be empty"),
        (None, "'input_name' must be a string"),
        (1, "'input_name' must be a string"),
    ],
)
def test_input_name_validation(value, message):
    scaler = amp.DynamicLossScaler()
    with pytest.raises(AssertionError) as e:
        scaler.input_name = value
    assert str(e.value) == message


def test_docstring_states_the_real_default():
    assert inspect.signature(amp.DynamicLossScaler).parameters["automatic_update"].default is True
    doc = amp.DynamicLossScaler.__doc__
    assert "automatic_update: default **True**" in doc
    assert "default is False" not in doc


class _TensorLike:
    """A one-element tensor stand-in: only bool() is defined, as for torch.tensor([x])."""

    def __init__(self, value):
        self.value = value

    def __bool__(self):
        return bool(self.value)


@pytest.mark.parametrize(
    "finite,overflow",
    [
        (True, False),
        (np.bool_(True), np.bool_(False)),
        (np.array([True]), np.array([False])),
        (np.array(True), np.array(False)),
        (_TensorLike(True), _TensorLike(False)),
        ([True], [False]),
        ((True,), (False,)),
        (1, 0),
    ],
    ids=["bool", "numpy-bool", "numpy-1-element", "numpy-0d", "tensor-like", "list", "tuple", "int"],
)
def test_all_finite_flag_kinds(finite, overflow):
    scaler = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=2)
    assert _run(scaler, [finite, finite, overflow, finite]) == [8.0, 16.0, 8.0, 8.0]
    assert scaler._stable_steps_count == 1


def test_all_finite_torch_tensor():
    torch = pytest.importorskip("torch")
    scaler = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=1)
    finite, overflow = torch.tensor([True]), torch.tensor([False])
    assert _run(scaler, [finite, overflow, overflow]) == [16.0, 8.0, 4.0]


@pytest.mark.parametrize("flag", [[], [True, False], np.array([True, True])])
def test_all_finite_with_several_values_is_rejected(flag):
    with pytest.raises(ValueError):
        amp.DynamicLossScaler().update(_info(flag))


class _LegacyCapiLossScaler:
    """The legacy capi ``LossScaler.update_loss_scale`` (docs/legacy_api.md §14.2), written out for comparison."""

    def __init__(self, loss_scale, up_scale_window, min_loss_scale, max_loss_scale):
        self.loss_scale_ = loss_scale
        self.up_scale_window_ = up_scale_window
        self.min_loss_scale_ = min_loss_scale
        self.max_loss_scale_ = max_loss_scale
        self.stable_steps_ = 0

    def update_loss_scale(self, is_all_finite):
        if is_all_finite:
            self.stable_steps_ += 1
            if self.stable_steps_ >= self.up_scale_window_:
                self.loss_scale_ = min(self.max_loss_scale_, self.loss_scale_ * 2)
                self.stable_steps_ = 0
        else:
            self.loss_scale_ = max(self.min_loss_scale_, self.loss_scale_ / 2)
            self.stable_steps_ = 0


@pytest.mark.parametrize("seed", range(5))
def test_matches_legacy_capi_scaler_on_random_flags(seed):
    rng = random.Random(seed)
    args = dict(
        loss_scale=float(1 << rng.randint(0, 20)),
        up_scale_window=rng.randint(1, 6),
        min_loss_scale=1.0,
        max_loss_scale=float(1 << 22),
    )
    scaler, legacy = amp.DynamicLossScaler(**args), _LegacyCapiLossScaler(**args)
    for _ in range(2000):
        flag = rng.random() < 0.8
        legacy.update_loss_scale(flag)
        assert scaler.update(_info(flag)) == legacy.loss_scale_
        assert scaler._stable_steps_count == legacy.stable_steps_
