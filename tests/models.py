"""Small models shared by the trainer tests, and their model_desc."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """784-style classifier: Linear -> GELU -> Linear."""

    def __init__(self, d_in: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def mlp_desc(d_in: int = 32, classes: int = 10) -> dict:
    return {
        "inputs": [("x", ["batch", d_in]), ("target", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", classes])],
    }


def mlp_batches(n: int, batch: int = 8, seed: int = 1, scale: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` (x, target) batches for `MLP()`: x standard normal times `scale`, targets in 0..9, drawn in order from a
    generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [
        (scale * torch.randn(batch, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)
    ]


class TinyTransformer(nn.Module):
    """Token + position embedding, a 2-layer post-LN TransformerEncoder with GELU and dropout, and an LM head."""

    def __init__(
        self,
        vocab: int = 50,
        d_model: int = 32,
        heads: int = 4,
        ff: int = 64,
        layers: int = 2,
        seq: int = 16,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=dropout, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.encoder(h)))


def transformer_loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def transformer_desc(vocab: int = 50) -> dict:
    return {
        "inputs": [("tokens", ["batch", "seq"]), ("target", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("logits", ["batch", "seq", vocab])],
    }


# custom autograd.Functions (the torch gradient builder trains them with their own backward) ---------------------------


class ScalarAndTupleFunction(torch.autograd.Function):
    """The seed's example (with the @staticmethods and save_for_backward it needs to run): non-tensor arguments — an
    int, a tuple with a float and a bool, a float."""

    @staticmethod
    def forward(ctx, input, alpha, beta, gamma):
        ctx.save_for_backward(input)
        ctx.alpha, ctx.beta, ctx.gamma = alpha, beta, gamma
        return alpha * beta[0] * beta[1] * gamma * input.clamp(min=0)

    @staticmethod
    def backward(ctx, grad_output):
        (input,) = ctx.saved_tensors
        grad_input = grad_output.clone()
        grad_input[input < 0] = 0
        return ctx.alpha * ctx.beta[0] * ctx.beta[1] * ctx.gamma * grad_input, None, None, None


class DoubledGradient(torch.autograd.Function):
    """The identity (a copy), whose gradient is doubled: no list of forward ops tells it from a plain copy."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class StraightThrough(torch.autograd.Function):
    """round() forward; backward 3·g — not the derivative of round (0 almost everywhere), so a trained weight shows
    whose backward ran."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return 3 * grad


class LSTMTagger(torch.nn.Module):
    """A 2-layer LSTM over embedded tokens with a linear head: its recurrent weights are used at every time step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(30, 8)
        self.lstm = torch.nn.LSTM(8, 8, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, tokens, labels):
        out, _ = self.lstm(self.embed(tokens))
        return torch.nn.functional.cross_entropy(self.head(out).reshape(-1, 5), labels.reshape(-1))


# Python assert statements on values (here, not in a test module: pytest rewrites a test module's asserts into ifs)


class CheckedInputs(nn.Module):
    """A linear classifier that checks its labels the way transformers' XLM (`assert lengths.max().item() <= slen`)
    and ProphetNet (`assert torch.all(ids >= 0).item(), "..."`) check their inputs."""

    def __init__(self, d_in: int = 3, classes: int = 2) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, classes)
        self.classes = classes

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert labels.max().item() < self.classes
        assert torch.all(labels >= 0).item(), "labels must not be negative"
        return self.fc(x)


def assert_plain(flag: bool) -> None:
    assert flag


def assert_with_message(flag: bool) -> None:
    assert flag, f"flag was {flag}"


def assert_all(flag: bool) -> None:
    """Each operand of `and` in an assert holds when the assert does (transformers' I-BERT: `assert
    x_max.isnan().sum() == 0 and x_min.isnan().sum() == 0, (...)`)."""
    assert flag and flag, "both"


def assert_any(flag: bool) -> None:
    """An operand of `or` need not hold when the assert does."""
    assert flag or not flag
