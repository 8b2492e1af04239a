"""graph_transformer recompute options (gradient/torch_recompute.py) and utils.memory_efficient_gradient
(gradient/torch_memory.py) with the torch gradient builder, on every runtime: training gives exactly the weights it
gives without recompute, each option recomputes what it names, and the live activations of a step shrink — the same
observable effect as the 'ort' builder's recompute (tests/test_recompute.py), which the memory test checks too where
onnxruntime-training is installed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from activation_memory import trainer_activation_peak_mib
from helpers import make_trainer, max_difference, trainer_weights
from models import mlp_desc
from test_recompute import DESC, Stack, token_loss
from torch import nn

from orttrainer import optim
from orttrainer.trainer.gradient.torch_builder import RECOMPUTED_KEY
from orttrainer.trainer.runtime import has_training_build

TORCH = {"_internal_use": {"gradient_builder": "torch"}}


def _train(graph_transformer: dict, layers: int = 2, steps: int = 3, builder: str = "torch", config=None, **extra):
    torch.manual_seed(0)
    options = {"graph_transformer": graph_transformer, "_internal_use": {"gradient_builder": builder}, **extra}
    trainer = make_trainer(Stack(layers), DESC, config or optim.AdamConfig(lr=1e-2), token_loss, options)
    batches = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 50, (4, 16), generator=batches)
        trainer.train_step(tokens, tokens)
    return trainer


def _recomputed(trainer) -> int:
    metadata = {p.key: p.value for p in trainer._built.compiled.training.model.metadata_props}
    return int(metadata.get(RECOMPUTED_KEY, 0))


@pytest.fixture(scope="module")
def reference():
    return trainer_weights(_train({}))


@pytest.mark.parametrize(
    "option, expected",
    [
        ("gelu_recompute", 4),  # per layer: the GELU and its view
        ("attn_dropout_recompute", 10),  # per layer: x / (1 - p), the zero, the where, and the views to the matmul
        ("transformer_layer_recompute", 53),  # layer 0 (not the last): its interior and side values
    ],
)
def test_each_option_recomputes_what_it_names_and_trains_bit_identically(reference, option, expected):
    """Dropout is on (p = 0.1): the recomputed attention dropout reuses the forward's mask, so the weights after
    three Adam steps are bit-identical to those without recompute."""
    trainer = _train({option: True})
    assert trainer.gradient_builder == "torch" and _recomputed(trainer) == expected
    assert max_difference(trainer_weights(trainer), reference) == 0.0


@pytest.mark.parametrize(
    "graph_transformer, utils",
    [
        ({"transformer_layer_recompute": True}, {}),
        ({"attn_dropout_recompute": True}, {}),
        ({}, {"memory_efficient_gradient": True}),
    ],
)
def test_recompute_and_memory_efficient_gradients_keep_the_direct_translation(graph_transformer, utils, caplog):
    """Their `after` gates have a direct ONNX translation (gradient/aten_onnx.py): the graph is not sent to
    torch.onnx, whose re-trace took the transformer's first step from 2.3 s to 4-4.6 s (docs/engine.md §25)."""
    import logging

    with caplog.at_level(logging.INFO, logger="orttrainer"):
        trainer = _train(graph_transformer, steps=1, utils=utils)
    assert "does not cover" not in caplog.text
    names = [n.name for n in trainer._built.compiled.training.model.graph.node]
    assert any(name.startswith("aten/") for name in names) and not any(name.startswith("node_") for name in names)


def test_number_recompute_layers_counts_from_the_first_layer():
    counts = {
        n: _recomputed(_train({"transformer_layer_recompute": True, "number_recompute_layers": n}, 3, 1))
        for n in (0, 1, 2)
    }
    assert counts[1] > 0 and counts[0] == counts[2] == 2 * counts[1]  # all but the last = the first two


def test_more_layers_than_can_be_recomputed_is_clipped_with_a_warning():
    with pytest.warns(UserWarning, match="number_recompute_layers=5 is more than the 1 layers"):
        trainer = _train({"transformer_layer_recompute": True, "number_recompute_layers": 5}, steps=1)
    assert _recomputed(trainer) == 53


class ReluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_an_option_that_finds_nothing_warns_and_changes_nothing():
    trainer = make_trainer(
        ReluMLP(),
        mlp_desc(),
        optim.AdamConfig(),
        nn.functional.cross_entropy,
        {"graph_transformer": {"gelu_recompute": True}, **TORCH},
    )
    with pytest.warns(UserWarning, match="gelu_recompute: the graph has no GELU"):
        trainer.train_step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
    assert _recomputed(trainer) == 0


def test_a_gelu_before_a_dropout_is_not_recomputed_with_a_warning():
    from models import TinyTransformer, transformer_desc, transformer_loss

    torch.manual_seed(0)
    trainer = make_trainer(
        TinyTransformer(dropout=0.1),
        transformer_desc(),
        optim.AdamConfig(),
        transformer_loss,
        {"graph_transformer": {"gelu_recompute": True, "attn_dropout_recompute": True}, **TORCH},
    )
    tokens = torch.randint(0, 50, (4, 16))
    with pytest.warns(UserWarning, match="gelu_recompute: the backward pass reads none of the activations"):
        trainer.train_step(tokens, tokens)
    assert _recomputed(trainer) > 0  # nn.MultiheadAttention's dropout is


