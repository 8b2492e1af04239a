"""Recurrent layers as the torch builder traces them (gradient/recurrent_layers.py): an LSTM's or GRU's layer's
recurrence as one op — the decomposition against nn.LSTM/nn.GRU and autograd, the trace's size against the sequence
length, the unrolled ONNX translation against PyTorch, the trainer against torch.optim with the rewrite on and off —
and the dropout between the layers of nn.LSTM, nn.GRU and nn.RNN."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnxruntime as ort
import pytest
import torch
from helpers import adam_weights, make_trainer, trainer_weights
from torch import nn

from orttrainer import optim
from orttrainer.trainer.gradient.aten_onnx import translate
from orttrainer.trainer.gradient.recurrent_layers import lstm, single_state_rnn
from orttrainer.trainer.gradient.torch_trace import JointWrapper, trace_joint, translated_directly
from orttrainer.trainer.graph.passes import REWRITES_ENVIRONMENT_VARIABLE

RECURRENCE = {nn.LSTM: "orttrainer.lstm_recurrence.default", nn.GRU: "orttrainer.gru_recurrence.default"}
BACKWARD = {
    nn.LSTM: "orttrainer.lstm_recurrence_backward.default",
    nn.GRU: "orttrainer.gru_recurrence_backward.default",
}
ONE_OP_LAYERS = pytest.mark.parametrize("layer", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])


def _loss(out, h, c):
    return out.square().sum() + h.sin().sum() + c.cos().sum()


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("layers", [1, 2])
def test_the_decomposition_computes_what_nn_lstm_computes(bidirectional, bias, batch_first, layers):
    """Outputs, final states and the gradients of the input, the initial states and every weight, as autograd
    gives them for nn.LSTM, with initial states of its own and a loss reading all three outputs."""
    torch.manual_seed(0)
    module = nn.LSTM(5, 7, num_layers=layers, bidirectional=bidirectional, bias=bias, batch_first=batch_first)
    x = torch.randn(3, 4, 5, requires_grad=True)
    states = (2 if bidirectional else 1) * layers
    batch = 3 if batch_first else 4
    h0 = torch.randn(states, batch, 7, requires_grad=True)
    c0 = torch.randn(states, batch, 7, requires_grad=True)
    out, (h, c) = module(x, (h0, c0))
    leaves = [x, h0, c0, *module.parameters()]
    expected = torch.autograd.grad(_loss(out, h, c), leaves)
    with translated_directly(True):
        ours = lstm(x, [h0, c0], list(module._flat_weights), bias, layers, 0.0, True, bidirectional, batch_first)
    got = torch.autograd.grad(_loss(*ours), leaves)
    for a, b in zip((out, h, c, *expected), (*ours, *got), strict=True):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("layer", "op"),
    [(nn.GRU, "gru"), (nn.RNN, "rnn_tanh"), (lambda *a, **k: nn.RNN(*a, nonlinearity="relu", **k), "rnn_relu")],
    ids=["gru", "rnn-tanh", "rnn-relu"],
)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("one_op", [True, False], ids=["one-op", "pytorch-s"])
def test_gru_and_rnn_layer_by_layer_compute_what_the_module_computes(layer, op, bidirectional, one_op):
    """As nn.LSTM's: a GRU's recurrence as one op, or each layer PyTorch's decomposition (an RNN's always)."""
    torch.manual_seed(0)
    module = layer(5, 7, num_layers=3, bidirectional=bidirectional, batch_first=True)
    x = torch.randn(3, 4, 5, requires_grad=True)
    h0 = torch.randn(3 * (2 if bidirectional else 1), 3, 7, requires_grad=True)
    out, h = module(x, h0)
    leaves = [x, h0, *module.parameters()]
    expected = torch.autograd.grad(out.square().sum() + h.sin().sum(), leaves)
    decomposition = single_state_rnn(getattr(torch.ops.aten, op).input)
    with translated_directly(one_op):
        ours = decomposition(x, h0, list(module._flat_weights), True, 3, 0.0, True, bidirectional, True)
    got = torch.autograd.grad(ours[0].square().sum() + ours[1].sin().sum(), leaves)
    for a, b in zip((out, h, *expected), (*ours, *got), strict=True):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)


class Tagger(nn.Module):
    """Embedded tokens through a recurrent layer (an LSTM unless `layer` says, its own configuration), a linear
    head, cross-entropy per position."""

    def __init__(self, layer: type[nn.RNNBase] = nn.LSTM, **lstm_options) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.lstm = layer(8, 6, **lstm_options)
        width = (lstm_options.get("proj_size") or 6) * (2 if lstm_options.get("bidirectional") else 1)
        self.head = nn.Linear(width, 5)
        self.batch_first = lstm_options.get("batch_first", False)

    def forward(self, tokens, labels):
        x = self.embed(tokens if self.batch_first else tokens.t())
        out, _ = self.lstm(x)
        out = out if self.batch_first else out.transpose(0, 1)
        return nn.functional.cross_entropy(self.head(out).reshape(-1, 5), labels.reshape(-1))


def _joint(model: nn.Module, steps: int, for_torch_onnx: bool = False):
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 30, (3, steps), generator=g), torch.randint(0, 5, (3, steps), generator=g)]
    wrapper = JointWrapper(model, None, ["tokens", "labels"])
    trainable = [n for n, _ in model.named_parameters()]
    graph, sig, _, _ = trace_joint(wrapper, inputs, trainable, for_torch_onnx=for_torch_onnx)
    return graph, sig, wrapper, inputs


def _targets(graph: torch.fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in graph.graph.nodes if n.op == "call_function")


@ONE_OP_LAYERS
def test_the_trace_does_not_grow_with_the_sequence(layer):
    """One recurrence op and one backward op per layer and direction, and as many traced nodes for 40 steps as for
    4; traced for torch.onnx (which has no translation of them), or with the switch off, the steps are traced one by
    one."""
    torch.manual_seed(0)
    model = Tagger(layer, num_layers=2, bidirectional=True)
    short, long = _joint(model, 4)[0], _joint(model, 40)[0]
    assert _targets(short)[RECURRENCE[layer]] == _targets(short)[BACKWARD[layer]] == 4
    assert len(short.graph.nodes) == len(long.graph.nodes)
    for_torch_onnx = _joint(model, 4, for_torch_onnx=True)[0]
    assert _targets(for_torch_onnx)[RECURRENCE[layer]] == 0
    assert len(for_torch_onnx.graph.nodes) > 2 * len(short.graph.nodes)


@ONE_OP_LAYERS
def test_the_switch_off_traces_step_by_step(monkeypatch, layer):
    monkeypatch.setenv(REWRITES_ENVIRONMENT_VARIABLE, "recurrences_as_one_op")
    torch.manual_seed(0)
    graph = _joint(Tagger(layer), 4)[0]
    assert _targets(graph)[RECURRENCE[layer]] == 0
    assert _targets(graph)["aten.sigmoid.default"] >= 2 * 4


def test_projections_decline_to_pytorch_s_decomposition():
    """An LSTM with projections (`proj_size`) is traced step by step, by PyTorch's decomposition."""
    torch.manual_seed(0)
    graph = _joint(Tagger(proj_size=3), 4)[0]
    assert _targets(graph)[RECURRENCE[nn.LSTM]] == 0


