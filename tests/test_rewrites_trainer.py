"""The speed-only graph rewrites at the trainer (graph/passes.rewrite_enabled): on and off give the same training, and
the static-shape specialisation (runtime/static_graphs.py) applies where it should and nowhere else.

The rest of the suite runs with every rewrite on (the default); here they are also switched off.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
import test_trainer_parity as parity
import torch
from helpers import adam_weights, make_trainer, needs_training_build, trainer_weights
from models import MLP, LSTMTagger, TinyTransformer, mlp_desc, transformer_desc, transformer_loss

from orttrainer import optim
from orttrainer.trainer.graph.passes import REWRITES_ENVIRONMENT_VARIABLE as ENVIRONMENT_VARIABLE
from orttrainer.trainer.graph.passes import rewrite_enabled
from orttrainer.trainer.runtime import has_training_build
from orttrainer.trainer.runtime.ort import nchwc_block
from orttrainer.trainer.runtime.static_graphs import MAX_STATIC_SIGNATURES


def _train(batches, dropout=0.0, eval_mode=True, extra=None):
    torch.manual_seed(0)
    model = TinyTransformer(dropout=dropout)
    if eval_mode:
        model.eval()
    trainer = make_trainer(model, transformer_desc(), optim.AdamConfig(lr=1e-3), transformer_loss, extra)
    for tokens, target in batches:
        trainer.train_step(tokens, target)
    return trainer


def _batches(sizes, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50, (b, seq), generator=g), torch.randint(0, 50, (b, seq), generator=g)) for b in sizes]


def _difference(a, b) -> float:
    """Max weight difference, the attention key bias aside: its gradient is rounding noise that Adam normalises
    into lr-sized steps (test_trainer_parity.key_bias_slice)."""
    ours, theirs = trainer_weights(a), trainer_weights(b)
    skip = parity.key_bias_slice()
    return max(
        float(np.abs(np.delete(ours[n], np.flatnonzero(skip(n))) - np.delete(theirs[n], np.flatnonzero(skip(n)))).max())
        if skip(n) is not None
        else float(np.abs(ours[n] - theirs[n]).max())
        for n in ours
    )


def _ops(trainer) -> collections.Counter:
    return collections.Counter(n.op_type for n in trainer._training_session._runners.latest.graph.model.graph.node)


@needs_training_build
@pytest.mark.parametrize("disabled", ["all", "static_shapes", "cross_entropy_as_plain_ops"])
def test_each_rewrite_off_trains_the_same(monkeypatch, disabled):
    batches = _batches([4, 4, 2, 4, 2, 4])
    with_rewrites = _train(batches)
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, disabled)
    without = _train(batches)
    assert _difference(with_rewrites, without) < 1e-5
    ops = _ops(without)
    assert ("SoftmaxCrossEntropyLoss" in ops) == (disabled != "static_shapes")
    assert ("BroadcastGradientArgs" in ops) == (disabled != "cross_entropy_as_plain_ops")


@needs_training_build
def test_the_default_graph_is_specialised_and_rewritten():
    trainer = _train(_batches([4]))
    ops = _ops(trainer)
    assert "SoftmaxCrossEntropyLoss" not in ops and "LogSoftmax" in ops
    assert "BroadcastGradientArgs" not in ops and "Shape" not in ops
    assert ops["Concat"] >= 2  # the two layers' q/k/v gradients: no ScatterND into zeros, no Sum
    assert trainer._training_session.training_graph_count == 1  # the specialised graph (the dynamic one released)


@needs_training_build
def test_signatures_beyond_the_cap_run_the_dynamic_graph():
    sizes = [1, 2, 3, 4, 5, 6, 1, 6]
    batches = _batches(sizes)
    trainer = _train(batches)
    assert trainer._training_session.training_graph_count == 1 + MAX_STATIC_SIGNATURES
    assert "BroadcastGradientArgs" in _ops(trainer)  # the last batch (size 6) ran the dynamic graph


@needs_training_build
def test_the_specialised_transformer_matches_pytorch():
    trainer, reference = parity.train_both(parity._transformer_case, "adamw_before_update", True, "ort")
    assert trainer._training_session.training_graph_count == 1
    assert parity.max_weight_difference(trainer, reference, parity.key_bias_slice()) < parity.TOLERANCE


def test_graphs_with_dropout_are_not_specialised():
    trainer = _train(_batches([4, 2]), dropout=0.1, eval_mode=False)
    # the 'ort' builder keeps its one dynamic graph; the torch builder (maintained runtime) traces the first
    # batch's static graph and then its dynamic graph for the other size, as for any model
    assert trainer._training_session.training_graph_count == (1 if has_training_build() else 2)
    assert "Dropout" in _ops(trainer)


@needs_training_build
def test_mixed_precision_graphs_are_not_specialised():
    torch.manual_seed(0)
    trainer = make_trainer(
        MLP(), mlp_desc(), optim.AdamConfig(), torch.nn.functional.cross_entropy, {"mixed_precision": {"enabled": True}}
    )
    trainer.train_step(torch.randn(8, 32), torch.randint(0, 10, (8,)))
    assert trainer._training_session.training_graph_count == 1
    assert "SoftmaxCrossEntropyLoss" in _ops(trainer)  # float16 graphs keep the fused kernel


def test_the_torch_builder_s_qkv_gradient_is_a_concat_and_trains_the_same_without(monkeypatch):
    """The torch builder's traced q/k/v gradient (one-hot `Where`s over zeros, added) becomes a `Concat`
    (graph/static_shapes.where_sum_to_concat); `where_sum_to_concat` off keeps the `Where`s and trains the same."""
    batches = _batches([4, 4, 4])
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "")
    with_rewrite = _train(batches, extra={"_internal_use": {"gradient_builder": "torch"}})
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "where_sum_to_concat")
    without = _train(batches, extra={"_internal_use": {"gradient_builder": "torch"}})
    assert _difference(with_rewrite, without) < 1e-6
    ours, theirs = _ops(with_rewrite), _ops(without)
    assert ours["Concat"] >= theirs["Concat"] + 2  # one per layer
    assert ours["Where"] + 6 <= theirs["Where"]  # three one-hot placements per layer


@pytest.mark.parametrize(
    ("switch", "fewer"),
    [
        # one product and one reduction per layer for the recurrent weight and bias, not one per time step (6)
        ("summed_uses_to_one", {"MatMul": 2 * 5, "ReduceSum": 2 * 5}),
        ("noop_reductions", {"ReduceSum": 2 * 6}),  # each step's sum over an axis of size 1, in each layer
    ],
)
def test_the_torch_builder_s_lstm_rewrites_train_as_torch_does(monkeypatch, switch, fewer):
    """An LSTM's recurrent weight and bias gradients, one product or reduction per time step added (the torch
    builder's trace step by step: `recurrences_as_one_op` off, as for an nn.RNN or an LSTM it declines), become one
    per layer (graph/summed_uses.py), and its reductions over an axis of size 1 go
    (graph/static_shapes.drop_noop_reductions); each switched off keeps its ops; all train as torch.optim does."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 30, (3, 6), generator=g), torch.randint(0, 5, (3, 6), generator=g)) for _ in range(3)]
    desc = {"inputs": [("tokens", [3, 6]), ("labels", [3, 6])], "outputs": [("loss", [], True)]}

    def train(disabled: str):
        monkeypatch.setenv(ENVIRONMENT_VARIABLE, ",".join(["recurrences_as_one_op", *filter(None, [disabled])]))
        torch.manual_seed(0)
        trainer = make_trainer(
            LSTMTagger(),
            desc,
            optim.AdamConfig(lr=1e-2),
            extra={"_internal_use": {"gradient_builder": "torch"}, "utils": {"grad_norm_clip": False}},
        )
        for tokens, labels in batches:
            trainer.train_step(tokens, labels)
        return trainer

    with_rewrite, without = train(""), train(switch)
    expected = adam_weights(LSTMTagger, batches, lr=1e-2)
    for trainer in (with_rewrite, without):
        weights = trainer_weights(trainer)
        assert max(float(np.abs(weights[n] - expected[n]).max()) for n in expected) < 1e-5
    for op, count in fewer.items():
        assert _ops(with_rewrite)[op] == _ops(without)[op] - count


