"""graph_transformer recompute options in the trainer: the compiled graph holds exactly the recompute copies each
option asks for, and training gives the same weights as without recompute (peak memory: benchmarks/memory.py)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers import make_trainer, max_difference, needs_training_build, trainer_weights
from models import MLP, mlp_desc
from torch import nn

from orttrainer import optim
from orttrainer.trainer.graph.recompute import RECOMPUTE_SUFFIX, count_recompute_nodes


class Block(nn.Module):
    """Pre-LN transformer layer with hand-written attention (Dropout after the Softmax) and a GELU MLP."""

    def __init__(self, d: int = 32, heads: int = 4, ff: int = 64, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.attn_drop, self.drop = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        probs = self.attn_drop(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1))
        x = x + self.drop(self.out((probs @ v).transpose(1, 2).reshape(b, s, d)))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class Stack(nn.Module):
    def __init__(self, layers: int = 2, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def token_loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


DESC = {"inputs": [("tokens", ["batch", "seq"]), ("target", ["batch", "seq"])], "outputs": [("loss", [], True)]}


def _train(graph_transformer: dict, layers: int = 2, steps: int = 3):
    torch.manual_seed(0)  # the same weights and the same ONNX Runtime dropout seed in every run
    trainer = make_trainer(
        Stack(layers), DESC, optim.AdamConfig(lr=1e-2), token_loss, {"graph_transformer": graph_transformer}
    )
    batches = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        for _ in range(steps):
            tokens = torch.randint(0, 50, (4, 16), generator=batches)
            trainer.train_step(tokens, tokens)
    return trainer


@pytest.fixture(scope="module")
def reference():
    return trainer_weights(_train({}))


def _copied_layers(trainer) -> set[str]:
    """The `/model/layers.<k>/` scope of every recompute copy (by its name or, for fused nodes, its output)."""
    found = set()
    for node in trainer._built.compiled.training.model.graph.node:
        if RECOMPUTE_SUFFIX in node.name and not node.name.startswith("orttrainer/"):
            text = node.name if node.name.startswith("/model/layers.") else node.output[0]
            found.add(text.split("/")[2] if text.startswith("/model/layers.") else text)
    return found


@needs_training_build
def test_gelu_recompute_copies_each_gelu_and_trains_identically(reference):
    trainer = _train({"gelu_recompute": True})
    assert count_recompute_nodes(trainer._built.compiled.training.model) == {
        "BiasGelu": 2
    }  # one per layer, nothing else
    assert max_difference(trainer_weights(trainer), reference) <= 1e-6


@needs_training_build
def test_attn_dropout_recompute_copies_each_attention_dropout_and_trains_identically(reference):
    trainer = _train({"attn_dropout_recompute": True})
    assert count_recompute_nodes(trainer._built.compiled.training.model) == {"DropoutGrad": 2}  # from the kept masks
    assert max_difference(trainer_weights(trainer), reference) <= 1e-6  # dropout is on: the same masks are reused


@needs_training_build
def test_transformer_layer_recompute_copies_every_layer_but_the_last_and_trains_identically(reference):
    trainer = _train({"transformer_layer_recompute": True})
    counts = count_recompute_nodes(trainer._built.compiled.training.model)
    assert _copied_layers(trainer) == {"layers.0"}
    # layer 0's activations the backward reads: both layer norms, the attention (softmax, both dropouts from their
    # masks), the GELU, and the matmuls, transposes and reshapes in between
    assert (counts["LayerNormalization"], counts["Softmax"], counts["DropoutGrad"], counts["BiasGelu"]) == (2, 1, 2, 1)
    assert max_difference(trainer_weights(trainer), reference) <= 1e-6


@pytest.mark.parametrize(
    "number, expected", [(0, {"layers.0", "layers.1"}), (1, {"layers.0"}), (2, {"layers.0", "layers.1"})]
)
@needs_training_build
def test_number_recompute_layers_counts_from_the_first_layer(number, expected):
    trainer = _train({"transformer_layer_recompute": True, "number_recompute_layers": number}, layers=3, steps=1)
    assert _copied_layers(trainer) == expected


@needs_training_build
def test_more_layers_than_can_be_recomputed_is_clipped_with_a_warning():
    with pytest.warns(UserWarning, match="number_recompute_layers=5 is more than the 1 layers"):
        trainer = _train({"transformer_layer_recompute": True, "number_recompute_layers": 5}, steps=1)
    assert _copied_layers(trainer) == {"layers.0"}


def test_number_recompute_layers_alone_is_an_error():
    with pytest.raises(
        ValueError,
        match="number_recompute_layers=2 only takes effect with graph_transformer.transformer_layer_recompute=True",
    ):
        make_trainer(
            Stack(), DESC, optim.AdamConfig(), token_loss, {"graph_transformer": {"number_recompute_layers": 2}}
        )


@needs_training_build
def test_a_recompute_option_that_finds_nothing_warns():
    trainer = make_trainer(
        MLP(),
        mlp_desc(),
        optim.AdamConfig(),
        nn.functional.cross_entropy,
        {"graph_transformer": {"attn_dropout_recompute": True}},
    )
    with pytest.warns(UserWarning, match="attn_dropout_recompute: the graph has no Dropout between a Softmax"):
        trainer.train_step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert count_recompute_nodes(trainer._built.compiled.training.model) == {}


@needs_training_build
def test_nn_multihead_attention_dropout_is_recomputed_and_a_gelu_before_a_dropout_is_not():
    from models import TinyTransformer, transformer_desc, transformer_loss

    torch.manual_seed(0)
    trainer = make_trainer(
        TinyTransformer(dropout=0.1),
        transformer_desc(),
        optim.AdamConfig(),
        transformer_loss,
        {"graph_transformer": {"attn_dropout_recompute": True, "gelu_recompute": True}},
    )
    tokens = torch.randint(0, 50, (4, 16))
    with pytest.warns(
        UserWarning,
        match="gelu_recompute: the backward pass reads none of the 2 activations it "
        "selects \\(a dropout follows each GELU",
    ):
        trainer.train_step(tokens, tokens)
    # PyTorch's exporter drops scaled_dot_product_attention's training flag; the trainer restores it (fixups.py)
    assert count_recompute_nodes(trainer._built.compiled.training.model) == {"DropoutGrad": 2}
