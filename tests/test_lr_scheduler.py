"""LR schedulers: the legacy (1.13.1) reference values, formulas past total_steps, validation and the fixed bugs."""

from __future__ import annotations

import math

import pytest

from orttrainer import TrainStepInfo, optim
from orttrainer.optim import lr_scheduler

CONSTANT = lr_scheduler.ConstantWarmupLRScheduler
COSINE = lr_scheduler.CosineWarmupLRScheduler
LINEAR = lr_scheduler.LinearWarmupLRScheduler
POLY = lr_scheduler.PolyWarmupLRScheduler
ALL_SCHEDULERS = [CONSTANT, COSINE, LINEAR, POLY]


def _lrs(scheduler, steps, lr0=1.0):
    """Run the scheduler the way the trainer does: `_step(info)` with a fresh optimization_step, read get_last_lr."""
    config = optim.SGDConfig(lr=lr0)
    values = []
    for step in steps:
        returned = scheduler._step(TrainStepInfo(config, optimization_step=step))
        assert scheduler.get_last_lr() is returned
        assert len(returned) == 1
        values.append(returned[0])
    return values


# Reference values of docs/legacy_api.md §7.2 (verified on 1.13.1), lr0 = 1, steps 0..9.
POSITIONAL_REFERENCE = [
    (CONSTANT, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0]),
    (LINEAR, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.8, 0.6, 0.4, 0.2]),
    (
        COSINE,
        [
            0.0,
            0.9763960957919413,
            0.9059835861602854,
            0.7956724530494887,
            0.6563036824392345,
            0.5015739416158049,
            0.34668951940611276,
            0.2068719061737831,
            0.09586187986225325,
            0.0245691111902418,
        ],
    ),
    (
        POLY,
        [
            0.0,
            0.9509018036072144,
            0.9008016032064128,
            0.8507014028056112,
            0.8006012024048097,
            0.750501002004008,
            0.7004008016032064,
            0.6503006012024048,
            0.6002004008016032,
            0.5501002004008015,
        ],
    ),
]

KEYWORD_REFERENCE = [
    (CONSTANT, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0]),
    (LINEAR, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.8, 0.6, 0.4, 0.2]),
    (
        COSINE,
        [
            0.0,
            0.2,
            0.4,
            0.6,
            0.8,
            1.0,
            0.9045084971874737,
            0.6545084971874737,
            0.34549150281252633,
            0.09549150281252633,
        ],
    ),
    (POLY, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.80000002, 0.60000004, 0.40000006000000005, 0.20000007999999997]),
]


@pytest.mark.parametrize("scheduler_class,expected", POSITIONAL_REFERENCE, ids=lambda x: getattr(x, "__name__", ""))
def test_positional_reference_values(scheduler_class, expected):
    # (10, 0.5) is warmup=0.5 for Constant/Linear, but cycles=0.5 for Cosine and lr_end=0.5 for Poly.
    assert _lrs(scheduler_class(10, 0.5), range(10)) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("scheduler_class,expected", KEYWORD_REFERENCE, ids=lambda x: getattr(x, "__name__", ""))
def test_keyword_reference_values(scheduler_class, expected):
    scheduler = scheduler_class(total_steps=10, warmup=0.5)
    assert _lrs(scheduler, range(10)) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_positional_argument_order():
    assert (COSINE(10, 0.5).cycles, COSINE(10, 0.5).warmup) == (0.5, 0.002)
    assert (POLY(10, 0.5).lr_end, POLY(10, 0.5).warmup, POLY(10, 0.5).power) == (0.5, 0.002, 1.0)
    assert POLY(10, 0.5, 2.0, 0.1).power == 2.0
    assert (CONSTANT(10, 0.5).warmup, LINEAR(10, 0.5).warmup) == (0.5, 0.5)


@pytest.mark.parametrize("scheduler_class", ALL_SCHEDULERS)
def test_attributes(scheduler_class):
    scheduler = scheduler_class(total_steps=512, warmup=0.25)
    assert (scheduler.total_steps, scheduler.warmup, scheduler._num_warmup_steps) == (512, 0.25, 128.0)
    assert scheduler.get_last_lr() == []
    assert isinstance(scheduler, optim._LRScheduler)


