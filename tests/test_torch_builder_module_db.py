"""Every torch.nn module in PyTorch's `module_db` with float32 training samples takes one SGD step through
ORTTrainer with the torch builder, and its loss, parameter gradients and buffers match eager PyTorch
(`torch_coverage.run_module_sample`). The entries the builder cannot train are listed with the error key each
gives (tests/torch_coverage_known.py, generated with docs/torch_builder_coverage.md). The default lanes run one
entry in three and the buffer-mutating ones (`torch_coverage.sampled`); `make coverage` runs them all.

Buffers a module's forward mutates (BatchNorm's running statistics and batch counter) are updated by the step and
compared at their new values; `test_buffer_mutations_are_reported` pins which they are. After the step, an eval step
of each entry that trains matches the module's eval-mode forward (`torch_coverage.run_module_eval_sample`)."""

from __future__ import annotations

import pytest
from torch_coverage import (
    error_key,
    module_infos,
    module_samples,
    run_module_eval_sample,
    run_module_sample,
    sampled,
)
from torch_coverage_known import MODULE_DB_UNSUPPORTED

INFOS = {info.name: info for info in module_infos()}

# modules whose forward mutates buffers, and which: AOTAutograd's joint graph outputs them as buffer mutations
MUTATING = {
    "nn.BatchNorm1d": {"module.running_mean", "module.running_var", "module.num_batches_tracked"},
    "nn.BatchNorm2d": {"module.running_mean", "module.running_var", "module.num_batches_tracked"},
    "nn.BatchNorm3d": {"module.running_mean", "module.running_var", "module.num_batches_tracked"},
    "nn.InstanceNorm1d": {"module.running_mean", "module.running_var"},
    "nn.InstanceNorm2d": {"module.running_mean", "module.running_var"},
    "nn.InstanceNorm3d": {"module.running_mean", "module.running_var"},
}


def check(name: str) -> set[str]:
    """Run the entry's first training sample (the one the coverage table reports); returns the buffers it mutates."""
    info = INFOS[name]
    samples = module_samples(info)
    assert samples, f"{name}: no float32 training sample a trainer can take"
    outcome = run_module_sample(info, samples[0])
    expected = MODULE_DB_UNSUPPORTED.get(name)
    if expected is not None:
        assert outcome.status != "pass", f"{name} trains now: regenerate tests/torch_coverage_known.py"
        assert error_key(outcome) == expected, f"{name}: {outcome.detail}"
    else:
        assert outcome.status == "pass", f"{name} ({samples[0].desc!r}): {outcome.status}: {outcome.detail}"
    return set(outcome.mutated)


@pytest.mark.parametrize("name", sampled(sorted(INFOS), every=3, always=tuple(MUTATING)))
def test_one_training_step_like_eager(name):
    mutated = check(name)
    if name not in MODULE_DB_UNSUPPORTED:
        assert mutated <= MUTATING.get(name, set()), f"{name} mutates {sorted(mutated)}: add it to MUTATING"


# modules whose eval graph is traced (build/torch_route.TorchEvalGraphs); the others are exported (an op the direct
# translation lacks) and must match just the same
TRACED_EVAL = (
    "nn.Linear",
    "nn.Conv2d",
    "nn.BatchNorm2d",
    "nn.LayerNorm",
    "nn.Embedding",
    "nn.LSTM",
    "nn.TransformerEncoderLayer",
)


@pytest.mark.parametrize("name", sampled(sorted(set(INFOS) - set(MODULE_DB_UNSUPPORTED)), every=3, always=TRACED_EVAL))
def test_eval_step_like_eager_eval(name):
    """After the step, an eval step of each entry that trains gives the module's eval-mode forward on the trainer's
    state (dropout off, BatchNorm on its running statistics), whether its eval graph is traced or exported."""
    outcome, traced = run_module_eval_sample(INFOS[name], module_samples(INFOS[name])[0])
    assert outcome.status == "pass", f"{name}: {outcome.status}: {outcome.detail}"
    if name in TRACED_EVAL:
        assert traced, f"{name}: the eval graph was exported (logged at INFO why the trace failed)"


def test_buffer_mutations_are_reported():
    """The torch builder lists the buffers a traced forward mutates (`mutated_buffers`), whose new values the
    gradient graph outputs; for BatchNorm they are the running statistics and the batch counter."""
    import torch

    from orttrainer.trainer.gradient.torch_builder import build_torch_gradient_graph

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    graph = build_torch_gradient_graph(
        model,
        lambda out, y: (out - y).square().mean(),
        ["input", "y"],
        [torch.randn(2, 3, 5, 5), torch.randn(2, 4, 3, 3)],
        ["loss"],
        [n for n, _ in model.named_parameters()],
    )
    assert graph.mutated_buffers == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
