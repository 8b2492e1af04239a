"""orttrainer.debug on the ONNX Runtime path: the same model and weights, run in PyTorch and in ORTTrainer, write the
same files in the same order with statistics that agree (forward and backward), step ranges, eval steps,
override_output_dir, inspect_activation inside a module's forward, and what happens without subscribers. With both
gradient builders (`builder`): the 'ort' builder where onnxruntime-training is installed, the torch builder on every
runtime."""

from __future__ import annotations

import copy
import math
import os
import warnings

import pytest
import torch
from torch import nn

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.debug import (
    GlobalSubscriberManager,
    StatisticsSubscriber,
    SubscriberBase,
    SubscriberManager,
    compare_activation_summaries,
    inspect_activation,
    merge_activation_summaries,
    parse_statistics,
)
from orttrainer.debug.merge_activation_summary import main as merge_main
from orttrainer.debug.subscriber import managers_of
from orttrainer.trainer.runtime import has_training_build

DESC = {
    "inputs": [("x", ["batch", 3]), ("target", ["batch", 2])],
    "outputs": [("loss", [], True), ("out", ["batch", 2])],
}
SAMPLE_ORDER = """Linear_1_0th_output_forward GELU_2_0th_output_forward Linear_4_0th_output_forward
block_pre_act_forward Block_3_0th_output_forward Linear_5_0th_output_forward DebugMLP_0_0th_output_forward
DebugMLP_0_0th_output_backward Linear_5_0th_output_backward Block_3_0th_output_backward block_pre_act_backward
Linear_4_0th_output_backward GELU_2_0th_output_backward Linear_1_0th_output_backward""".split()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(inspect_activation("block_pre_act", self.lin(x)))


class DebugMLP(nn.Module):  # the sample model of docs/debugging.md §4
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.block, self.fc2 = nn.Linear(3, 4), nn.GELU(), Block(), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(self.block(self.act(self.fc1(x))))


class TwoUses(nn.Module):
    """An inspected tensor whose un-inspected original has a second consumer: their gradients differ."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.lin(x)
        return self.head(torch.relu(inspect_activation("inspected", h)) + h * 2)


BUILDERS = ["torch", "ort"] if has_training_build() else ["torch"]
_BUILDER = {"name": "auto"}


@pytest.fixture(autouse=True)
def _detach_global_manager():
    yield
    GlobalSubscriberManager.unsubscribe()
    _BUILDER["name"] = "auto"


@pytest.fixture(params=BUILDERS)
def builder(request) -> str:
    """The gradient builder the trainer runs with: both write the same files (the torch builder marks the
    activations in its trace, trainer/activations.py)."""
    _BUILDER["name"] = request.param
    return request.param


def make_model(cls=DebugMLP) -> nn.Module:
    torch.manual_seed(2)
    return cls()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(n)]


def subscribe(model, out, **kwargs) -> StatisticsSubscriber:
    subscriber = StatisticsSubscriber(out, override_output_dir=True, **kwargs)
    GlobalSubscriberManager.subscribe(model, [subscriber])
    return subscriber


def pytorch_run(model, out, schedule: str = "ttt", **kwargs) -> None:
    """'t': a train step (forward, MSE backward, SGD lr 0.1); 'e': an eval-mode no_grad forward."""
    subscribe(model, out, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kind, (x, target) in zip(schedule, batches(len(schedule)), strict=False):
        if kind == "t":
            opt.zero_grad()
            nn.functional.mse_loss(model(x), target).backward()
            opt.step()
        else:
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()


def make_trainer(model, extra: dict | None = None) -> ORTTrainer:
    """On the `builder` fixture's gradient builder where a test takes it (else 'auto' or what `extra` says)."""
    extra = {"_internal_use": {"gradient_builder": _BUILDER["name"]}, **(extra or {})}
    options = ORTTrainerOptions({"device": {"id": "cpu"}, **extra})
    return ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=nn.functional.mse_loss, options=options)


