"""The trainer on every optimizer update path (update/path.py): the existing checks, run again off the default.

The default path (`auto`: the torch update after a gradient-only graph) is what the rest of the suite runs;
here the plain-op graph update (`graph`, the update before the switch) and ONNX Runtime's fused kernel (`fused`)
go through the PyTorch parity cases, the mixed-precision skip and resume, and ZeRO with two ranks.
"""

from __future__ import annotations

import pytest
import test_distributed
import test_mixed_precision
import test_trainer_parity as parity
import torch
from helpers import make_trainer, needs_training_build
from models import MLP, mlp_desc

from orttrainer import optim
from orttrainer.trainer.runtime import has_training_build
from orttrainer.trainer.update.path import ENVIRONMENT_VARIABLE

PATHS = ("graph", pytest.param("fused", marks=needs_training_build))


@pytest.fixture(params=PATHS)
def update_path(request, monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, request.param)
    return request.param


@pytest.mark.parametrize(("opt_name", "clip"), parity.MLP_CASES)
def test_mlp_matches_pytorch(update_path, opt_name, clip):
    trainer, reference = parity.train_both(parity._mlp_case, opt_name, clip)
    assert parity.max_weight_difference(trainer, reference) < parity.TOLERANCE
    graph = trainer._training_session.graph
    assert graph.outside_update is None
    kernels = [n for n in graph.model.graph.node if n.op_type == "AdamOptimizer"]
    fused_here = update_path == "fused" and opt_name in ("adam", "adamw_before_update", "adam_no_bias_correction")
    assert bool(kernels) == fused_here


@pytest.mark.parametrize("opt_name", ["adamw_before_update", "lamb_bias_correction_clamped"])
def test_transformer_matches_pytorch(update_path, opt_name):
    trainer, reference = parity.train_both(parity._transformer_case, opt_name, True)
    assert parity.max_weight_difference(trainer, reference, parity.key_bias_slice()) < parity.TOLERANCE


@needs_training_build  # mixed precision on the 'ort' builder
@pytest.mark.parametrize("accumulation", [1, 2])
def test_an_overflowing_step_changes_nothing(update_path, accumulation):
    test_mixed_precision.test_an_overflowing_step_changes_nothing_halves_the_scale_and_the_next_step_updates(
        accumulation
    )


@needs_training_build  # mixed precision on the 'ort' builder
def test_resume_under_mixed_precision_is_exact(update_path, tmp_path):
    test_mixed_precision.test_resume_under_mixed_precision_is_exact(tmp_path)


@pytest.mark.parametrize("update", ["graph", "torch"])
def test_zero_stage_1_on_each_path(monkeypatch, tmp_path, update):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, update)  # the ranks' processes inherit it
    test_distributed.test_zero_stage_1_equals_data_parallel_and_partitions_the_optimizer_state(tmp_path, "lamb")


def test_the_paths_agree_with_each_other(monkeypatch):
    """The same 6 Adam steps with accumulation and clipping on each path: the weights agree to float32 rounding."""
    weights = {}
    for update in ("graph", "fused", "torch") if has_training_build() else ("graph", "torch"):  # fused: its kernel
        monkeypatch.setenv(ENVIRONMENT_VARIABLE, update)
        torch.manual_seed(0)
        options = {"batch": {"gradient_accumulation_steps": 2}}
        trainer = make_trainer(
            MLP(), mlp_desc(), optim.AdamConfig(lr=1e-2, lambda_coef=0.01), torch.nn.functional.cross_entropy, options
        )
        g = torch.Generator().manual_seed(3)
        for _ in range(12):
            trainer.train_step(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
        weights[update] = trainer._training_session.get_state()
        assert (trainer._training_session.graph.outside_update is not None) == (update == "torch")
    for update in set(weights) - {"graph"}:
        for name, value in weights["graph"].items():
            ours, theirs = torch.from_numpy(weights[update][name]), torch.from_numpy(value)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
