"""A trainer's state is only ever one that whole steps and loads produced (docs/design.md § Failure atomicity):
loads check every part before applying any, a step interrupted by a signal is applied whole or not at all, two
threads on one trainer never interleave, and the dropout stream's seed is taken at construction."""

from __future__ import annotations

import random
import signal
import threading
import time

import numpy as np
import pytest
import torch
from helpers import make_trainer
from models import MLP, mlp_desc

from orttrainer import optim

CE = torch.nn.functional.cross_entropy


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def _trained(config, steps: int = 3, accumulation: int = 2):
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), config, CE, {"batch": {"gradient_accumulation_steps": accumulation}})
    for i in range(steps):
        trainer.train_step(*_batch(i))
    return trainer


def _everything(trainer) -> tuple[dict[str, np.ndarray], tuple[int, int, int]]:
    """Every state tensor the session holds, and the three counters."""
    session = trainer._training_session
    info = trainer._train_step_info
    return session.get_state(session.state_names()), (
        info.step,
        info.optimization_step,
        trainer._state.counters.optimizer_updates,
    )


def _same(a, b) -> bool:
    (values_a, counters_a), (values_b, counters_b) = a, b
    return (
        counters_a == counters_b
        and set(values_a) == set(values_b)
        and all(np.array_equal(values_a[k], values_b[k]) for k in values_a)
    )


def _step_as_text(state: dict) -> None:
    state["train_step_info"]["step"] = "7"


def _no_optimization_step(state: dict) -> None:
    del state["train_step_info"]["optimization_step"]


def _negative_step(state: dict) -> None:
    state["train_step_info"]["step"] = -1


def _rng_without_seed(state: dict) -> None:
    state["rng"] = {"positions": {"all": 3}}


def _loss_scale_as_text(state: dict) -> None:
    state["optimizer"]["fc1.weight"]["Update_Count"] = np.array(["one"])


@pytest.mark.parametrize(
    ("breaks", "message"),
    [
        (_step_as_text, r"train_step_info\]\[step\] must be a non-negative integer, got '7'"),
        (_no_optimization_step, r"\[optimization_step\] must be a non-negative integer, got None \(missing\)"),
        (_negative_step, r"train_step_info\]\[step\] must be a non-negative integer, got -1"),
        (_rng_without_seed, r"state_dict\[rng\] is malformed"),
        (_loss_scale_as_text, r"\[optimizer\]\[fc1.weight\]\[Update_Count\]: expected a positive integer"),
    ],
)
def test_a_bad_part_beside_good_weights_changes_nothing(breaks, message):
    """The weights, moments and accumulation buffers of the state dict are fine; another part is not: the load
    fails naming that part, and the trainer is exactly as before."""
    source = _trained(optim.AdamConfig(lr=1e-2), steps=3)  # mid window: the buffers are part of the state dict
    target = _trained(optim.AdamConfig(lr=1e-2), steps=1)
    target.train_step(*_batch(7))  # different weights and counters from the source
    state = source.state_dict()
    breaks(state)
    before = _everything(target)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert _same(_everything(target), before)


def test_a_string_weight_is_refused_naming_the_tensor_and_changes_nothing():
    source, target = _trained(optim.SGDConfig(lr=0.1)), _trained(optim.SGDConfig(lr=0.1), steps=1)
    state = source.state_dict()
    state["model"]["full_precision"]["fc2.weight"] = np.array("not a weight")
    before = _everything(target)
    with pytest.raises(ValueError, match=r"state 'fc2.weight': .*(shape|convert)"):
        target.load_state_dict(state)
    pytorch = {k: v.clone() for k, v in source.state_dict(pytorch_format=True).items()}
    pytorch["fc1.bias"] = np.full(pytorch["fc1.bias"].shape, "x")
    with pytest.raises(ValueError, match=r"state 'fc1.bias': could not convert string to float"):
        target.load_state_dict(pytorch)
    assert _same(_everything(target), before)