def trainer_run(model, out, schedule: str = "ttt", extra: dict | None = None, **kwargs) -> ORTTrainer:
    if out is not None:
        subscribe(model, out, **kwargs)
    trainer = make_trainer(model, extra)
    for kind, (x, target) in zip(schedule, batches(len(schedule)), strict=False):
        (trainer.train_step if kind == "t" else trainer.eval_step)(x, target)
    return trainer


def tree(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def order(out, step: int) -> list[str]:
    return (out / f"step_{step}" / "order.txt").read_text(encoding="utf-8").splitlines()


def assert_same_dumps(pt, ort, sign_slack: float = 0.0) -> None:
    """Same files and order.txt; every field equal, min/max/mean/std within float32 tolerance, neg/pos/zero counts
    within `sign_slack * size` (elements within rounding of 0 may flip sign between kernels)."""
    assert tree(pt) == tree(ort)
    for step in sorted(p.name for p in pt.iterdir()):
        assert (pt / step / "order.txt").read_text() == (ort / step / "order.txt").read_text()
        for name in order(pt, int(step.removeprefix("step_"))):
            a, b = (parse_statistics((root / step / name).read_text(encoding="utf-8")) for root in (pt, ort))
            for key in ("name", "direction", "depth", "shape", "dtype", "size", "nan", "inf"):
                assert a[key] == b[key], (step, name, key)
            for key in ("neg", "pos", "zero"):
                assert abs(a[key] - b[key]) <= sign_slack * a["size"], (step, name, key)
            for key in ("min", "max", "mean", "std"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, name, key)
    report = compare_activation_summaries(pt, ort)
    assert report.first_divergence is None, report.format()
    assert all(not s.missing_in_ort and s.only_in is None for s in report.steps)


# --------------------------------------------------------------------------------------- PyTorch vs the trainer
def test_pytorch_and_trainer_write_the_same_files_and_statistics(tmp_path, builder):
    model = make_model()
    pytorch_run(copy.deepcopy(model), tmp_path / "pt")
    trainer_run(model, tmp_path / "ort")
    assert tree(tmp_path / "ort") == [f"step_{s}/{n}" for s in range(3) for n in sorted(SAMPLE_ORDER + ["order.txt"])]
    assert order(tmp_path / "ort", 2) == SAMPLE_ORDER
    assert_same_dumps(tmp_path / "pt", tmp_path / "ort")
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 3  # the export counted none
    merge_activation_summaries(tmp_path / "pt", tmp_path / "ort", tmp_path / "merged")
    merged = [
        (tmp_path / "merged" / side / "step_1_.txt").read_text().splitlines() for side in ("merge_pt", "merge_ort")
    ]
    headers = [[line for line in lines if " run shape: " in line] for lines in merged]
    assert len(merged[0]) == len(merged[1]) and headers[0] == headers[1] and len(headers[0]) == len(SAMPLE_ORDER)


def test_transformer_dumps_agree(tmp_path, builder):
    from models import TinyTransformer, transformer_desc, transformer_loss

    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.0)  # the trainer's dropout masks come from ONNX Runtime's RNG
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    data = [
        (torch.randint(0, 50, (4, 16), generator=generator), torch.randint(0, 50, (4, 16), generator=generator))
        for _ in range(2)
    ]
    subscribe(reference, tmp_path / "pt")
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for tokens, target in data:
        opt.zero_grad()
        transformer_loss(reference(tokens), target).backward()
        opt.step()
    subscribe(model, tmp_path / "ort")
    trainer = ORTTrainer(
        model,
        transformer_desc(),
        optim.SGDConfig(lr=0.1),
        loss_fn=transformer_loss,
        options=ORTTrainerOptions({"device": {"id": "cpu"}, "_internal_use": {"gradient_builder": builder}}),
    )
    for tokens, target in data:
        trainer.train_step(tokens, target)
    assert len(order(tmp_path / "ort", 1)) > 40  # every module of the encoder, forward and backward
    assert_same_dumps(tmp_path / "pt", tmp_path / "ort", sign_slack=0.01)


