"""The models and descriptions of ONNX Runtime's published training samples, re-typed at test size: the MNIST
sample (`samples/python/training/orttrainer/mnist/ort_mnist.py`), the PyTorch transformer sample and its
getting-started variant for the older `capi` API (`samples/python/pytorch_transformer/`), which the original CI
used in `testORTTrainerDynamicShape`. Behaviour kept: the transformer builds its causal mask from the sequence length
the first time it sees one and keeps it as a plain attribute until a batch of another length comes."""

from __future__ import annotations

import math

import torch
from torch import nn


class MnistNet(nn.Module):
    """Linear -> ReLU -> Linear; the forward parameter is called `input1`, as in the sample."""

    def __init__(self, input_size: int = 784, hidden_size: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden_size, num_classes)

    def forward(self, input1):
        return self.fc2(self.relu(self.fc1(input1)))


def mnist_loss(x, target):
    return nn.functional.nll_loss(nn.functional.log_softmax(x, dim=1), target)


def mnist_desc() -> dict:
    return {
        "inputs": [("input1", ["batch", 784]), ("label", ["batch"])],
        "outputs": [("loss", [], True), ("probability", ["batch", 10])],
    }


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float, max_len: int = 512) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(max_len, dtype=torch.float).unsqueeze(1)
        frequency = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_len, d_model)
        table[:, 0::2], table[:, 1::2] = torch.sin(position * frequency), torch.cos(position * frequency)
        self.register_buffer("pe", table.unsqueeze(1))  # [max_len, 1, d_model]: sequence first

    def forward(self, x):
        return self.dropout(x + self.pe[: x.size(0)])


class TransformerLM(nn.Module):
    """The sample's TransformerModel: sequence-first tokens [bptt, batch] -> logits [bptt, batch, ntoken]."""

    def __init__(self, ntoken: int, ninp: int, nhead: int, nhid: int, nlayers: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.input1_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.transformer_encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout), nlayers, enable_nested_tensor=False
        )
        self.encoder = nn.Embedding(ntoken, ninp)
        self.decoder = nn.Linear(ninp, ntoken)
        self.ninp = ninp
        with torch.no_grad():
            self.encoder.weight.uniform_(-0.1, 0.1)
            self.decoder.weight.uniform_(-0.1, 0.1)
            self.decoder.bias.zero_()

    @staticmethod
    def causal_mask(size: int) -> torch.Tensor:
        allowed = torch.tril(torch.ones(size, size)) == 1
        return torch.zeros(size, size).masked_fill(~allowed, float("-inf"))

    def forward(self, input1):
        if self.input1_mask is None or self.input1_mask.size(0) != input1.size(0):
            self.input1_mask = self.causal_mask(input1.size(0)).to(input1.device)
        hidden = self.pos_encoder(self.encoder(input1) * math.sqrt(self.ninp))
        return self.decoder(self.transformer_encoder(hidden, self.input1_mask))


def transformer_loss(ntokens: int):
    def my_loss(x, target):
        return nn.functional.cross_entropy(x.view(-1, ntokens), target)

    return my_loss


def transformer_desc_dynamic(ntokens: int) -> dict:
    return {
        "inputs": [("input1", ["bptt", "batch_size"]), ("label", ["bptt_x_batch_size"])],
        "outputs": [("loss", [], True), ("predictions", ["bptt", "batch_size", ntokens])],
    }


def batchify(tokens: torch.Tensor, batch_size: int) -> torch.Tensor:
    """A token stream cut into `batch_size` columns: [steps, batch_size], sequence first."""
    steps = tokens.numel() // batch_size
    return tokens[: steps * batch_size].view(batch_size, steps).t().contiguous()


def get_batch(source: torch.Tensor, i: int, bptt: int = 35) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [i, i+seq) and the next-token targets, flattened; the last batch is shorter."""
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)