class _SmallCNN(torch.nn.Module):
    """An RGB stem, then 16- and 32-channel convolutions (whole blocks of the NCHWc layout) with BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.conv = torch.nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(16)
        self.down = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, images, labels):
        x = torch.relu(self.stem(images))
        x = torch.relu(self.norm(self.conv(x)))
        x = self.down(x).mean(dim=(2, 3))
        return torch.nn.functional.cross_entropy(self.head(x), labels)


@pytest.mark.parametrize("builder", ["torch", pytest.param("ort", marks=needs_training_build)])
def test_convolutions_run_in_the_blocked_layout_and_train_as_torch_does(monkeypatch, tmp_path, builder):
    """On the CPU the session runs the convolutions with whole channel blocks as ONNX Runtime's NCHWc kernels
    (graph/nchwc.py, at session creation); switched off, as plain `Conv`s; both train as torch.optim does."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]
    desc = {"inputs": [("images", [4, 3, 8, 8]), ("labels", [4])], "outputs": [("loss", [], True)]}

    def train(disabled: str):
        monkeypatch.setenv(ENVIRONMENT_VARIABLE, disabled)
        torch.manual_seed(0)
        path = str(tmp_path / f"optimized_{disabled or 'all'}.onnx")
        saved = {"graph_save_paths": {"model_with_training_graph_after_optimization_path": path}}
        trainer = make_trainer(
            _SmallCNN(),
            desc,
            optim.AdamConfig(lr=1e-2),
            extra={"_internal_use": {"gradient_builder": builder}, "debug": saved, "utils": {"grad_norm_clip": False}},
        )
        for images, labels in batches:
            trainer.train_step(images, labels)
        return trainer, {(n.domain, n.op_type) for n in onnx.load(path).graph.node}

    (blocked, blocked_ops), (plain, plain_ops) = train(""), train("blocked_convolutions")
    assert (("com.microsoft.nchwc", "Conv") in blocked_ops) == (nchwc_block() is not None)
    assert ("com.microsoft.nchwc", "Conv") not in plain_ops
    expected = adam_weights(_SmallCNN, batches, lr=1e-2)
    for trainer in (blocked, plain):
        weights = trainer_weights(trainer)
        assert max(float(np.abs(weights[n] - expected[n]).max()) for n in expected) < 1e-4