@ONE_OP_LAYERS
@pytest.mark.parametrize(
    "options",
    [
        {"num_layers": 2},
        {"num_layers": 2, "bidirectional": True, "batch_first": True},
        {"bias": False},
    ],
    ids=["two-layers", "bidirectional-batch-first", "no-bias"],
)
def test_the_unrolled_translation_computes_what_the_traced_graph_computes(layer, options):
    """The joint graph's ONNX translation (the recurrences unrolled), run by ONNX Runtime, gives the loss and every
    gradient that PyTorch gives running the traced graph itself (the ops' eager kernels)."""
    torch.manual_seed(0)
    graph, sig, wrapper, inputs = _joint(Tagger(layer, **options), 5)
    state = {**dict(wrapper.named_parameters()), **dict(wrapper.named_buffers())}
    user = iter(inputs)
    args = [state[name].detach() if kind != "user" else next(user) for kind, name in sig.inputs]
    expected = [t.detach().numpy() for t in graph(*args)]
    names = [f"in{i}" for i in range(len(args))]
    model = translate(graph, names, [f"out{i}" for i in range(len(expected))], 18)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {n: a.numpy() for n, a in zip(names, args, strict=True)})
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
    ops = Counter(n.op_type for n in model.graph.node)
    per_step = 3 if layer is nn.LSTM else 1  # an LSTM's i, f, o; a GRU's r and z at once
    assert ops["Sigmoid"] == per_step * 5 * (2 * 2 if options.get("bidirectional") else options.get("num_layers", 1))