def test_merge_names_the_activation_where_a_perturbed_weight_first_shows_up(tmp_path, builder, capsys):
    model = make_model()
    pytorch_run(copy.deepcopy(model), tmp_path / "pt")
    with torch.no_grad():
        model.block.lin.weight[0, 0] += 0.5
    trainer_run(model, tmp_path / "ort")
    report = compare_activation_summaries(tmp_path / "pt", tmp_path / "ort")
    assert report.first_divergence == ("step_0", "Linear_4_0th_output_forward")
    assert (
        merge_main(
            [
                "--pt_dir",
                str(tmp_path / "pt"),
                "--ort_dir",
                str(tmp_path / "ort"),
                "--output_dir",
                str(tmp_path / "merged"),
            ]
        )
        == 0
    )
    assert "step_0: first divergence: Linear_4_0th_output_forward" in capsys.readouterr().out


def test_gradients_of_an_inspected_tensor_with_two_consumers(tmp_path, builder):
    model = make_model(TwoUses)
    pytorch_run(copy.deepcopy(model), tmp_path / "pt", "tt")
    trainer_run(model, tmp_path / "ort", "tt")
    assert_same_dumps(tmp_path / "pt", tmp_path / "ort")
    inspected = parse_statistics((tmp_path / "ort" / "step_0" / "inspected_backward").read_text())
    total = parse_statistics((tmp_path / "ort" / "step_0" / "Linear_1_0th_output_backward").read_text())
    assert inspected["depth"] == -1 and inspected["mean"] != pytest.approx(total["mean"])  # not the summed gradient


def test_an_eval_step_is_a_forward_only_step_in_both_paths(tmp_path, builder):
    model = make_model()
    pytorch_run(copy.deepcopy(model), tmp_path / "pt", "ttet")
    trainer_run(model, tmp_path / "ort", "ttet")
    assert order(tmp_path / "ort", 2) == [n for n in SAMPLE_ORDER if n.endswith("_forward")]
    assert order(tmp_path / "ort", 3) == SAMPLE_ORDER
    assert_same_dumps(tmp_path / "pt", tmp_path / "ort")


def test_a_first_eval_step_under_no_grad_still_traces_the_backward_order(tmp_path, builder):
    model = make_model()
    subscribe(model, tmp_path / "o")
    trainer = make_trainer(model)
    ((x, target),) = batches(1)
    with torch.no_grad():
        trainer.eval_step(x, target)
    trainer.train_step(x, target)
    assert order(tmp_path / "o", 0) == [n for n in SAMPLE_ORDER if n.endswith("_forward")]
    assert order(tmp_path / "o", 1) == SAMPLE_ORDER


@pytest.mark.parametrize("schedule", ["tttt", "tete"])
def test_step_ranges_in_both_paths(tmp_path, builder, schedule):
    model = make_model()
    pytorch_run(copy.deepcopy(model), tmp_path / "pt", schedule, start_step=1, end_step=3)
    trainer_run(model, tmp_path / "ort", schedule, start_step=1, end_step=3)
    assert sorted(os.listdir(tmp_path / "ort")) == ["step_1", "step_2"]
    assert "block_pre_act_forward" in order(tmp_path / "ort", 1)  # inspect_activation honours the range too
    assert_same_dumps(tmp_path / "pt", tmp_path / "ort")
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 4


def test_override_output_dir_in_both_paths(tmp_path, builder):
    for out in (tmp_path / "pt", tmp_path / "ort"):
        (out / "step_0").mkdir(parents=True)
        (out / "step_0" / "stale").write_text("old run")
        with pytest.raises(FileExistsError, match="already exists and is not empty"):
            StatisticsSubscriber(out)
    model = make_model()
    with pytest.warns(UserWarning, match="already exists, overriding it"):
        pytorch_run(copy.deepcopy(model), tmp_path / "pt", "t")
    with pytest.warns(UserWarning, match="already exists, overriding it"):
        trainer_run(model, tmp_path / "ort", "t")
    assert not (tmp_path / "ort" / "step_0" / "stale").exists()
    assert_same_dumps(tmp_path / "pt", tmp_path / "ort")


