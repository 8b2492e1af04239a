"""Every OpInfo of PyTorch's `op_db` that supports autograd in float32: its gradient through the torch builder
(trace, ONNX export, ONNX Runtime) matches `torch.autograd` (`torch_coverage.run_op_sample`); a representative
subset also trains through ORTTrainer itself. The entries the builder cannot differentiate are listed with the
error each gives (`torch_coverage.error_key`); docs/torch_builder_coverage.md is the generated table."""

from __future__ import annotations

import pytest
from torch_coverage import error_key, op_infos, op_name, op_samples, run_op_sample, spread
from torch_coverage_known import OP_DB_UNSUPPORTED, OP_DB_UNSUPPORTED_LATER_SAMPLES

OPS = {op_name(op): op for op in op_infos()}
SLOW_SAMPLES = 4
THROUGH_TRAINER = [  # one per family the builder's own decompositions cover, through ORTTrainer
    "nn.functional.conv2d",
    "nn.functional.conv_transpose2d",
    "nn.functional.avg_pool2d",
    "nn.functional.max_pool3d",
    "nn.functional.adaptive_max_pool2d",
    "nn.functional.interpolate.bicubic",
    "nn.functional.grid_sample",
    "nn.functional.embedding_bag",
    "nn.functional.bilinear",
    "as_strided_scatter",
    "cummax",
    "median",
    "index_reduce.mean",
]


def check(name: str, chosen: list[int], through_trainer: bool = False) -> None:
    op = OPS[name]
    samples = op_samples(op)
    assert samples, f"{name}: no float32 sample"
    expected = OP_DB_UNSUPPORTED.get(name)
    if expected is None and chosen != [0]:
        expected = OP_DB_UNSUPPORTED_LATER_SAMPLES.get(name)
    for i in chosen:
        outcome = run_op_sample(op, samples[i], through_trainer)
        where = f"{name} sample {i}"
        if expected is not None and outcome.status != "pass":
            assert error_key(outcome.detail) == expected, f"{where}: {outcome.detail}"
            return
        assert outcome.status == "pass", f"{where}: {outcome.status}: {outcome.detail}"
    assert name not in OP_DB_UNSUPPORTED, f"{name} passes now: remove it from OP_DB_UNSUPPORTED"


@pytest.mark.parametrize("name", sorted(OPS))
def test_gradient_like_autograd(name):
    check(name, [0])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPS))
def test_more_samples_like_autograd(name):
    count = len(op_samples(OPS[name]))
    check(name, spread(count, SLOW_SAMPLES)[1:] or [0])


@pytest.mark.parametrize("name", THROUGH_TRAINER)
def test_through_the_trainer(name):
    assert name not in OP_DB_UNSUPPORTED
    check(name, [0], through_trainer=True)


def test_the_known_failures_are_op_db_entries():
    assert set(OP_DB_UNSUPPORTED) <= set(OPS) and set(OP_DB_UNSUPPORTED_LATER_SAMPLES) <= set(OPS)
