"""`graph_transformer.propagate_cast_ops_config` in the trainer, on both gradient builders: the 'ort' builder hands it
to ONNX Runtime's PropagateCastOps, the torch builder runs orttrainer's pass (graph/cast_propagation.py) on its
graph. Same observable effect on both: the settings move casts so that more or fewer ops compute in float16, training
stays within the float16 tolerance of float32 PyTorch, and on a float32 model the option changes nothing (ONNX
Runtime's INSERT_AND_REDUCE used to make a float32 model fail at its first step with a type error)."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
from helpers import make_trainer, max_difference, torch_weights, trainer_weights
from models import MLP, TinyTransformer, mlp_desc, transformer_desc, transformer_loss
from test_gradient_options import AMP_DESC, AmpReference, _batches, _cast_options
from test_graph_gradient_options import _amp_graph
from test_mixed_precision import FP16_TOLERANCE
from torch import nn

from orttrainer import PropagateCastOpsStrategy, amp, optim
from orttrainer.trainer.graph.cast_propagation import count_casts
from orttrainer.trainer.runtime import has_training_build

S = PropagateCastOpsStrategy
BUILDERS = ["torch", "ort"] if has_training_build() else ["torch"]
HALF = onnx.TensorProto.FLOAT16


def _float16_nodes(model: onnx.ModelProto) -> int:
    """Nodes other than casts whose first output is float16 (declared or inferred)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    return sum(n.op_type != "Cast" and types.get(n.output[0]) == HALF for n in graph.node if n.output)


def _builder(name: str) -> dict:
    return {"_internal_use": {"gradient_builder": name}}


SETTINGS = [(S.NONE, 1, ()), (S.FLOOD_FILL, 1, ()), (S.FLOOD_FILL, 2, ("Sigmoid",)), (S.INSERT_AND_REDUCE, 1, ())]


@pytest.mark.parametrize("builder", BUILDERS)
def test_every_setting_moves_the_casts_of_an_amp_onnx_model_and_trains_it_within_float16_tolerance(builder):
    """The AMP-style ONNX model (a float16 island in float32 compute) in a float32 trainer: the float16 island grows
    with the level and the allow list, INSERT_AND_REDUCE also converts the allowed ops far from it."""
    float16_nodes = {}
    for strategy, level, allow in SETTINGS:
        model = _amp_graph()
        reference = AmpReference(model)
        options = {**_cast_options(strategy, level, allow), **_builder(builder)}
        trainer = make_trainer(model, AMP_DESC, optim.AdamConfig(lr=1e-3), extra=options)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
        for x, y in _batches(10):
            trainer.train_step(x, y)
            ref_opt.zero_grad()
            reference(x, y).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
        assert max_difference(trainer_weights(trainer), torch_weights(reference)) < FP16_TOLERANCE
        float16_nodes[(strategy, level)] = _float16_nodes(trainer._built.compiled.training.model)
    none = float16_nodes[(S.NONE, 1)]
    assert none < float16_nodes[(S.FLOOD_FILL, 1)] < float16_nodes[(S.FLOOD_FILL, 2)]
    assert float16_nodes[(S.INSERT_AND_REDUCE, 1)] > float16_nodes[(S.FLOOD_FILL, 1)]


@pytest.mark.parametrize("builder", BUILDERS)
def test_under_mixed_precision_every_strategy_trains_within_float16_tolerance(builder):
    """A PyTorch model in mixed precision: every strategy stays within the float16 tolerance of float32 PyTorch.
    On the torch builder INSERT_AND_REDUCE at level 2 computes more of the graph in float16 than NONE (PyTorch's
    decompositions compute softmax and the elementwise ops of the loss in float32 between casts); the 'ort'
    builder's float16 conversion already leaves only the loss-sensitive ops in float32, which no level allows, so
    there the graph stays as it is (README § Mixed precision)."""
    float16_nodes, casts = {}, {}
    for strategy in (S.NONE, S.FLOOD_FILL, S.INSERT_AND_REDUCE):
        torch.manual_seed(0)
        model = MLP()
        reference = copy.deepcopy(model)
        options = {
            "mixed_precision": {"enabled": True, "loss_scaler": amp.DynamicLossScaler(loss_scale=1024.0)},
            **_cast_options(strategy, level=2),
            **_builder(builder),
        }
        trainer = make_trainer(model, mlp_desc(), optim.AdamConfig(lr=1e-3), nn.functional.cross_entropy, options)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
        g = torch.Generator().manual_seed(5)
        for _ in range(10):
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
            trainer.train_step(x, y)
            ref_opt.zero_grad()
            nn.functional.cross_entropy(reference(x), y).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
        assert max_difference(trainer_weights(trainer), torch_weights(reference)) < FP16_TOLERANCE
        graph = trainer._built.compiled.training.model
        float16_nodes[strategy], casts[strategy] = _float16_nodes(graph), count_casts(graph)
    if builder == "torch":
        assert float16_nodes[S.INSERT_AND_REDUCE] > float16_nodes[S.NONE]
        assert casts[S.INSERT_AND_REDUCE] != casts[S.NONE]
    else:
        assert float16_nodes[S.INSERT_AND_REDUCE] == float16_nodes[S.NONE]


@pytest.mark.parametrize("builder", BUILDERS)
def test_on_a_float32_model_every_strategy_is_a_no_op(builder):
    """INSERT_AND_REDUCE at level 2 on a float32 transformer: the same training graph and the same weights as the
    default, where ONNX Runtime's pass used to fail at the first step ("Type (tensor(float)) of output arg (logits)
    of node (/model/head/Add) does not match expected type (tensor(float16))")."""

    def train(extra: dict):
        torch.manual_seed(0)
        model = TinyTransformer(d_model=16, heads=2, ff=32, layers=1, seq=8, dropout=0.0)
        trainer = make_trainer(model, transformer_desc(), optim.SGDConfig(lr=0.1), transformer_loss, extra)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            tokens = torch.randint(0, 50, (2, 8), generator=g)
            trainer.train_step(tokens, tokens)
        return trainer

    default = train(_builder(builder))
    inserted = train({**_cast_options(S.INSERT_AND_REDUCE, level=2, allow=("MatMul",)), **_builder(builder)})
    assert count_casts(inserted._built.compiled.training.model) == count_casts(default._built.compiled.training.model)
    assert [n.op_type for n in inserted._built.compiled.training.model.graph.node] == [
        n.op_type for n in default._built.compiled.training.model.graph.node
    ]
    assert max_difference(trainer_weights(inserted), trainer_weights(default)) == 0.0