# ---------------------------------------------------------------------------------------------------------------------
# Formulas, written out independently of the implementation, checked in and past the schedule
# ---------------------------------------------------------------------------------------------------------------------


def _reference(kind, s, total, warmup, lr0=1.0, cycles=0.5, lr_end=1e-7, power=1.0):
    n_w = warmup * total
    if s < n_w:
        return lr0 * s / max(1, n_w)
    if kind is CONSTANT:
        return lr0
    if kind is LINEAR:
        return lr0 * max(0.0, (total - s) / max(1, total - n_w))
    if kind is COSINE:
        progress = (s - n_w) / max(1, total - n_w)
        return lr0 * max(0.0, 0.5 * (1 + math.cos(math.pi * cycles * 2 * progress)))
    if s > total:
        return lr_end
    return (lr0 - lr_end) * (1 - (s - n_w) / (total - n_w)) ** power + lr_end


PAST_TOTAL = list(range(10, 31)) + [100, 10_000]


@pytest.mark.parametrize("scheduler_class", ALL_SCHEDULERS)
def test_keyword_values_past_total_steps(scheduler_class):
    expected = [_reference(scheduler_class, s, 10, 0.5) for s in PAST_TOTAL]
    actual = _lrs(scheduler_class(total_steps=10, warmup=0.5), PAST_TOTAL)
    assert actual == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_known_values_past_total_steps():
    steps = [10, 11, 12, 20, 100]
    assert _lrs(CONSTANT(total_steps=10, warmup=0.5), steps) == [1.0] * 5
    assert _lrs(LINEAR(total_steps=10, warmup=0.5), steps) == [0.0] * 5  # clamped at 0, never negative
    assert _lrs(POLY(total_steps=10, warmup=0.5), steps) == pytest.approx([1e-7] * 5, rel=1e-12)  # stays at lr_end
    assert _lrs(POLY(10, 0.5), steps) == pytest.approx([0.5] * 5, rel=1e-12)
    # Legacy cosine is not clamped at total_steps: with cycles=0.5 it mirrors around total_steps and rises again.
    cosine = _lrs(COSINE(total_steps=10, warmup=0.5), [9, 10, 11, 15, 20])
    assert cosine == pytest.approx([0.09549150281252633, 0.0, 0.09549150281252633, 1.0, 0.0], abs=1e-15)


@pytest.mark.parametrize("scheduler_class", ALL_SCHEDULERS)
@pytest.mark.parametrize("total,warmup", [(1, 0.0), (7, 0.3), (100, 0.002), (1000, 0.1), (3, 0.999)])
def test_formulas_over_whole_schedule(scheduler_class, total, warmup):
    steps = range(0, 2 * total + 3)
    scheduler = scheduler_class(total_steps=total, warmup=warmup)
    expected = [_reference(scheduler_class, s, total, warmup, lr0=0.3) for s in steps]
    assert _lrs(scheduler, steps, lr0=0.3) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_cosine_and_poly_extra_arguments():
    cosine = COSINE(total_steps=20, cycles=2.0, warmup=0.1)
    assert _lrs(cosine, range(25), lr0=0.5) == pytest.approx(
        [_reference(COSINE, s, 20, 0.1, lr0=0.5, cycles=2.0) for s in range(25)], rel=1e-12, abs=1e-15
    )
    poly = POLY(total_steps=20, lr_end=0.01, power=2.0, warmup=0.1)
    assert _lrs(poly, range(25), lr0=0.5) == pytest.approx(
        [_reference(POLY, s, 20, 0.1, lr0=0.5, lr_end=0.01, power=2.0) for s in range(25)], rel=1e-12
    )
    # At step 11 (9 of 18 decay steps left): (0.5 - 0.01) * 0.5**2 + 0.01
    assert _lrs(poly, [11], lr0=0.5) == pytest.approx([0.1325], rel=1e-12)


