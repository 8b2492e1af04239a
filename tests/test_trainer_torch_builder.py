"""The `torch` gradient builder inside ORTTrainer: custom autograd Functions train with their own backward, 'auto'
picks the builder, one graph per input-shape signature on shared state, checkpoints, dropout and eval."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import (
    clone,
    export_training_onnx,
    make_trainer,
    max_difference,
    needs_training_build,
    steps_like_pytorch,
    torch_weights,
    trainer_weights,
)
from models import MLP, CheckedInputs, ScalarAndTupleFunction, StraightThrough, mlp_desc
from torch import nn
from torch.nn import functional as F

from orttrainer import optim
from orttrainer.trainer.gradient.errors import GradientBuildError
from orttrainer.trainer.gradient.torch_builder import UntraceableFunctionError
from orttrainer.trainer.runtime import ort_private

CE = F.cross_entropy
TORCH = {"_internal_use": {"gradient_builder": "torch"}}
NO_CLIP = {"utils": {"grad_norm_clip": False}}  # Adam and LAMB clip by default; the torch references do not


def train_with_reference(model, desc, config, reference_optimizer, loss_fn, batches, extra=None, accumulation=1):
    """Train an ORTTrainer and `model`'s copy in plain PyTorch on the same batches; returns (trainer, reference)."""
    reference = clone(model)
    trainer = make_trainer(model, desc, config, loss_fn, extra)
    for x, y in batches:
        trainer.train_step(x, y)
    return trainer, train_pytorch(reference, reference_optimizer, loss_fn, batches, accumulation)


def train_pytorch(model, make_optimizer, loss_fn, batches, accumulation=1):
    """Plain PyTorch: the mean of `accumulation` micro-batch gradients per update."""
    optimizer = make_optimizer(model.parameters())
    for i, (x, y) in enumerate(batches):
        (loss_fn(model(x), y) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model


def batches(n: int, sizes=(8,), d_in: int = 32, classes: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(sizes[i % len(sizes)], d_in, generator=g),
            torch.randint(0, classes, (sizes[i % len(sizes)],), generator=g),
        )
        for i in range(n)
    ]


# custom autograd.Functions ------------------------------------------------------------------------------------------


class WithActivation(MLP):
    def __init__(self, activation) -> None:
        super().__init__()
        self.activation = activation

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x)))