def test_unknown_rewrite_names_are_an_error(monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "static_shapes,speed")
    with pytest.raises(ValueError, match="unknown rewrites"):
        rewrite_enabled("static_shapes")
    with pytest.raises(ValueError, match="unknown rewrite 'fast'"):
        rewrite_enabled("fast")


def test_the_torch_builder_s_graphs_are_not_specialised_again():
    torch.manual_seed(0)
    trainer = make_trainer(
        MLP(),
        mlp_desc(),
        optim.AdamConfig(),
        torch.nn.functional.cross_entropy,
        {"_internal_use": {"gradient_builder": "torch"}},
    )
    for x, y in [(torch.randn(8, 32), torch.randint(0, 10, (8,))), (torch.randn(4, 32), torch.randint(0, 10, (4,)))]:
        trainer.train_step(x, y)
    # the torch builder's own two graphs (the first batch's static one, then the dynamic one for the other size);
    # the ort builder's per-signature specialisation adds none
    assert trainer._training_session.training_graph_count == 2
    assert np.isfinite(trainer_weights(trainer)["fc1.weight"]).all()


def test_the_debug_stages_show_the_default_graphs(tmp_path):
    """With the default update path and rewrites: the gradient stage has the plain-op cross-entropy, the training
    stage is gradient-only (the update runs in torch), the optimised stage is the dynamic graph's."""
    import onnx

    names = ["model_with_gradient_graph_path", "model_with_training_graph_path"]
    names.append("model_with_training_graph_after_optimization_path")
    paths = {name: str(tmp_path / f"{name}.onnx") for name in names}
    torch.manual_seed(0)
    trainer = make_trainer(
        MLP(), mlp_desc(), optim.AdamConfig(), torch.nn.functional.cross_entropy, {"debug": {"graph_save_paths": paths}}
    )
    trainer.train_step(torch.randn(8, 32), torch.randint(0, 10, (8,)))
    ops = {name: {n.op_type for n in onnx.load(path).graph.node} for name, path in paths.items()}
    assert "LogSoftmax" in ops["model_with_gradient_graph_path"]
    assert "SoftmaxCrossEntropyLossGrad" not in ops["model_with_gradient_graph_path"]
    assert "Sqrt" not in ops["model_with_training_graph_path"]  # no optimizer update in the graph
    assert ops["model_with_training_graph_after_optimization_path"]


@needs_training_build
def test_memory_efficient_gradients_are_specialised_without_inference_fusions(monkeypatch):
    """docs/engine.md §14: with static shapes ONNX Runtime would fuse Add + LayerNormalization into
    SkipLayerNormalization, whose CPU kernel does not compute the inverse std InvertibleLayerNormalizationGrad
    reads; the trainer's sessions keep that fusion off (runtime/ort.TRAINING_UNSAFE_FUSIONS)."""
    batches = _batches([4, 4, 4])
    extra = {"utils": {"memory_efficient_gradient": True}}
    specialised = _train(batches, extra=extra)
    ops = _ops(specialised)
    assert specialised._training_session.training_graph_count == 1 and "BroadcastGradientArgs" not in ops
    assert ops["InvertibleLayerNormalizationGrad"] == 4 and "SkipLayerNormalization" not in ops
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "static_shapes")
    assert _difference(specialised, _train(batches, extra=extra)) < 1e-5
