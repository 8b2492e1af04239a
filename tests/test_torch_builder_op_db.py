"""Every OpInfo of PyTorch's `op_db` that supports autograd in float32: its gradient through the torch builder
(trace, ONNX export, ONNX Runtime) matches `torch.autograd` (`torch_coverage.run_op_sample`); a representative
subset also trains through ORTTrainer itself. The default lanes run one entry in six (`torch_coverage.sampled`);
`make coverage` runs them all. The entries the builder cannot differentiate are listed with the
error each gives (`torch_coverage.error_key`); docs/torch_builder_coverage.md is the generated table."""

from __future__ import annotations

import pytest
from torch_coverage import error_key, op_infos, op_name, op_samples, run_op_sample, sampled
from torch_coverage_known import OP_DB_UNSUPPORTED

OPS = {op_name(op): op for op in op_infos()}
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


def check(name: str, through_trainer: bool = False) -> None:
    """The entry's first float32 sample (the one the coverage table's default run reports)."""
    samples = op_samples(OPS[name])
    assert samples, f"{name}: no float32 sample"
    outcome = run_op_sample(OPS[name], samples[0], through_trainer)
    expected = OP_DB_UNSUPPORTED.get(name)
    if expected is not None:
        assert outcome.status != "pass", f"{name} passes now: regenerate tests/torch_coverage_known.py"
        assert error_key(outcome) == expected, f"{name}: {outcome.detail}"
    else:
        assert outcome.status == "pass", f"{name}: {outcome.status}: {outcome.detail}"


@pytest.mark.parametrize("name", sampled(sorted(OPS), every=6, always=tuple(THROUGH_TRAINER)))
def test_gradient_like_autograd(name):
    check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", THROUGH_TRAINER)
def test_through_the_trainer(name):
    assert name not in OP_DB_UNSUPPORTED
    check(name, through_trainer=True)


def test_the_known_failures_are_op_db_entries():
    assert set(OP_DB_UNSUPPORTED) <= set(OPS)