@pytest.mark.parametrize(
    "config, reference",
    [
        (optim.SGDConfig(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
        (optim.AdamConfig(lr=1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2)),
    ],
    ids=["sgd", "adam"],
)
def test_scalar_and_tuple_function_trains_like_pytorch(config, reference, caplog):
    torch.manual_seed(0)
    model = WithActivation(lambda h: ScalarAndTupleFunction.apply(h, 2, (1.5, True), 0.5))
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, ref = train_with_reference(model, mlp_desc(), config, reference, CE, batches(10), NO_CLIP)
    assert trainer.gradient_builder == "torch"  # chosen by 'auto' (the default)
    assert (
        "gradient builder 'torch' (auto: the model uses custom torch.autograd.Function(s) "
        "['ScalarAndTupleFunction']" in caplog.text
    )
    assert max_difference(trainer_weights(trainer), torch_weights(ref)) < 1e-5


def test_straight_through_estimator_trains_with_the_users_backward():
    torch.manual_seed(0)
    model = WithActivation(StraightThrough.apply)
    plain_round = clone(model)
    plain_round.activation = torch.round  # the derivative of the forward: 0, so fc1 would never move
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    data = [(x * 3, y) for x, y in batches(10)]
    trainer, with_backward = train_with_reference(model, mlp_desc(), optim.SGDConfig(lr=0.1), sgd, CE, data)
    derivative_of_forward = torch_weights(train_pytorch(plain_round, sgd, CE, data))
    got = trainer_weights(trainer)
    assert trainer.gradient_builder == "torch"
    assert max_difference(got, torch_weights(with_backward)) < 1e-5
    assert np.abs(got["fc1.weight"] - derivative_of_forward["fc1.weight"]).max() > 1e-2
    assert np.abs(got["fc2.weight"] - derivative_of_forward["fc2.weight"]).max() > 1e-3


def test_a_function_whose_backward_cannot_be_traced_is_named():
    class BranchBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2 if grad.sum() > 0 else grad  # a Python branch on a tensor's value

    trainer = make_trainer(WithActivation(BranchBackward.apply), mlp_desc(), optim.SGDConfig(), CE)
    with pytest.raises(
        UntraceableFunctionError,
        match="The backward of the custom torch.autograd.Function '.*BranchBackward' cannot be traced",
    ):
        trainer.train_step(*batches(1)[0])


class BrokenWhenCompiling(nn.Module):
    """Takes a path that fails under torch.compile's flags, as transformers' LongT5 does without an attention_mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)
        self.norm = nn.BatchNorm1d(10)

    def forward(self, x):
        h = self.norm(self.fc(x))
        if torch.compiler.is_compiling():
            h = h + torch.ones(3)  # shapes that do not broadcast
        return h


def test_a_model_that_fails_eagerly_under_torch_compile_s_flags_is_told_so_and_left_as_it_was():
    model = BrokenWhenCompiling()
    trainer = make_trainer(model, mlp_desc(), optim.SGDConfig(), CE, TORCH)
    with pytest.raises(
        GradientBuildError, match=r"BrokenWhenCompiling raises RuntimeError in eager PyTorch too when torch.compiler"
    ) as raised:
        trainer.train_step(*batches(1)[0])
    assert "attention_mask" in str(raised.value)
    # the eager run that found it left the BatchNorm's statistics as they were
    assert model.norm.running_mean.eq(0).all() and model.norm.num_batches_tracked.item() == 0


class CheckedLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = CheckedInputs(d_in=32, classes=10)

    def forward(self, x, labels):
        return CE(self.model(x, labels), labels)


def test_asserts_on_input_values_train_and_evaluate_like_pytorch(caplog):
    """transformers' XLM, FlauBERT and ProphetNet check their inputs with Python asserts on values: the trace assumes
    they hold (the first batch's dry run checks them eagerly), and the graphs stay on the direct translation."""
    model, data = CheckedLoss(), batches(3)
    reference = clone(model)
    desc = {"inputs": [("x", ["batch", 32]), ("labels", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.1), None, TORCH)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        for x, y in data:
            trainer.train_step(x, y)
            sgd.zero_grad()
            reference(x, y).backward()
            sgd.step()
        loss = trainer.eval_step(*data[0])
    assert (
        max_difference(trainer_weights(trainer), {f"model.{k}": v for k, v in torch_weights(reference.model).items()})
        < 1e-6
    )
    torch.testing.assert_close(torch.as_tensor(loss), reference(*data[0]).detach(), rtol=1e-5, atol=1e-6)
    assert "torch.onnx" not in caplog.text and "is exported" not in caplog.text


class Heteroscedastic(nn.Module):
    """Regression with a predicted variance through torch.nn's Gaussian NLL loss, which checks `if torch.any(var <
    0): raise ValueError(...)`: a check on an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.mean, self.log_var = nn.Linear(6, 16), nn.Linear(16, 2), nn.Linear(16, 2)

    def forward(self, x, target):
        hidden = torch.tanh(self.body(x))
        return F.gaussian_nll_loss(self.mean(hidden), target, self.log_var(hidden).exp())


REGRESSION = {"inputs": [("x", ["batch", 6]), ("target", ["batch", 2])], "outputs": [("loss", [], True)]}


def regression_batches(n: int, rows: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 2, generator=g)) for _ in range(n)]


def test_a_check_on_activations_that_raises_trains_and_evaluates_like_pytorch(caplog):
    """A check that reads activations is assumed to pass, as an assert is: one graph on the direct translation
    serves every batch."""
    torch.manual_seed(0)
    model, data = Heteroscedastic(), regression_batches(3)
    reference = clone(model)
    trainer = make_trainer(model, REGRESSION, optim.SGDConfig(lr=0.1), None, TORCH)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        steps_like_pytorch(trainer, reference, sgd, data)
        held_out = regression_batches(1, rows=5, seed=2)[0]
        evaluated = trainer.eval_step(*held_out)
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-6
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(evaluated), reference.eval()(*held_out))
    assert "branches on tensor values" not in caplog.text  # one trace, without values: the check is assumed
    assert "torch.onnx" not in caplog.text and "is exported" not in caplog.text
    assert trainer._training_session.training_graph_count == 1


class ChecksActivations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        logits = self.fc(x)
        if (logits.abs() > 1e3).any():
            raise ValueError("the logits blew up")
        return logits


def test_a_check_on_activations_that_fails_on_the_first_batch_raises_the_models_error():
    """The dry run runs the first batch eagerly: a check that fails there raises the model's own error."""
    trainer = make_trainer(ChecksActivations(), mlp_desc(), optim.SGDConfig(), CE, TORCH)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="the logits blew up"):
        trainer.train_step(x * 1e6, y)
    trainer.train_step(x, y)  # a batch that passes the check trains


class ChecksLabels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x, labels):
        if labels.max() >= 10:  # as transformers' CTC heads check `labels.max() >= vocab_size`
            raise ValueError("a label out of range")
        return CE(self.fc(x), labels)


def test_a_check_on_the_batch_is_assumed_and_a_later_batch_that_fails_it_changes_nothing():
    """A check on the batch is assumed to pass, as an assert is: the first batch's dry run checks it, later
    batches are not checked by it. A later label out of range is refused by the graph's own guard of class labels
    (graph/class_labels.py), which names it; the step changes nothing, and the next good batch trains like
    PyTorch."""
    model = ChecksLabels()
    reference = clone(model)
    desc = {"inputs": [("x", ["batch", 32]), ("labels", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.1), None, TORCH)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    (x, y), (x2, y2) = batches(2)
    bad = y2.clone()
    bad[0] = 12
    with pytest.raises(ValueError, match="a label out of range"):  # the first batch: the dry run, eagerly
        trainer.train_step(x2, bad)
    for inputs in ((x, y), (x2, bad), (x2, y2)):
        if inputs[1] is bad:
            before = trainer_weights(trainer)
            with pytest.raises(Exception, match="a class label outside"):
                trainer.train_step(*inputs)
            assert max_difference(trainer_weights(trainer), before) == 0
            continue
        trainer.train_step(*inputs)
        sgd.zero_grad()
        reference(*inputs).backward()
        sgd.step()
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-6
    with torch.no_grad():
        torch.testing.assert_close(torch.as_tensor(trainer.eval_step(x, y)), reference(x, y))


class CachedBias(nn.Module):
    """In eval mode, caches a tensor computed from a parameter in a plain dict, as transformers' LeViT caches its
    attention biases (`self.attention_bias_cache[device]`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)
        self.bias_table = nn.Parameter(torch.randn(4, 10))
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x):
        if self.training:
            bias = self.bias_table.sum(0)
        else:
            if "cpu" not in self.cache:
                self.cache["cpu"] = self.bias_table.sum(0)
            bias = self.cache["cpu"]
        return self.fc(x) + bias

    def train(self, mode: bool = True):
        if mode and self.cache:  # the cache holds the parameter's value: gone when it may change
            self.cache = {}
        return super().train(mode)


def test_a_tensor_a_forward_caches_in_a_dict_is_computed_in_the_eval_graph(caplog):
    data = batches(3)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, reference = train_with_reference(
            CachedBias(), mlp_desc(), optim.SGDConfig(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1), CE, data, TORCH
        )
        loss, logits = trainer.eval_step(*data[0])
    assert "is exported" not in caplog.text  # the eval graph was traced, the tensor computed in it
    reference.eval()
    with torch.no_grad():
        expected = reference(data[0][0])
    torch.testing.assert_close(torch.as_tensor(logits), expected)
    torch.testing.assert_close(torch.as_tensor(loss), CE(expected, data[0][1]))


class PaddingBranch(nn.Module):
    """Branches on its input's values as transformers' FSMT does (`if not padding_mask.any(): padding_mask = None`)
    and Longformer (`if is_global_attn:`): a mask is applied only when some token is padding."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, ids, labels):
        hidden = self.fc(self.embedding(ids))
        padding = ids.eq(0)
        if padding.any():
            hidden = hidden.masked_fill(padding.unsqueeze(-1), 0.0) * 2
        return CE(hidden.mean(1), labels)


TOKENS = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch"])], "outputs": [("loss", [], True)]}


def padded_batches():
    """Batches of one shape whose values take either way of `PaddingBranch`'s branch, in turn."""
    labels = torch.tensor([1, 2])
    return [
        (torch.tensor([[1, 2, 0], [3, 4, 5]]), labels),  # padding
        (torch.tensor([[1, 2, 3], [3, 4, 5]]), labels),  # none: another graph
        (torch.tensor([[0, 2, 3], [3, 4, 5]]), labels),  # padding again: the first graph
        (torch.tensor([[7, 2, 3], [3, 4, 9]]), labels),
    ]


def test_a_branch_on_input_values_trains_and_evaluates_like_pytorch_either_way(caplog):
    torch.manual_seed(0)
    model, data = PaddingBranch(), padded_batches()
    reference = clone(model)
    trainer = make_trainer(model, TOKENS, optim.SGDConfig(lr=0.5), None, TORCH)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        steps_like_pytorch(trainer, reference, sgd, data)
        assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-6
        reference.eval()
        for ids, labels in data:
            with torch.no_grad():
                torch.testing.assert_close(torch.as_tensor(trainer.eval_step(ids, labels)), reference(ids, labels))
    assert "branches on tensor values at" in caplog.text and "`if padding.any():`" in caplog.text
    assert caplog.text.count("a batch whose values branch another way") == 1  # two graphs for four batches
    assert "torch.onnx" not in caplog.text and "is exported" not in caplog.text
    assert trainer._training_session.training_graph_count == 2


def test_a_model_that_branches_on_values_is_not_stored_in_the_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTTRAINER_COMPILE_CACHE", str(tmp_path))
    trainer = make_trainer(PaddingBranch(), TOKENS, optim.SGDConfig(lr=0.5), None, TORCH)
    for ids, labels in padded_batches()[:2]:
        trainer.train_step(ids, labels)
    trainer.eval_step(*padded_batches()[0])
    # a later process traces again; ONNX Runtime's optimised graphs (keyed by the graph's bytes) may be kept
    stored = [p for p in tmp_path.rglob("*") if p.is_file() and "onnxruntime" not in p.relative_to(tmp_path).parts]
    assert stored == []


class ParameterBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        if self.fc.bias.sum() > 0:  # on a parameter: a graph cannot be chosen by the batch
            return self.fc(x)
        return self.fc(x) * 2


def test_a_branch_on_a_parameters_value_is_refused_naming_the_line():
    trainer = make_trainer(ParameterBranch(), mlp_desc(), optim.SGDConfig(), CE, TORCH)
    refusal = r"(?s)`if self.fc.bias.sum\(\) > 0:.*reads the model's state \(fc.bias\)"
    with pytest.raises(GradientBuildError, match=refusal):
        trainer.train_step(*batches(1)[0])


class TaskHeads(nn.Module):
    """Indexes by 0-dim tensors: its head by a task id that is a model input, and its features by the top-k
    positions of its own activations, one at a time (transformers' Autoformer picks its delays so)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.heads = nn.Parameter(torch.randn(4, 3, 3))

    def forward(self, x, task, labels):
        h = self.body(x)
        top = torch.topk(h.mean(0), 3).indices
        picked = torch.stack([h[:, top[k]] for k in range(3)], dim=-1)
        return CE(picked @ self.heads[task], labels)


def test_indexing_by_a_scalar_tensor_trains_and_evaluates_like_pytorch_in_one_graph(caplog):
    """PyTorch indexes by a 0-dim tensor's value; the trace selects by the tensor (docs/engine.md §43): one graph
    for every task id (negative ones too) and every top-k, which depends on the weights."""
    torch.manual_seed(0)
    model = TaskHeads()
    reference = clone(model)
    desc = {"inputs": [("x", ["batch", 6]), ("task", []), ("labels", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.5), None, TORCH)
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(5, 6, generator=g), torch.tensor(task), torch.randint(0, 3, (5,), generator=g))
        for task in (1, 3, -1, 0, 2)
    ]
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        steps_like_pytorch(trainer, reference, torch.optim.SGD(reference.parameters(), lr=0.5), data)
        assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-6
        reference.eval()
        for batch in data:
            with torch.no_grad():
                torch.testing.assert_close(torch.as_tensor(trainer.eval_step(*batch)), reference(*batch))
    assert "branches on tensor values" not in caplog.text and "torch.onnx" not in caplog.text
    assert trainer._training_session.training_graph_count == 1


class RelabelsInPlace(nn.Module):
    """Writes into its input in place, as transformers' FSMT rewrites the labels' -100 to its padding id."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x, labels):
        labels.masked_fill_(labels == -100, 0)
        return CE(self.fc(x), labels)


def test_a_forward_that_writes_into_its_input_trains_like_pytorch():
    data = [(x, torch.where(torch.arange(len(y)) % 3 == 0, -100, y)) for x, y in batches(3)]
    model = RelabelsInPlace()
    reference = clone(model)
    desc = {"inputs": [("x", ["batch", 32]), ("labels", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.1), None, TORCH)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        trainer.train_step(x, y.clone())
        sgd.zero_grad()
        reference(x, y.clone()).backward()
        sgd.step()
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-6


class IgnoredBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, b):
        return x + b

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # `b` gets no gradient


class WithIgnoredBias(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(64))

    def forward(self, x):
        return self.fc2(F.gelu(IgnoredBias.apply(self.fc1(x), self.b)))


def test_a_parameter_the_users_backward_gives_no_gradient_is_frozen_as_in_pytorch():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"parameters \['b'\] do not influence the loss"):
        trainer, ref = train_with_reference(
            WithIgnoredBias(),
            mlp_desc(),
            optim.AdamConfig(lr=1e-2),
            lambda ps: torch.optim.Adam(ps, lr=1e-2),
            CE,
            batches(3),
            NO_CLIP,
        )
    assert "b" in trainer._built.compiled.frozen and "b" not in trainer._built.compiled.training.weight_updates
    assert max_difference(trainer_weights(trainer), {k: v for k, v in torch_weights(ref).items() if k != "b"}) < 1e-5


# choosing the builder ---------------------------------------------------------------------------------------------


class CumulativeHead(MLP):
    def forward(self, x):
        return torch.cumsum(super().forward(x), dim=1)


@needs_training_build
def test_auto_picks_ort_for_a_plain_model(caplog):
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE)
        trainer.train_step(*batches(1)[0])
    assert trainer.gradient_builder == "ort"
    assert (
        "gradient builder 'ort' (auto: no custom torch.autograd.Function, and ONNX Runtime differentiates "
        "every op)" in caplog.text
    )


def _trained_by_torch_after_auto(model, caplog, desc=None, data=None) -> str:
    """Trains `model` with 'auto' beside torch.optim.SGD; asserts the torch builder built it and the weights agree.
    Returns the log ('auto' names its reason there)."""
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, ref = train_with_reference(
            model,
            desc or mlp_desc(),
            optim.SGDConfig(lr=0.1),
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            CE,
            data or batches(3),
        )
    assert trainer.gradient_builder == "torch"
    assert max_difference(trainer_weights(trainer), torch_weights(ref)) < 1e-5
    return caplog.text


@needs_training_build
def test_auto_falls_back_to_torch_for_an_op_without_an_ort_gradient(caplog):
    log = _trained_by_torch_after_auto(CumulativeHead(), caplog)
    assert "gradient builder 'torch' (auto: ONNX Runtime's gradient builder cannot differentiate op 'CumSum')" in log


class SizeKeepingHead(CumulativeHead):
    """Keeps the batch's width in a plain attribute, as transformers' Funnel keeps `self.seq_len`: the TorchScript
    tracer hands the forward that size as a tensor."""

    def forward(self, x):
        self.width = x.size(1)
        return super().forward(x)


@needs_training_build
def test_auto_falls_back_to_torch_with_the_attributes_the_export_set_put_back(caplog):
    """The 'ort' route fails (CumSum) after its export ran the forward, which stored a traced size in a plain
    attribute; the torch builder then met a tensor attribute (made a buffer) that the forward sets to an int, and
    'auto' failed with "cannot assign 'int' as buffer 'width'"."""
    _trained_by_torch_after_auto(SizeKeepingHead(), caplog)


class SpectrumBranch(MLP):
    """Fails both builders: the TorchScript exporter has no `fft_rfft`, and the forward branches on a parameter's
    value."""

    def forward(self, x):
        if self.fc1.bias.sum() > 0:
            x = x * 2
        return super().forward(torch.fft.rfft(x, n=62).abs())  # 32 frequencies


@needs_training_build
def test_auto_names_the_models_line_when_neither_builder_trains_it():
    """The torch builder ran inside the handler of the 'ort' route's failure, so its errors chained to the
    exporter's: the error named a line of torch.onnx's TorchScript exporter instead of the model's branch."""
    from orttrainer.trainer.build.forward import NoBuilderTrainsError

    trainer = make_trainer(SpectrumBranch(), mlp_desc(), optim.SGDConfig(), CE)
    with pytest.raises(
        NoBuilderTrainsError, match=r"test_trainer_torch_builder.py:\d+ \(`if self.fc1.bias.sum\(\) > 0:`\)"
    ):
        trainer.train_step(*batches(1)[0])


class AveragePooled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Linear(4 * 3 * 3, 10)

    def forward(self, x):
        return self.head(torch.nn.functional.avg_pool2d(self.conv(x), 2).flatten(1))


@needs_training_build
def test_average_pooling_is_refused_by_the_ort_builder_and_auto_trains_it_with_torch(caplog):
    """ONNX Runtime's AveragePoolGrad sized its result from the graph's symbolic batch: the first step died of a
    floating-point exception. The 'ort' builder refuses it with a reason; 'auto' lets PyTorch differentiate."""
    images = [(torch.randn(4, 3, 7, 7), torch.randint(0, 10, (4,))) for _ in range(3)]
    desc = {"inputs": [("x", ["batch", 3, 7, 7]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    refused = make_trainer(AveragePooled(), desc, optim.SGDConfig(), CE, {"_internal_use": {"gradient_builder": "ort"}})
    with pytest.raises(RuntimeError, match=r"AveragePool gradient kernel cannot train this model.*'torch'"):
        refused.train_step(*images[0])
    _trained_by_torch_after_auto(AveragePooled(), caplog, desc, images)


class RepeatedIndexAdd(MLP):
    """Adds rows into repeated places, as a routed mixture of experts adds each token's experts into its row
    (transformers' JetMoE): `index_add` with index [0, 0, 1, 1, ...]."""

    def forward(self, x):
        scores = super().forward(x)
        index = torch.arange(scores.shape[0]) // 2
        return scores + torch.zeros_like(scores).index_add(0, index, scores)


@needs_training_build
def test_auto_trains_an_index_add_with_repeated_indices_with_the_torch_builder(caplog):
    """The TorchScript exporter writes index_add as a ScatterElements that overwrites (and warns that the model
    will be incorrect): the 'ort' builder's loss differed from PyTorch's already in the forward."""
    assert "adds them all" in _trained_by_torch_after_auto(RepeatedIndexAdd(), caplog)
    explicit = make_trainer(
        RepeatedIndexAdd(), mlp_desc(), optim.SGDConfig(), CE, {"_internal_use": {"gradient_builder": "ort"}}
    )
    with pytest.warns(UserWarning, match=r"adds them all: the 'ort' gradient builder .*gradient_builder='torch'"):
        explicit.train_step(*batches(1)[0])


@needs_training_build
def test_the_ort_route_warns_of_a_branch_on_values_naming_the_line_and_the_torch_builder():
    """The TorchScript export records the way the first batch takes a branch on a value for every batch: the 'ort'
    builder's graph gives the second batch the first one's branch. The dry run saw the branch; the warning says
    where, and which builder traces each way."""
    warning = r"(?s)truth value of a tensor at .*`if padding.any\(\):`.*gradient_builder='torch'"
    for builder in ("auto", "ort"):
        trainer = make_trainer(
            PaddingBranch(), TOKENS, optim.SGDConfig(), None, {"_internal_use": {"gradient_builder": builder}}
        )
        with pytest.warns(UserWarning, match=warning):
            trainer.train_step(*padded_batches()[0])
        assert trainer.gradient_builder == "ort"


@needs_training_build
def test_the_ort_route_does_not_warn_of_an_assert_on_a_value():
    """An assert records the way every valid batch takes (the dry run checks the first): no warning."""
    trainer = make_trainer(CheckedLoss(), mlp_desc_with_labels(), optim.SGDConfig(), None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*truth value of a tensor")
        trainer.train_step(*batches(1)[0])
    assert trainer.gradient_builder == "ort"


@needs_training_build
def test_the_ort_route_does_not_warn_of_a_check_that_raises():
    """A check (`if ...: raise`) records the way every batch that trains takes: no warning."""
    trainer = make_trainer(ChecksActivations(), mlp_desc(), optim.SGDConfig(), CE)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*truth value of a tensor")
        trainer.train_step(*batches(1)[0])
    assert trainer.gradient_builder == "ort"


def mlp_desc_with_labels() -> dict:
    return {"inputs": [("x", ["batch", 32]), ("labels", ["batch"])], "outputs": [("loss", [], True)]}


def _onnx_mlp_with_loss() -> onnx.ModelProto:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP()

        def forward(self, x, target):
            return CE(self.mlp(x), target)

    axes = {"x": {0: "batch"}, "target": {0: "batch"}}
    return export_training_onnx(WithLoss(), batches(1)[0], ["x", "target"], ["loss"], axes)


def test_onnx_models_use_the_ort_builder_and_torch_on_request():
    """(tests/test_onnx_model_torch_builder.py trains ONNX models with the torch builder.)"""
    desc = {"inputs": [("x", ["batch", 32]), ("target", ["batch"])], "outputs": [("loss", [], True)]}
    model = _onnx_mlp_with_loss()
    on_torch = make_trainer(model, desc, optim.SGDConfig(), extra=TORCH)
    on_torch.train_step(*batches(1)[0])
    assert on_torch.gradient_builder == "torch"
    auto = make_trainer(model, desc, optim.SGDConfig())
    auto.train_step(*batches(1)[0])
    assert auto.gradient_builder == ("ort" if ort_private.has_training_build() else "torch")


def test_extra_postprocess_no_longer_needs_the_ort_builder_but_refuses_custom_functions():
    seen = []

    def postprocess(model):
        seen.append([n.op_type for n in model.graph.node])
        return model

    extra = {"_internal_use": {"extra_postprocess": postprocess}}
    trainer = make_trainer(CumulativeHead(), mlp_desc(), optim.SGDConfig(), CE, extra)
    trainer.train_step(*batches(1)[0])  # 'auto': ONNX Runtime cannot differentiate CumSum, the torch builder can
    assert trainer.gradient_builder == "torch" and "CumSum" in seen[-1]
    trainer = make_trainer(
        WithActivation(StraightThrough.apply),
        mlp_desc(),
        optim.SGDConfig(),
        CE,
        {"_internal_use": {"extra_postprocess": postprocess, "gradient_builder": "auto"}},
    )
    with pytest.raises(NotImplementedError, match=r"extra_postprocess edits .* \['StraightThrough'\]"):
        trainer.train_step(*batches(1)[0])


# shapes: one graph per signature, one shared state ------------------------------------------------------------------


class GroupMean(nn.Module):
    """A view sized by the batch and a mean: both bake the batch size into a traced graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 20)

    def forward(self, x):
        h = self.fc(x)
        return h.view(h.shape[0], 2, 10).mean(dim=1)


def test_interleaved_batch_sizes_share_one_state_and_match_pytorch():
    torch.manual_seed(0)
    data = batches(8, sizes=(4, 4, 7, 7, 4, 7, 7, 4))  # with accumulation 2, windows mix the two sizes
    trainer, ref = train_with_reference(
        GroupMean(),
        mlp_desc(),
        optim.AdamConfig(lr=1e-2),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        CE,
        data,
        {**TORCH, **NO_CLIP, "batch": {"gradient_accumulation_steps": 2}},
        accumulation=2,
    )
    # the first batch's shapes, then (model_desc names the batch dim) one graph traced with it dynamic
    assert trainer._training_session.training_graph_count == 2
    assert max_difference(trainer_weights(trainer), torch_weights(ref)) < 1e-5
    loss, logits = trainer.eval_step(*batches(1, sizes=(5,))[0])  # eval has dynamic axes: no new graph
    assert logits.shape == (5, 10) and trainer._training_session.training_graph_count == 2


class CopyIntoContiguous(nn.Module):
    """An in-place copy of a transposed tensor into a contiguous one, then a view of it (transformers' DeBERTa)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 20)

    def forward(self, x):
        h = self.fc(x).view(x.shape[0], 10, 2).transpose(1, 2)
        out = torch.zeros(x.shape[0], 2, 10)
        out.copy_(h)
        return out.view(x.shape[0], 20)[:, :10]


class WithBFloat16Buffer(nn.Module):
    """A bfloat16 buffer that the forward casts to the activations' type (transformers' RecurrentGemma keeps its
    embedding scale so); not in the state_dict, so the graph holds it as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 10)
        self.register_buffer("scale", torch.tensor(1.5078125, dtype=torch.bfloat16), persistent=False)

    def forward(self, x):
        return self.fc(x) * self.scale.type(x.dtype)


@pytest.mark.parametrize("model_class", [CopyIntoContiguous, WithBFloat16Buffer])
def test_an_in_place_copy_and_bfloat16_state_train_like_pytorch(model_class):
    """A view of a tensor written in place from a transposed source (the copy must keep the destination's layout),
    and a bfloat16 constant (numpy has no bfloat16)."""
    torch.manual_seed(0)
    trainer, ref = train_with_reference(
        model_class(),
        mlp_desc(),
        optim.SGDConfig(lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        CE,
        batches(3),
        TORCH,
    )
    assert max_difference(trainer_weights(trainer), torch_weights(ref)) < 1e-6


class ComplexRotary(nn.Module):
    """Rotary position embeddings written with complex numbers, as LLaMA's reference code and transformers' Llama 4
    and DeepSeek-V2 write them: a table of unit complex numbers kept as a plain attribute (a constant of the graph),
    and one computed in forward from learned frequencies (`torch.polar`, whose gradient reaches them)."""

    def __init__(self, table_as_buffer: bool = False, persistent: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 48)
        self.log_frequency = nn.Parameter(torch.linspace(-3.0, 0.0, 4))
        table = torch.polar(torch.ones(6, 4), torch.outer(torch.arange(6.0), torch.linspace(0.1, 1.0, 4)))
        if table_as_buffer:
            self.register_buffer("table", table, persistent=persistent)
        else:
            self.table = table
        self.head = nn.Linear(48, 10)

    def forward(self, x):
        projected = self.proj(x)  # in float16 under mixed precision: the rotation is in float32, as LLaMA's
        h = torch.view_as_complex(projected.float().view(x.shape[0], 6, 4, 2))
        angles = torch.outer(torch.arange(6.0), self.log_frequency.exp())
        rotated = h * torch.polar(torch.ones_like(angles), angles) * self.table
        return self.head(torch.view_as_real(rotated).flatten(1).type_as(projected))


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_complex_rotary_embeddings_train_evaluate_and_save_like_pytorch_on_the_direct_translation(
    mixed_precision, caplog, tmp_path
):
    torch.manual_seed(0)
    data = batches(3)
    options = {**TORCH, **NO_CLIP, "mixed_precision": {"enabled": mixed_precision}}
    tolerance = 1e-3 if mixed_precision else 1e-6  # of the weights: float16 products against PyTorch's float32
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, ref = train_with_reference(
            ComplexRotary(),
            mlp_desc(),
            optim.AdamConfig(lr=0.01),
            lambda ps: torch.optim.Adam(ps, lr=0.01),
            CE,
            data,
            options,
        )
        ref.eval()
        with torch.no_grad():
            _, logits = trainer.eval_step(*data[0])
            torch.testing.assert_close(torch.as_tensor(logits).float(), ref(data[0][0]), atol=tolerance * 10, rtol=0)
    assert max_difference(trainer_weights(trainer), torch_weights(ref)) < tolerance
    assert "torch.onnx" not in caplog.text and "is exported" not in caplog.text
    trainer.save_as_onnx(str(tmp_path / "model.onnx"))  # the eval graph, its complex values as pairs of reals
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = dict(zip([i.name for i in session.get_inputs()], [t.numpy() for t in data[0]], strict=True))
    np.testing.assert_allclose(session.run(None, feeds)[1], torch.as_tensor(logits).numpy(), atol=tolerance * 10)


def test_a_complex_non_persistent_buffer_is_a_constant_of_the_graph_and_trains_like_pytorch(caplog):
    """torchtitan keeps its rotary table as `register_buffer("freqs_cis", ..., persistent=False)`: no checkpoint
    holds it, so the graphs hold it as a constant, as they hold a plain tensor attribute."""
    torch.manual_seed(0)
    data = batches(3)
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer, ref = train_with_reference(
            ComplexRotary(table_as_buffer=True, persistent=False),
            mlp_desc(),
            optim.AdamConfig(lr=0.01),
            lambda ps: torch.optim.Adam(ps, lr=0.01),
            CE,
            data,
            {**TORCH, **NO_CLIP},
        )
        ref.eval()
        with torch.no_grad():
            _, logits = trainer.eval_step(*data[0])
    assert max_difference(trainer_weights(trainer), torch_weights(ref)) < 1e-6
    torch.testing.assert_close(torch.as_tensor(logits), ref(data[0][0]), atol=1e-5, rtol=0)
    assert "torch.onnx" not in caplog.text and "is exported" not in caplog.text
    assert "table" not in trainer.state_dict(pytorch_format=True)


class Spectrogram(nn.Module):
    """A learnable gain on the signal, its magnitude spectrogram (`torch.stft`) and a linear head: the backward of
    `torch.stft` (PyTorch's `unfold_backward`) indexes with int32, which torch.onnx writes into a ScatterND."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(64))
        self.head = nn.Linear(9 * 17, 10)

    def forward(self, x):
        window = torch.hann_window(16)
        spectrum = torch.stft(x * self.gain, n_fft=16, hop_length=4, window=window, return_complex=True)
        return self.head(torch.log1p(spectrum.abs()).flatten(1))


def test_a_spectrogram_model_trains_and_evaluates_like_pytorch():
    torch.manual_seed(0)
    data = batches(3, d_in=64)
    trainer, ref = train_with_reference(
        Spectrogram(), mlp_desc(64), optim.SGDConfig(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1), CE, data, TORCH
    )
    assert max_difference(trainer_weights(trainer), torch_weights(ref)) < 1e-5
    with torch.no_grad():
        _, logits = trainer.eval_step(*data[0])
        torch.testing.assert_close(torch.as_tensor(logits), ref(data[0][0]), atol=1e-5, rtol=0)


class RotatesItsTable(ComplexRotary):
    def __init__(self) -> None:
        super().__init__(table_as_buffer=True, persistent=False)

    def forward(self, x):
        self.table.mul_(torch.polar(torch.ones(()), torch.tensor(0.01)))  # the table turns a little each step
        return super().forward(x)


def test_a_forward_that_writes_into_a_complex_non_persistent_buffer_is_refused_naming_it():
    trainer = make_trainer(RotatesItsTable(), mlp_desc(), optim.SGDConfig(lr=0.1), CE, TORCH)
    with pytest.raises(GradientBuildError, match=r"writes into its complex buffer table in forward.*view_as_real"):
        trainer.train_step(*batches(1)[0])


class ComplexInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(torch.view_as_real(x).flatten(1))


def test_a_complex_buffer_or_input_is_refused_naming_it_and_what_to_do_instead():
    x, y = batches(1)[0]
    trainer = make_trainer(ComplexRotary(table_as_buffer=True), mlp_desc(), optim.SGDConfig(lr=0.1), CE, TORCH)
    with pytest.raises(GradientBuildError, match=r"complex tensors as state \(table\).*plain tensor attribute"):
        trainer.train_step(x, y)
    trainer = make_trainer(ComplexInput(), mlp_desc(), optim.SGDConfig(lr=0.1), CE, TORCH)
    with pytest.raises(GradientBuildError, match=r"complex inputs \(x\).*torch.view_as_real\(input\)"):
        trainer.train_step(x.to(torch.complex64), y)


class CTCHead(nn.Module):
    """A speech model's CTC head: per-frame log-probabilities, nn.CTCLoss over padded label sequences whose lengths,
    and the frames each sample has, vary with the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.ctc = nn.CTCLoss(zero_infinity=True)

    def forward(self, frames, frame_lengths, labels, label_lengths):
        log_probs = self.fc(frames).log_softmax(-1).transpose(0, 1)  # [T, B, C]
        return self.ctc(log_probs, labels, frame_lengths, label_lengths)


CTC_DESC = {
    "inputs": [
        ("frames", ["batch", 12, 8]),
        ("frame_lengths", ["batch"]),
        ("labels", ["batch", 4]),
        ("label_lengths", ["batch"]),
    ],
    "outputs": [("loss", [], True)],
}


def test_a_ctc_loss_trains_and_evaluates_like_pytorch_on_the_direct_translation(caplog):
    torch.manual_seed(0)
    model = CTCHead()
    reference = clone(model)
    trainer = make_trainer(model, CTC_DESC, optim.SGDConfig(lr=0.5), None, TORCH)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(3, 12, 8, generator=g),
            torch.tensor(lengths),
            torch.randint(1, 6, (3, 4), generator=g),
            torch.tensor(labels),
        )
        for lengths, labels in (([12, 9, 12], [4, 2, 0]), ([5, 12, 2], [4, 4, 3]), ([12, 12, 12], [1, 3, 4]))
    ]  # the second batch's last sample has no alignment (3 labels in 2 frames): zero_infinity
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        steps_like_pytorch(trainer, reference, sgd, data)
        # the recursion's float32 sums run in another order than PyTorch's kernel: weights of up to 2.5, 2e-6 apart
        assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5
        with torch.no_grad():
            torch.testing.assert_close(torch.as_tensor(trainer.eval_step(*data[0])), reference(*data[0]))
    assert "does not cover" not in caplog.text and "torch.onnx" not in caplog.text


class SelectsItsLabels(nn.Module):
    """A CTC head as transformers writes one (Wav2Vec2ForCTC and its kin): it checks its labels' values, pads them
    with -100, selects them with `labels.masked_select(labels >= 0)`, a size the values decide, and passes the
    concatenation to F.ctc_loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, frames, labels):
        if labels.max() >= 6:
            raise ValueError("Label values must be <= vocab_size: 6")
        log_probs = self.fc(frames).log_softmax(-1).transpose(0, 1)
        mask = labels >= 0
        frame_lengths = torch.full((frames.shape[0],), frames.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, labels.masked_select(mask), frame_lengths, mask.sum(-1), zero_infinity=True)


def test_labels_selected_in_a_size_the_values_decide_train_and_evaluate_like_pytorch(caplog):
    """One graph serves every count of labels (torch.onnx writes the selection as NonZero and GatherND); the
    label check is assumed, as an assert is."""
    torch.manual_seed(0)
    model = SelectsItsLabels()
    reference = clone(model)
    desc = {"inputs": [("frames", [3, 12, 8]), ("labels", [3, 4])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.5), None, TORCH)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    data = []
    for counts in ([4, 2, 1], [3, 3, 3], [1, 4, 2]):  # 7, 9 and 7 labels in all
        labels = torch.randint(1, 6, (3, 4), generator=g)
        data.append(
            (
                torch.randn(3, 12, 8, generator=g),
                torch.where(torch.arange(4) < torch.tensor(counts)[:, None], labels, -100),
            )
        )
    with caplog.at_level(logging.INFO, logger="orttrainer"):
        steps_like_pytorch(trainer, reference, sgd, data)
        assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5
        with torch.no_grad():
            for batch in data:
                torch.testing.assert_close(torch.as_tensor(trainer.eval_step(*batch)), reference(*batch))
    assert trainer._training_session.training_graph_count == 1
    assert "branches on tensor values" not in caplog.text and "is exported" not in caplog.text


class CTCFixedLengths(nn.Module):
    """F.ctc_loss with the lengths as Python ints (its `IntList` overload), the labels' lengths fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, frames, labels):
        log_probs = self.fc(frames).log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(log_probs, labels, (12, 10, 12), (4, 2, 3), reduction="sum")


def test_a_ctc_loss_with_lengths_as_python_ints_trains_like_pytorch():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(3, 12, 8, generator=g), torch.randint(1, 6, (3, 4), generator=g)) for _ in range(2)]
    desc = {"inputs": [("frames", [3, 12, 8]), ("labels", [3, 4])], "outputs": [("loss", [], True)]}
    model = CTCFixedLengths()
    reference = clone(model)
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.1), None, TORCH)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    steps_like_pytorch(trainer, reference, sgd, data)
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5


class SmallBatchesOnly(torch.autograd.Function):
    """Traceable for batches of up to 8 rows only: the dynamic-shape trace records the guard `batch <= 8`."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > 8:
            raise ValueError("batches of up to 8 rows")
        return grad * 2


def test_a_signature_that_fails_to_build_leaves_the_trainer_as_it_was():
    trainer = make_trainer(WithActivation(SmallBatchesOnly.apply), mlp_desc(), optim.SGDConfig(lr=0.1), CE)
    trainer.train_step(*batches(1)[0])
    before = trainer_weights(trainer)
    with pytest.raises(UntraceableFunctionError, match="SmallBatchesOnly"):
        trainer.train_step(*batches(1, sizes=(9,))[0])
    assert trainer._train_step_info.step == 1 and max_difference(trainer_weights(trainer), before) == 0
    trainer.train_step(*batches(1, sizes=(4,))[0])  # traced with the batch dim dynamic: its guard admits 4
    assert trainer._train_step_info.step == 2 and trainer._training_session.training_graph_count == 2


class RefusesLargeBatches(MLP):
    def forward(self, x):
        if x.shape[0] > 8:
            raise ValueError("batches of up to 8 rows")
        return super().forward(x)


def test_a_batch_the_model_refuses_raises_the_models_own_error_and_changes_nothing():
    """A later batch of another shape is traced again; the model's own error for it comes out as it would eagerly
    (it was wrapped in a GradientBuildError about torch.compile's flags)."""
    trainer = make_trainer(RefusesLargeBatches(), mlp_desc(), optim.SGDConfig(lr=0.1), CE, TORCH)
    trainer.train_step(*batches(1, sizes=(4,))[0])
    before = trainer_weights(trainer)
    for step in (trainer.train_step, trainer.eval_step):
        with pytest.raises(ValueError, match="batches of up to 8 rows"):
            step(*batches(1, sizes=(9,))[0])
    assert trainer._train_step_info.step == 1 and max_difference(trainer_weights(trainer), before) == 0
    trainer.train_step(*batches(1, sizes=(6,))[0])
    assert trainer._train_step_info.step == 2


class Normalised(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(64)

    def forward(self, x):
        return self.fc2(F.gelu(self.bn(self.fc1(x))))


class ConvNormalised(nn.Module):
    """BatchNorm2d on a (N, 4, 4, 4) activation: per-channel statistics over batch and space."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x.view(-1, 2, 4, 4)))).flatten(1))


@pytest.mark.parametrize(
    ("builder", "model_class"),
    [
        pytest.param("ort", Normalised, marks=needs_training_build),
        ("torch", Normalised),
        pytest.param("ort", ConvNormalised, marks=needs_training_build),
        ("torch", ConvNormalised),
    ],
)
@pytest.mark.parametrize("training", [True, False], ids=["train_mode", "eval_mode"])
def test_batch_norm_matches_pytorch(training, builder, model_class):
    """Train mode: batch statistics, and the running statistics and `num_batches_tracked` move as PyTorch moves
    them (the unbiased variance; the `ort` builder through graph/batch_norm_statistics.py, the torch builder from
    its trace); eval mode: the running statistics, unchanged, as PyTorch trains an eval-mode module (the `ort`
    builder through graph/fixups.inference_batchnorm_to_affine: ONNX Runtime's own gradient of an inference
    BatchNorm uses batch statistics), and `num_batches_tracked` is no state of the trainer."""
    torch.manual_seed(0)
    model = model_class().train(training)
    with torch.no_grad():
        model.bn.running_mean.add_(0.5)
        model.bn.running_var.mul_(2)
    options = {"_internal_use": {"gradient_builder": builder}}
    trainer, ref = train_with_reference(
        model, mlp_desc(), optim.SGDConfig(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1), CE, batches(4), options
    )
    assert ("bn.num_batches_tracked" in trainer._training_session.state_names()) == training
    assert max_difference(trainer_weights(trainer), torch_weights(ref)) < 1e-5
    state = trainer.state_dict(pytorch_format=True)
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(state[name], ref.state_dict()[name], rtol=1e-5, atol=1e-6)


# checkpoints, dropout, eval -----------------------------------------------------------------------------------------


def test_checkpoint_resume_is_exact(tmp_path):
    torch.manual_seed(0)
    model, data = WithActivation(StraightThrough.apply), batches(3) + batches(3, sizes=(5,), seed=2)
    options = {"batch": {"gradient_accumulation_steps": 2}}
    straight = make_trainer(clone(model), mlp_desc(), optim.AdamConfig(lr=1e-2), CE, options)
    for x, y in data:
        straight.train_step(x, y)
    first = make_trainer(clone(model), mlp_desc(), optim.AdamConfig(lr=1e-2), CE, options)
    for x, y in data[:3]:  # step 3 is in the middle of an accumulation window
        first.train_step(x, y)
    first.save_checkpoint(str(tmp_path / "half.ortcp"))
    resumed = make_trainer(WithActivation(StraightThrough.apply), mlp_desc(), optim.AdamConfig(lr=1e-2), CE, options)
    resumed.load_checkpoint(str(tmp_path / "half.ortcp"))  # before the first step: applied once compiled
    for x, y in data[3:]:
        resumed.train_step(x, y)
    assert resumed.gradient_builder == straight.gradient_builder == "torch"
    assert max_difference(resumed._training_session.get_state(), straight._training_session.get_state()) < 1e-7
    assert (
        resumed._train_step_info.step == 6
        and resumed._state.counters.optimizer_updates == straight._state.counters.optimizer_updates == 3
    )


class DropoutProbe(nn.Module):
    """y = dropout(x·w), loss = Σ c·y: the output shows the forward's mask, dloss/dw = c·x·mask/(1-p) the
    backward's."""

    def __init__(self, n: int = 512, p: float = 0.5) -> None:
        super().__init__()
        self.w, self.drop = nn.Parameter(torch.rand(n) + 0.5), nn.Dropout(p)

    def forward(self, x):
        return self.drop(x * self.w)


@pytest.mark.parametrize("builder", [pytest.param("ort", marks=needs_training_build), "torch"])
def test_dropout_backward_uses_the_forward_mask_and_eval_is_deterministic(builder):
    torch.manual_seed(0)  # seed 0 once drew the same mask in the first two steps (see _seed_onnxruntime)
    n, p, lr = 512, 0.5, 0.1
    model, x, c = DropoutProbe(n, p), torch.rand(n) + 0.5, torch.rand(n) + 0.5
    desc = {"inputs": [("x", [n]), ("c", [n])], "outputs": [("loss", [], True), ("y", [n])]}
    trainer = make_trainer(
        model,
        desc,
        optim.SGDConfig(lr=lr),
        lambda y, c: (y * c).sum(),
        {"_internal_use": {"gradient_builder": builder}},
    )
    masks, w = [], model.w.detach().numpy().copy()
    for _ in range(3):
        _, y = trainer.train_step(x, c)
        forward_mask = y.numpy() * (1 - p) / (x.numpy() * w)
        w, previous = trainer_weights(trainer)["w"], w
        backward_mask = (previous - w) * (1 - p) / (lr * (c * x).numpy())
        np.testing.assert_allclose(forward_mask, np.round(forward_mask), atol=1e-4)
        np.testing.assert_allclose(backward_mask, forward_mask, atol=1e-4)
        masks.append(np.round(forward_mask))
    assert 0.3 < masks[0].mean() < 0.7 and trainer.gradient_builder == builder
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])  # fresh every step
    first, second = trainer.eval_step(x, c)[1], trainer.eval_step(x, c)[1]
    model.w.data = torch.from_numpy(trainer_weights(trainer)["w"])
    np.testing.assert_array_equal(first.numpy(), second.numpy())
    np.testing.assert_allclose(first.numpy(), (x * model.w).detach().numpy(), rtol=1e-6)  # dropout off