def test_gradient_accumulation_micro_steps_are_steps(tmp_path, builder):
    model = make_model()
    pytorch_run(copy.deepcopy(model), tmp_path / "pt", "t")
    trainer_run(model, tmp_path / "ort", "tttt", extra={"batch": {"gradient_accumulation_steps": 2}})
    assert sorted(os.listdir(tmp_path / "ort")) == [f"step_{s}" for s in range(4)]
    assert all(order(tmp_path / "ort", s) == SAMPLE_ORDER for s in range(4))
    # The first micro-step is a plain forward + backward from the initial weights.
    for name in SAMPLE_ORDER:
        a, b = (parse_statistics((tmp_path / d / "step_0" / name).read_text()) for d in ("pt", "ort"))
        assert b["mean"] == pytest.approx(a["mean"], rel=1e-4, abs=1e-6)


def test_mixed_precision_dumps_float16_activations_and_scaled_gradients(tmp_path, builder):
    model = make_model()
    pytorch_run(copy.deepcopy(model), tmp_path / "pt", "t")
    trainer_run(model, tmp_path / "ort", "te", extra={"mixed_precision": {"enabled": True}})
    assert order(tmp_path / "ort", 0) == SAMPLE_ORDER
    assert order(tmp_path / "ort", 1) == [n for n in SAMPLE_ORDER if n.endswith("_forward")]
    pt, ort = (
        parse_statistics((tmp_path / d / "step_0" / "Linear_4_0th_output_forward").read_text()) for d in ("pt", "ort")
    )
    assert ort["dtype"] == "torch.float16" and ort["mean"] == pytest.approx(pt["mean"], abs=2e-3)
    gradient = parse_statistics((tmp_path / "ort" / "step_0" / "Linear_1_0th_output_backward").read_text())
    assert gradient["dtype"] == "torch.float16"  # of loss * loss_scale, as hooks see them under a GradScaler


# ------------------------------------------------------------------------------------------ without subscribers
def test_without_subscribers_the_graphs_and_steps_are_unchanged():
    trainer = trainer_run(make_model(), None, "te")  # inspect_activation is a no-op while nothing is subscribed
    # the eval graph eval_step ran (the torch builder's is exported on the first eval, not compiled with the rest)
    evaluated = trainer._training_session._evals.latest.graph.model
    compiled = trainer._built.compiled
    for model in (compiled.training.model, compiled.eval_model, evaluated, trainer._onnx_model):
        names = [n.name for n in model.graph.node] + [o.name for o in model.graph.output]
        assert not any(name.startswith(("orttrainer/activation", "orttrainer/statistics")) for name in names)
    assert [o.name for o in evaluated.graph.output] == ["loss", "out"]
    assert not trainer._activations.instrumented and trainer._activations.begin_step("train") == []


def test_subscribing_after_compilation_counts_steps_but_warns(tmp_path):
    model = make_model()
    trainer = trainer_run(model, None, "t")
    subscribe(model, tmp_path / "late")
    x, target = batches(1)[0]
    with pytest.warns(UserWarning, match="subscribed after ORTTrainer compiled its graph"):
        trainer.train_step(x, target)
    trainer.eval_step(x, target)
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 2
    assert not (tmp_path / "late").exists()


def test_resubscribing_restarts_the_step_counter_in_the_new_directory(tmp_path, builder):
    model = make_model()
    trainer = trainer_run(model, tmp_path / "a", "tt")
    subscribe(model, tmp_path / "b", end_step=1)
    for x, target in batches(2):
        trainer.train_step(x, target)
    assert sorted(os.listdir(tmp_path / "a")) == ["step_0", "step_1"]
    assert sorted(os.listdir(tmp_path / "b")) == ["step_0"] and order(tmp_path / "b", 0) == SAMPLE_ORDER
    GlobalSubscriberManager.unsubscribe()
    assert trainer._activations.begin_step("train") == []  # unsubscribed: nothing fetched, nothing counted


def test_only_statistics_subscribers_are_collected(tmp_path, builder):
    class Counting(SubscriberBase):
        def __init__(self):
            super().__init__(None, None)
            self.calls = 0

        def post_forward_tensor_apply_impl(self, run_ctx, module, tensor_index, tensor):
            self.calls += 1
            return tensor

    model, counting = make_model(), Counting()
    GlobalSubscriberManager.subscribe(model, [counting, StatisticsSubscriber(tmp_path / "o")])
    with pytest.warns(UserWarning, match=r"subscribers \['Counting'\] of DebugMLP do not run in ORTTrainer"):
        trainer_run(model, None, "t")
    assert counting.calls == 0 and order(tmp_path / "o", 0) == SAMPLE_ORDER