@pytest.mark.parametrize("product", [True, False], ids=["product", "where"])
def test_the_dropout_after_nn_multihead_attentions_softmax_is_found_through_either_mask(product, monkeypatch):
    """nn.MultiheadAttention's softmax is `_safe_softmax`, which zeroes its dead rows by a product with the rows'
    mask (gradient/torch_decompositions.safe_softmax) or, switched off, by PyTorch's select: the walk from the
    dropout back to the softmax passes either."""
    from models import TinyTransformer, transformer_desc, transformer_loss

    if not product:
        monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "safe_softmax_as_product")
    torch.manual_seed(0)
    options = {"graph_transformer": {"attn_dropout_recompute": True}, **TORCH}
    trainer = make_trainer(
        TinyTransformer(dropout=0.1), transformer_desc(), optim.AdamConfig(), transformer_loss, options
    )
    tokens = torch.randint(0, 50, (4, 16))
    trainer.train_step(tokens, tokens)
    assert _recomputed(trainer) > 0


def test_a_new_batch_shape_gets_a_recomputing_graph_with_the_same_results():
    """A batch the first graph's guards reject (size 1) is traced again, with recompute. There the results agree to
    float32 rounding, not bit for bit (ONNX Runtime optimises the size-1 graphs differently once the backward no
    longer reads a forward value: the loss measured 7e-8 relative apart); SGD, so the weights show the gradients'
    difference (Adam would blow the rounding of a near-zero gradient up to lr)."""
    sgd = optim.SGDConfig(lr=0.1)
    trainers = [_train(options, steps=1, config=sgd) for options in ({}, {"transformer_layer_recompute": True})]
    tokens = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(2))
    losses = [float(t.train_step(tokens, tokens)) for t in trainers]
    assert trainers[1]._training_session.training_graph_count == 2
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert max_difference(trainer_weights(trainers[0]), trainer_weights(trainers[1])) < 1e-6


@pytest.mark.parametrize("builder", ["torch"])
def test_recomputing_layers_lowers_the_live_activations_of_a_step(builder):
    """4 layers (d 64, batch 8 x 64 tokens), three of them recomputed: the peak of live intermediate tensors under
    ONNX Runtime's execution order drops by at least a third (measured: -45%). The torch builder only: on
    onnxruntime-training 1.19 the profile runs nodes the saved optimized model lacks, so this measure does not hold
    for the 'ort' builder's graph there (tests/test_recompute.py checks that builder's recompute by its nodes)."""

    def peak(graph_transformer: dict) -> float:
        torch.manual_seed(0)
        options = {"graph_transformer": graph_transformer, "_internal_use": {"gradient_builder": builder}}
        trainer = make_trainer(Stack(4, d=64), DESC, optim.SGDConfig(lr=0.1), token_loss, options)
        tokens = torch.randint(0, 50, (8, 64), generator=torch.Generator().manual_seed(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            trainer.train_step(tokens, tokens)
        return trainer_activation_peak_mib(trainer, {"tokens": tokens.numpy(), "target": tokens.numpy()})

    plain, recomputed = peak({}), peak({"transformer_layer_recompute": True})
    assert recomputed < 2 / 3 * plain, (plain, recomputed)


def test_recompute_options_are_accepted_on_every_runtime():
    """No refusal at construction (the maintained onnxruntime included): the torch builder honours them."""
    trainer = make_trainer(
        Stack(), DESC, optim.SGDConfig(), token_loss, {"graph_transformer": {"transformer_layer_recompute": True}}
    )
    tokens = torch.randint(0, 50, (2, 8))
    trainer.train_step(tokens, tokens)
    expected = "ort" if has_training_build() else "torch"  # 'auto'
    assert trainer.gradient_builder == expected and np.isfinite(float(trainer.eval_step(tokens, tokens)))


def test_memory_efficient_gradient_trains_as_without_it():
    """utils.memory_efficient_gradient on the torch builder (gradient/torch_memory.py): layer norms differentiated
    from their outputs, each output pinned where autograd computes it (`after` gates: Unsqueeze/Squeeze pairs), no
    buffer-reuse plan; the weights after three SGD steps agree to float32 rounding (measured 1.5e-8), the eval loss
    too. Its memory effect is measured in benchmarks/memory.py."""
    sgd = optim.SGDConfig(lr=0.1)
    plain = _train({}, config=sgd)
    efficient = _train({}, config=sgd, utils={"memory_efficient_gradient": True})
    assert efficient.gradient_builder == "torch"
    assert max_difference(trainer_weights(efficient), trainer_weights(plain)) < 1e-6
    tokens = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(3))
    assert float(efficient.eval_step(tokens, tokens)) == pytest.approx(float(plain.eval_step(tokens, tokens)), rel=1e-6)
    gates = [
        sum(n.op_type == "Unsqueeze" for n in t._built.compiled.training.model.graph.node) for t in (plain, efficient)
    ]
    assert gates[1] > gates[0] and not efficient._training_session.config.memory_reuse