class LearnedStart(nn.Module):
    """An LSTM whose initial states are parameters (their gradients flow through the recurrence's backward), read by
    the loss through its final states too."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.lstm = nn.LSTM(8, 6, num_layers=2)
        self.h0 = nn.Parameter(torch.randn(2, 1, 6) * 0.1)
        self.c0 = nn.Parameter(torch.randn(2, 1, 6) * 0.1)
        self.head = nn.Linear(6, 5)

    def forward(self, tokens, labels):
        batch = tokens.shape[0]
        start = (self.h0.expand(-1, batch, -1).contiguous(), self.c0.expand(-1, batch, -1).contiguous())
        out, (h, c) = self.lstm(self.embed(tokens.t()), start)
        logits = self.head(out.transpose(0, 1)).reshape(-1, 5)
        return nn.functional.cross_entropy(logits, labels.reshape(-1)) + 0.1 * (h.square().mean() + c.abs().mean())


def _difference_from_torch_optim(make_model, batches, desc) -> float:
    """The largest weight difference between ORTTrainer (torch builder, Adam) and torch.optim after `batches`."""
    torch.manual_seed(0)
    trainer = make_trainer(
        make_model(),
        desc,
        optim.AdamConfig(lr=1e-2),
        extra={"_internal_use": {"gradient_builder": "torch"}, "utils": {"grad_norm_clip": False}},
    )
    for tokens, labels in batches:
        trainer.train_step(tokens, labels)
    expected = adam_weights(make_model, batches, lr=1e-2)
    weights = trainer_weights(trainer)
    return max(float(np.abs(weights[n] - expected[n]).max()) for n in expected)


@pytest.mark.parametrize("switch", ["", "recurrences_as_one_op"], ids=["one-op", "step-by-step"])
@pytest.mark.parametrize(
    "make_model",
    [LearnedStart, lambda: Tagger(bidirectional=True), lambda: Tagger(nn.GRU, num_layers=2, batch_first=True)],
    ids=["learned", "bidir", "gru"],
)
def test_trains_as_torch_optim(monkeypatch, switch, make_model):
    """Three Adam steps through ORTTrainer (torch builder, ONNX Runtime) give torch.optim's weights, with the
    recurrence as one op and step by step."""
    monkeypatch.setenv(REWRITES_ENVIRONMENT_VARIABLE, switch)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 30, (3, 7), generator=g), torch.randint(0, 5, (3, 7), generator=g)) for _ in range(3)]
    desc = {"inputs": [("tokens", [3, 7]), ("labels", [3, 7])], "outputs": [("loss", [], True)]}
    assert _difference_from_torch_optim(make_model, batches, desc) < 1e-5


@pytest.mark.parametrize(
    ("layer", "switch"),
    [(nn.LSTM, ""), (nn.LSTM, "recurrences_as_one_op"), (nn.GRU, ""), (nn.RNN, "")],
    ids=["lstm-one-op", "lstm-step-by-step", "gru", "rnn"],
)
def test_dropout_between_layers_is_applied(monkeypatch, layer, switch):
    """nn.LSTM/GRU/RNN(dropout=p) drop the outputs of every layer but the last in training mode; PyTorch's
    decomposition left it out (torch 2.13), so the traced graph had no dropout. Every form has one dropout per gap
    between layers, at p."""
    monkeypatch.setenv(REWRITES_ENVIRONMENT_VARIABLE, switch)
    torch.manual_seed(0)
    graph = _joint(Tagger(layer, num_layers=3, dropout=0.25), 4)[0]
    dropouts = [n for n in graph.graph.nodes if n.target == torch.ops.aten.native_dropout.default]
    assert len(dropouts) == 2 and all(n.args[1] == 0.25 for n in dropouts)


@ONE_OP_LAYERS
def test_other_lengths_one_step_and_one_sample_train_as_torch_optim(layer):
    """Batches of 5, 1 and 7 steps, and of one sample, through one trainer (a graph per input shape): torch.optim's
    weights."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (3, 1), (1, 7), (3, 5)]
    batches = [(torch.randint(0, 30, s, generator=g), torch.randint(0, 5, s, generator=g)) for s in shapes]
    desc = {"inputs": [("tokens", ["batch", "seq"]), ("labels", ["batch", "seq"])], "outputs": [("loss", [], True)]}

    def make_model():
        return Tagger(layer, num_layers=2, bidirectional=True)

    assert _difference_from_torch_optim(make_model, batches, desc) < 1e-5