@pytest.mark.parametrize("scheduler_class", ALL_SCHEDULERS)
def test_zero_warmup_float_is_accepted(scheduler_class):
    # 0.0 means no warm-up: step 0 already uses the full learning rate.
    assert _lrs(scheduler_class(total_steps=10, warmup=0.0), [0], lr0=0.25) == pytest.approx([0.25])


# ---------------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler_class", ALL_SCHEDULERS)
@pytest.mark.parametrize("total_steps", [0, -1, 10.0, "10", None])
def test_invalid_total_steps(scheduler_class, total_steps):
    with pytest.raises(AssertionError) as e:
        scheduler_class(total_steps=total_steps)
    assert str(e.value) == "total_steps must be a strict positive number"


@pytest.mark.parametrize("scheduler_class", ALL_SCHEDULERS)
@pytest.mark.parametrize("warmup", [0, 1, 1.0, 1.5, -0.1, "0.5", None])
def test_invalid_warmup_message_states_the_real_range(scheduler_class, warmup):
    with pytest.raises(AssertionError) as e:
        scheduler_class(total_steps=10, warmup=warmup)
    # Legacy said "(0, 1]", which contradicts the check (0.0 accepted, 1.0 rejected).
    assert str(e.value) == "warmup must be a float in the range [0, 1)"


@pytest.mark.parametrize("cycles", [0.0, -0.5, 1, None])
def test_invalid_cycles(cycles):
    with pytest.raises(AssertionError, match=r"^cycles must be a positive float$"):
        COSINE(total_steps=10, cycles=cycles)


@pytest.mark.parametrize("lr_end", [-1e-7, 0, 1, None])
def test_invalid_lr_end(lr_end):
    with pytest.raises(AssertionError, match=r"^lr_end must be a positive float$"):
        POLY(total_steps=10, lr_end=lr_end)


@pytest.mark.parametrize("power", [-1.0, 1, None])
def test_invalid_power(power):
    with pytest.raises(AssertionError, match=r"^power must be a positive float$"):
        POLY(total_steps=10, power=power)


def test_validation_order_matches_legacy():
    # Poly checks lr_end before warmup, and warmup before power.
    with pytest.raises(AssertionError, match="lr_end"):
        POLY(total_steps=10, lr_end=-1.0, power=-1.0, warmup=2.0)
    with pytest.raises(AssertionError, match="warmup"):
        POLY(total_steps=10, power=-1.0, warmup=2.0)
    with pytest.raises(AssertionError, match="cycles"):
        COSINE(total_steps=10, cycles=-1.0, warmup=2.0)


@pytest.mark.parametrize("lr0,lr_end", [(0.5, 0.5), (0.1, 0.5), (0.0, 0.0)])
def test_poly_lr_end_not_below_lr_raises_assertion_naming_both(lr0, lr_end):
    scheduler = POLY(total_steps=10, lr_end=lr_end)
    # Legacy raised NameError here (its message used an undefined name).
    with pytest.raises(AssertionError) as e:
        _lrs(scheduler, [3], lr0=lr0)
    assert str(e.value) == f"lr_end ({lr_end}) must be smaller than initial lr ({float(lr0)})"


# ---------------------------------------------------------------------------------------------------------------------
# Base class
# ---------------------------------------------------------------------------------------------------------------------


def test_base_get_lr_is_abstract():
    scheduler = optim._LRScheduler()
    assert scheduler.get_last_lr() == []
    with pytest.raises(NotImplementedError):
        scheduler._step(TrainStepInfo(optim.SGDConfig()))


def test_custom_scheduler_subclass():
    class Halving(optim._LRScheduler):
        def get_lr(self, train_step_info):
            return [train_step_info.optimizer_config.lr * 0.5**train_step_info.optimization_step]

    scheduler = Halving()
    assert _lrs(scheduler, [0, 1, 3], lr0=2.0) == [2.0, 1.0, 0.25]
    assert scheduler.get_last_lr() == [0.25]