def test_a_private_manager_and_the_global_one_keep_their_own_steps(tmp_path, builder):
    model = make_model()
    private = SubscriberManager()
    private.subscribe(model, [StatisticsSubscriber(tmp_path / "private", start_step=1)])
    try:
        assert managers_of(model) == [private]
        trainer = trainer_run(model, tmp_path / "global", "tt")
        assert set(managers_of(model)) == {private, GlobalSubscriberManager}
        assert private.get_run_context().global_states.execution_step == 2
        assert sorted(os.listdir(tmp_path / "private")) == ["step_1"]
        assert tree(tmp_path / "private") == [p for p in tree(tmp_path / "global") if p.startswith("step_1")]
        assert trainer._activations.instrumented
    finally:
        private.unsubscribe()


def test_fused_log_probabilities_have_no_backward_file(tmp_path, builder):
    """The 'ort' builder fuses log_softmax + NLL into one loss op, whose input gradient no graph holds."""

    class LogSoftmaxNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, x):
            return nn.functional.log_softmax(self.fc(x), dim=1)

    model = LogSoftmaxNet()
    subscribe(model, tmp_path / "o")
    desc = {"inputs": [("x", ["batch", 3]), ("target", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(
        model,
        desc,
        optim.SGDConfig(lr=0.1),
        loss_fn=nn.functional.nll_loss,
        options=ORTTrainerOptions({"device": {"id": "cpu"}, "_internal_use": {"gradient_builder": builder}}),
    )
    batch = torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 0])
    expected = ["Linear_1_0th_output_forward", "LogSoftmaxNet_0_0th_output_forward", "Linear_1_0th_output_backward"]
    if builder == "torch":  # PyTorch's autograd keeps log_softmax and NLL apart: the backward file is written
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            loss = trainer.train_step(*batch)
        expected.insert(2, "LogSoftmaxNet_0_0th_output_backward")
    else:
        unreachable = r"cannot collect statistics for \['LogSoftmaxNet_0_0th_output_backward'\]"
        with pytest.warns(UserWarning, match=unreachable):
            loss = trainer.train_step(*batch)
    assert math.isfinite(float(loss))
    assert order(tmp_path / "o", 0) == expected


def test_no_warning_for_a_plain_subscribed_run(tmp_path, builder):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the exporter's TracerWarnings are not ours
        trainer_run(make_model(), tmp_path / "o", "te")


def test_auto_writes_the_statistics_on_every_runtime(tmp_path):
    """'auto' keeps its choice with subscribers ('ort' with onnxruntime-training, 'torch' on the maintained
    onnxruntime), and either writes PyTorch's files."""
    model = make_model()
    pytorch_run(copy.deepcopy(model), tmp_path / "pt")
    GlobalSubscriberManager.unsubscribe()
    trainer = trainer_run(model, tmp_path / "auto")
    assert trainer.gradient_builder == ("ort" if has_training_build() else "torch")
    assert_same_dumps(tmp_path / "pt", tmp_path / "auto")


def test_a_torch_builder_trace_after_subscribing_writes_nothing(tmp_path):
    """Subscribed after compilation (steps counted, no statistics): tracing the graph for a new batch size runs the
    model's hooks on placeholder tensors, which must neither dump nor count."""
    model = make_model()
    trainer = make_trainer(model, {"_internal_use": {"gradient_builder": "torch"}})
    trainer.train_step(*batches(1)[0])
    subscribe(model, tmp_path / "late")
    x, target = batches(1)[0]
    with pytest.warns(UserWarning, match="subscribed after ORTTrainer compiled its graph"):
        trainer.train_step(x[:1], target[:1])  # batch 1 is outside the dynamic-shape graph's guards: traced now
    assert trainer._training_session.training_graph_count == 2 and tree(tmp_path / "late") == []
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 1