@pytest.mark.parametrize("where", ["model/full_precision/fc1.weight", "optimizer/fc2.bias/Moment_2"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_or_moments_are_refused_by_name(where, bad):
    source, target = _trained(optim.AdamConfig(lr=1e-2)), _trained(optim.AdamConfig(lr=1e-2), steps=1)
    state = source.state_dict()
    *path, last = where.split("/")
    node = state
    for key in path:
        node = node[key]
    tensor = np.array(node[last], copy=True)
    tensor.reshape(-1)[3] = bad
    node[last] = tensor
    before = _everything(target)
    name = "fc1.weight" if "fc1" in where else "Moment_2_fc2.bias"
    with pytest.raises(ValueError, match=rf"NaN or Inf in \['{name}'\]"):
        target.load_state_dict(state)
    assert _same(_everything(target), before)


class _Interrupted(Exception):
    pass


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
@pytest.mark.parametrize("config", [optim.AdamConfig(lr=1e-2), optim.LambConfig(lr=1e-2)], ids=["adam", "lamb"])
def test_a_step_interrupted_by_a_signal_is_applied_whole_or_not_at_all(config):
    """A SIGALRM handler that raises, timed across the step (40 tries, from 10 µs to 1.2 steps on a geometric grid,
    in a random order: the early ones land before the step's state changes begin, the late ones after): afterwards
    the trainer equals a twin that took exactly the steps whose counters moved — never a state in between, so a
    retry counts no gradient twice."""
    trainer, twin = _trained(config, steps=1), _trained(config, steps=1)
    batch = _batch(5)
    timer = signal.getitimer(signal.ITIMER_REAL)
    assert timer == (0.0, 0.0), "another alarm is pending"
    t0 = time.perf_counter()
    for _ in range(3):
        twin.train_step(*batch)
        trainer.train_step(*batch)
    step_time = (time.perf_counter() - t0) / 6

    def interrupt(signum, frame):
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    # uniform delays left all 40 after the step's first changes on a fast step (the window before them is short)
    delays = [1e-5 * (1.2 * step_time / 1e-5) ** (i / 39) for i in range(40)]
    random.Random(0).shuffle(delays)
    outcomes = {"applied": 0, "not applied": 0}
    try:
        for delay in delays:
            before = _everything(trainer)
            try:  # a 10 µs alarm can fire as setitimer returns: inside the try, it counts as "not applied"
                signal.setitimer(signal.ITIMER_REAL, delay)
                trainer.train_step(*batch)
                while True:  # the alarm was later than the step: let it fire here, outside the step
                    time.sleep(step_time)
            except _Interrupted:
                pass
            signal.setitimer(signal.ITIMER_REAL, 0)
            after = _everything(trainer)
            if after[1] != before[1]:
                twin.train_step(*batch)
                outcomes["applied"] += 1
            else:
                outcomes["not applied"] += 1
            assert _same(after, _everything(twin)), f"a state between two steps after {outcomes}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert outcomes["applied"] > 0 and outcomes["not applied"] > 0, outcomes


def test_two_threads_on_one_trainer_run_their_steps_one_at_a_time():
    """15 steps from each of two threads, after one step: the counters are those of 31 steps and the weights those
    of the same steps run one after another (the same batch everywhere, so any order gives the same result)."""
    trainer, sequential = _trained(optim.AdamConfig(lr=1e-2), steps=1), _trained(optim.AdamConfig(lr=1e-2), steps=1)
    batch = _batch(3)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(15):
                trainer.train_step(*batch)
        except BaseException as err:  # reported below: an exception in a thread would otherwise vanish
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for _ in range(30):
        sequential.train_step(*batch)
    assert not errors
    assert (trainer.step, trainer.optimization_step) == (31, 15)
    assert _same(_everything(trainer), _everything(sequential))


def test_the_dropout_stream_is_seeded_when_the_trainer_is_constructed():
    """Seeding torch again between construction and the first step changes none of the trainer's masks."""

    class DropoutMLP(MLP):
        def forward(self, x):
            return torch.nn.functional.dropout(super().forward(x), 0.5, self.training)

    losses = []
    for reseed in (False, True):
        torch.manual_seed(0)
        trainer = make_trainer(DropoutMLP(), mlp_desc(), optim.SGDConfig(lr=0.1), CE)
        if reseed:
            torch.manual_seed(1234)
        losses.append([float(trainer.train_step(*_batch(i))[0]) for i in range(3)])
    assert losses[0] == losses[1]
