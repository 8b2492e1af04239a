"""graph_transformer.propagate_cast_ops_config and utils.memory_efficient_gradient in the trainer."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from helpers import make_trainer, max_difference, needs_training_build, torch_weights, trainer_weights
from models import MLP, TinyTransformer, mlp_desc, transformer_desc, transformer_loss
from test_graph_gradient_options import _amp_graph
from test_mixed_precision import FP16_TOLERANCE
from torch import nn

from orttrainer import PropagateCastOpsStrategy, amp, optim
from orttrainer.trainer.runtime import has_training_build

AMP_DESC = {"inputs": [("x", ["batch", 8]), ("y", ["batch"])], "outputs": [("loss", [], True)]}


class AmpReference(nn.Module):
    """`_amp_graph` in float32 PyTorch."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__()
        weights = {i.name: torch.tensor(onnx.numpy_helper.to_array(i)) for i in model.graph.initializer}
        self.W0, self.W1, self.b = (nn.Parameter(weights[n].clone()) for n in ("W0", "W1", "b"))

    def forward(self, x, y):
        h = torch.relu(torch.tanh(torch.relu(x)) @ self.W0) @ self.W1
        return nn.functional.cross_entropy(torch.sigmoid(torch.tanh(h)) + self.b, y)


def _cast_options(strategy, level=1, allow=()) -> dict:
    return {
        "graph_transformer": {"propagate_cast_ops_config": {"strategy": strategy, "level": level, "allow": list(allow)}}
    }


def _batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 8, (4,), generator=g)) for _ in range(n)]


S = PropagateCastOpsStrategy


# Cast counts as test_graph_gradient_options documents for this graph; 4 needs both level 2 and the allowed Sigmoid
@needs_training_build
@pytest.mark.parametrize(
    "strategy, level, allow, casts",
    [
        (S.NONE, 1, (), 3),
        (None, 1, (), 3),
        (S.FLOOD_FILL, 1, (), 3),
        (S.INSERT_AND_REDUCE, 1, (), 5),
        (S.FLOOD_FILL, 2, ("Sigmoid",), 4),
    ],
)
def test_cast_propagation_reaches_the_graph_and_training_stays_within_the_float16_tolerance(
    strategy, level, allow, casts
):
    model = _amp_graph()
    reference = AmpReference(model)
    trainer = make_trainer(model, AMP_DESC, optim.AdamConfig(lr=1e-3), extra=_cast_options(strategy, level, allow))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    for x, y in _batches(20):
        trainer.train_step(x, y)
        ref_opt.zero_grad()
        reference(x, y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
    forward_casts = [
        n
        for n in trainer._built.compiled.training.model.graph.node
        if n.op_type == "Cast" and "_Grad" not in n.name and not n.name.startswith("orttrainer/")
    ]
    assert len(forward_casts) == casts
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < FP16_TOLERANCE


@needs_training_build
@pytest.mark.parametrize("strategy", list(PropagateCastOpsStrategy))
def test_every_strategy_trains_a_mixed_precision_model_within_the_float16_tolerance(strategy):
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    options = {
        "mixed_precision": {"enabled": True, "loss_scaler": amp.DynamicLossScaler(loss_scale=1024.0)},
        **_cast_options(strategy, level=2),
    }
    trainer = make_trainer(model, mlp_desc(), optim.AdamConfig(lr=1e-3), nn.functional.cross_entropy, options)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        trainer.train_step(x, y)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < FP16_TOLERANCE


@needs_training_build
def test_memory_efficient_gradient_uses_the_invertible_layer_norm_gradient_and_trains_identically():
    def train(memory_efficient: bool):
        torch.manual_seed(0)
        trainer = make_trainer(
            TinyTransformer(dropout=0.0),
            transformer_desc(),
            optim.SGDConfig(lr=0.1),
            transformer_loss,
            {"utils": {"memory_efficient_gradient": memory_efficient}},
        )
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            tokens = torch.randint(0, 50, (4, 16), generator=g)
            trainer.train_step(tokens, tokens)
        return trainer

    plain, efficient = train(False), train(True)
    kinds = [n.op_type for n in efficient._built.compiled.training.model.graph.node]
    assert kinds.count("InvertibleLayerNormalizationGrad") == 4 and kinds.count("LayerNormalizationGrad") == 1
    assert "InvertibleLayerNormalizationGrad" not in [
        n.op_type for n in plain._built.compiled.training.model.graph.node
    ]
    assert max_difference(trainer_weights(efficient), trainer_weights(plain)) < 1e-5
    tokens = torch.randint(0, 50, (4, 16))
    np.testing.assert_allclose(
        efficient.eval_step(tokens, tokens)[0].numpy(), plain.eval_step(tokens, tokens)[0].numpy(), rtol=1e-4
    )


def test_these_options_need_the_ort_gradient_builder():
    from helpers import cpu_options

    from orttrainer.trainer.gradient.choice import ort_only_options

    extra = {
        "graph_transformer": {"gelu_recompute": True, "propagate_cast_ops_config": {"level": 2}},
        "utils": {"memory_efficient_gradient": True},
    }
    assert ort_only_options(cpu_options(extra)) == [
        "graph_transformer.gelu_recompute",
        "utils.memory_efficient_gradient",
    ]  # cast propagation works on both builders (test_cast_propagation)
    assert ort_only_options(cpu_options({"graph_transformer": {"propagate_cast_ops_config": {"level": 2}}})) == []
    extra = {"utils": {"memory_efficient_gradient": True}, "_internal_use": {"gradient_builder": "torch"}}
    if not has_training_build():  # refused at construction: no builder here could honour it
        refused = r"\['utils.memory_efficient_gradient'\] need onnxruntime-training"
        with pytest.raises(NotImplementedError, match=refused):
            make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), nn.functional.cross_entropy, extra)
        return
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), nn.functional.cross_entropy, extra)
    with pytest.raises(NotImplementedError, match=r"\['utils.memory_efficient_gradient'\] transform"):
        trainer.train_step(torch.randn(4, 32), torch.randint(0, 10, (4,)))
