"""Mixed precision with the torch gradient builder (trainer/build/export.py): the module traced in float16 on float32
master weights, the backward seeded by the loss scale, and the shared tail (unscaling, the finite check, clipping,
accumulation, the update) — parity with PyTorch and with the 'ort' builder, overflow skips, checkpoints, new input
shapes, data parallelism, and ONNX models (their forward converted to float16, build/onnx_float16.py).

Tolerances: float16 has an 11-bit significand (relative rounding 4.9e-4), so activations and gradients carry
relative errors of about 1e-3. Adam normalises each gradient, so its update differs from float32's by about that
fraction of lr per step: over 30 steps at lr 1e-3 a few 1e-5 at most, well inside `FP16_TOLERANCE` (5e-3, the
'ort' path's bound, tests/test_mixed_precision.py). Against a PyTorch reference that computes in float16 the same
way (`_float16_reference`): `SAME_ARITHMETIC` (1e-4; measured 1.9e-5 on the MLP, where that reference is itself
2.3e-5 from float32 — the weights barely tell the precisions apart, so the test also checks the graph's float16
casts).
"""

from __future__ import annotations

import copy
from collections import namedtuple

import numpy as np
import onnx
import pytest
import torch
from helpers import (
    export_training_onnx,
    make_trainer,
    max_difference,
    state_and_counters,
    torch_weights,
    trainer_weights,
)
from models import MLP, TinyTransformer, mlp_batches, mlp_desc, transformer_desc, transformer_loss
from test_mixed_precision import FP16_TOLERANCE

from orttrainer import amp, optim
from orttrainer.trainer.build.export import _ModelWithLoss, float16_inputs, float16_state, float32_values
from orttrainer.trainer.runtime import ort_private
from orttrainer.trainer.update.path import ENVIRONMENT_VARIABLE

CE = torch.nn.functional.cross_entropy
SAME_ARITHMETIC = 1e-4  # max weight difference to `_float16_reference` after 30 steps (module docstring)
TRAINING_BUILD = pytest.mark.skipif(
    not ort_private.has_training_build(), reason="needs onnxruntime-training (the 'ort' gradient builder)"
)


def _amp(scaler=None, builder: str = "torch", **extra) -> dict:
    return {
        "mixed_precision": {"enabled": True, "loss_scaler": scaler},
        "_internal_use": {"gradient_builder": builder},
        **extra,
    }


@pytest.fixture(params=["torch", "graph"])
def update_path(request, monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, request.param)
    return request.param


def _reference_step(model, optimizer, loss, scale: float = 1.0) -> None:
    """PyTorch's step with the trainer's defaults: unscale, clip the global norm to 1, update."""
    optimizer.zero_grad()
    (loss * scale).backward()
    for p in model.parameters():
        p.grad /= scale
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _float16_reference(model: torch.nn.Module, inputs) -> torch.Tensor:
    """The loss the trainer's graph computes, in eager PyTorch: the model in float16 on its float32 weights."""
    return _ModelWithLoss(model, CE, ["x", "target"], float16=True)(*inputs)[0]


def test_the_mlp_tracks_pytorch_in_float32_and_in_float16(update_path):
    torch.manual_seed(0)
    model, scale = MLP(), 1024.0
    fp32, fp16 = copy.deepcopy(model), copy.deepcopy(model)
    trainer = make_trainer(model, mlp_desc(), optim.AdamConfig(lr=1e-3), CE, _amp(amp.DynamicLossScaler(scale)))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0) for m in (fp32, fp16)]
    for x, y in mlp_batches(30, seed=5):
        loss, logits = trainer.train_step(x, y)
        _reference_step(fp32, opts[0], CE(fp32(x), y))
        _reference_step(fp16, opts[1], _float16_reference(fp16, (x, y)), scale)
    assert trainer.gradient_builder == "torch" and trainer._train_step_info.optimization_step == 30
    assert (loss.dtype, logits.dtype) == (torch.float32, torch.float16)
    ours = trainer_weights(trainer)
    assert {v.dtype for v in ours.values()} == {np.dtype(np.float32)}  # the master weights
    assert max_difference(ours, torch_weights(fp32)) < FP16_TOLERANCE  # measured 1.2e-5 (30 steps)
    assert max_difference(ours, torch_weights(fp16)) < SAME_ARITHMETIC
    graph = trainer._training_session.graph
    casts = [a.i for n in graph.model.graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"]
    assert onnx.TensorProto.FLOAT16 in casts  # it computes in float16
    assert graph.loss_scale_input == "loss_scale" and graph.all_finite_output is not None


def test_the_transformer_tracks_pytorch_in_float32():
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.1).eval()
    reference = copy.deepcopy(model)
    trainer = make_trainer(
        model, transformer_desc(), optim.AdamConfig(lr=1e-3), transformer_loss, _amp(amp.DynamicLossScaler(1024.0))
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        tokens, target = torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)
        loss, logits = trainer.train_step(tokens, target)
        ref_loss = transformer_loss(reference(tokens), target)
        _reference_step(reference, ref_opt, ref_loss)
    assert trainer.gradient_builder == "torch" and trainer._train_step_info.optimization_step == 30
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-3)
    ours, theirs = _without_key_bias(trainer_weights(trainer)), _without_key_bias(torch_weights(reference))
    assert max_difference(ours, theirs) < FP16_TOLERANCE  # measured 2.0e-3 (20 steps)


def _without_key_bias(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The key bias of attention has an identically zero gradient: only rounding noise, amplified by Adam."""
    return {n: np.delete(w, range(32, 64)) if n.endswith("self_attn.in_proj_bias") else w for n, w in weights.items()}


@TRAINING_BUILD
@pytest.mark.parametrize("model_kind", ["mlp", "transformer"])
def test_the_torch_builder_agrees_with_the_ort_builder_as_well_as_that_agrees_with_float32(model_kind):
    """The 'ort' path rounds more of its graph to float16 (its loss included: measured 0.2-1% loss error where the
    torch builder's is 2e-5), so the builders differ by the 'ort' path's own distance to float32: measured
    1.5e-2 (MLP) and 1.2e-2 (transformer) after 20 Adam steps, with the torch builder 1e-5 and 2e-3 from float32."""
    torch.manual_seed(0)
    if model_kind == "mlp":
        model, desc, loss_fn, batches = MLP(), mlp_desc(), CE, mlp_batches(20, seed=5)
    else:
        model, desc, loss_fn = TinyTransformer(dropout=0.1).eval(), transformer_desc(), transformer_loss
        g = torch.Generator().manual_seed(0)
        batches = [
            (torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)) for _ in range(20)
        ]
    trainers = [
        make_trainer(
            copy.deepcopy(model), desc, optim.AdamConfig(lr=1e-3), loss_fn, _amp(amp.DynamicLossScaler(1024.0), builder)
        )
        for builder in ("torch", "ort")
    ]
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    for inputs in batches:
        ref_loss = loss_fn(reference(inputs[0]), inputs[1])
        losses = [trainer.train_step(*inputs)[0].item() for trainer in trainers]
        assert losses[0] == pytest.approx(ref_loss.item(), rel=1e-3)
        assert losses[1] == pytest.approx(ref_loss.item(), rel=2e-2)
        _reference_step(reference, ref_opt, ref_loss)
    assert [t.gradient_builder for t in trainers] == ["torch", "ort"]
    ours, theirs = (_without_key_bias(trainer_weights(t)) for t in trainers)
    fp32 = _without_key_bias(torch_weights(reference))
    assert max_difference(ours, fp32) < FP16_TOLERANCE
    assert max_difference(ours, theirs) <= max_difference(theirs, fp32) + FP16_TOLERANCE


@pytest.mark.parametrize("accumulation", [1, 2])
def test_an_overflowing_step_is_skipped_the_scale_backs_off_and_training_goes_on(update_path, accumulation):
    torch.manual_seed(0)
    scaler = amp.DynamicLossScaler(loss_scale=1024.0)
    options = _amp(scaler, batch={"gradient_accumulation_steps": accumulation})
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(lr=1e-2), CE, options)
    for x, y in mlp_batches(2 * accumulation, seed=5):
        trainer.train_step(x, y)
    assert trainer._train_step_info.optimization_step == 2 and scaler.loss_scale == 1024.0
    before = state_and_counters(trainer)
    for _ in range(accumulation - 1):
        trainer.train_step(*mlp_batches(1, seed=9)[0])
    trainer.train_step(*mlp_batches(1, scale=1e20, seed=5)[0])  # float16 activations overflow: gradients not finite
    after = state_and_counters(trainer)
    assert trainer._train_step_info.all_finite.tolist() == [False]
    assert scaler.loss_scale == 512.0 and trainer._train_step_info.optimization_step == 2
    for name, value in before.items():
        if name != "counters":
            assert np.array_equal(value, after[name]), name  # bit-identical, moments and buffers included
    for x, y in mlp_batches(accumulation, seed=11):
        trainer.train_step(x, y)
    assert trainer._train_step_info.all_finite.tolist() == [True]
    assert trainer._train_step_info.optimization_step == 3
    assert max_difference(trainer_weights(trainer), {k: before[k] for k in trainer_weights(trainer)}) > 0


def test_a_loss_scale_beyond_float16_is_skipped_until_it_fits():
    """The default scale 2^16 times the loss's gradient overflows float16 where it enters the model's float16
    part: the scaler halves it until the steps are finite, as with PyTorch's GradScaler."""
    torch.manual_seed(0)
    scaler = amp.DynamicLossScaler(loss_scale=float(2**24))
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), CE, _amp(scaler))
    finite = []
    for x, y in mlp_batches(12, seed=5):
        trainer.train_step(x, y)
        finite.append(bool(trainer._train_step_info.all_finite))
    assert not finite[0] and finite[-1] and scaler.loss_scale < 2**24
    assert trainer._train_step_info.optimization_step == sum(finite)


def test_accumulation_and_clipping_match_pytorch(update_path):
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    options = _amp(amp.DynamicLossScaler(1024.0), batch={"gradient_accumulation_steps": 2})
    trainer = make_trainer(model, mlp_desc(), optim.AdamConfig(lr=1e-2), CE, options)  # SGD does not clip
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    batches, norms = mlp_batches(20, scale=4.0, seed=5), []
    for i in range(0, len(batches), 2):
        ref_opt.zero_grad()
        for x, y in batches[i : i + 2]:
            trainer.train_step(x, y)
            (CE(reference(x), y) / 2).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)))
        ref_opt.step()
    assert max(norms) > 1.0  # clipping acted
    assert trainer._train_step_info.optimization_step == 10
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < FP16_TOLERANCE


def test_state_dict_round_trip_keeps_float32_master_weights_and_the_scaler():
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(8, seed=5)
    batches[1] = mlp_batches(1, scale=1e20, seed=5)[0]  # an overflow: the scale is 512 at the checkpoint

    def fresh():
        scaler = amp.DynamicLossScaler(loss_scale=1024.0, up_scale_window=4)
        return make_trainer(copy.deepcopy(model), mlp_desc(), optim.AdamConfig(lr=1e-2), CE, _amp(scaler))

    straight, first = fresh(), fresh()
    for x, y in batches:
        straight.train_step(x, y)
    for x, y in batches[:4]:
        first.train_step(x, y)
    state = first.state_dict()
    weights = state["model"]["full_precision"]
    assert {v.dtype for v in weights.values()} == {np.dtype(np.float32)}
    assert state["loss_scaler"]["loss_scale"] == 512.0 and state["loss_scaler"]["stable_steps"] == 2
    resumed = fresh()
    resumed.load_state_dict(state)
    for x, y in batches[4:]:
        resumed.train_step(x, y)
    assert max_difference(state_and_counters(resumed), state_and_counters(straight)) <= 1e-6
    scales = [t.options.mixed_precision.loss_scaler.loss_scale for t in (resumed, straight)]
    assert scales[0] == scales[1] == 1024.0  # grown back after 4 finite steps in both


def test_outputs_keep_their_precision_in_training_and_evaluation(tmp_path):
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE, _amp())
    assert isinstance(trainer.options.mixed_precision.loss_scaler, amp.DynamicLossScaler)
    x, y = mlp_batches(1, seed=5)[0]
    trainer.train_step(x, y)
    eval_loss, eval_logits = trainer.eval_step(x, y)
    assert (eval_loss.dtype, eval_logits.dtype) == (torch.float32, torch.float16)
    model = MLP()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in trainer_weights(trainer).items()})
    # the eval graph reads the trained master weights (none folded into a float16 constant)
    torch.testing.assert_close(eval_logits.float(), model(x), rtol=2e-2, atol=2e-2)
    outputs = trainer.model_desc.outputs
    assert outputs[1].dtype_amp == torch.float16 and outputs[0].dtype_amp is None
    assert trainer.model_desc.loss_scale_input.name == trainer.options.mixed_precision.loss_scaler.input_name
    assert "all_gradients_finite" in trainer.model_desc.all_finite.name
    trainer.save_as_onnx(str(tmp_path / "mlp.onnx"))  # the float16-computing forward, with the master weights
    saved = onnx.load(str(tmp_path / "mlp.onnx"))
    trained = trainer_weights(trainer)
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in saved.graph.initializer if i.name in trained}
    assert set(weights) == set(trained)  # other initializers are the exporter's constants (shapes, scalars)
    assert max_difference(weights, trained) == 0.0


def test_a_batch_the_first_graph_rejects_gets_its_own_mixed_precision_graph():
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), CE, _amp(amp.DynamicLossScaler(1024.0)))
    trainer.train_step(*mlp_batches(1, seed=5)[0])
    loss, _ = trainer.train_step(*mlp_batches(1, batch=1, seed=5)[0])  # size 1 is specialised by PyTorch's tracer
    assert trainer._training_session.training_graph_count == 2
    assert torch.isfinite(loss) and trainer._train_step_info.optimization_step == 2


class _MLPWithLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x, target):
        logits = self.mlp(x)
        return CE(logits, target), logits


def _onnx_mlp(module: torch.nn.Module) -> onnx.ModelProto:
    axes = {"x": {0: "batch"}, "target": {0: "batch"}, "logits": {0: "batch"}}
    return export_training_onnx(module, mlp_batches(1, seed=5)[0], ["x", "target"], ["loss", "logits"], axes)


def test_an_onnx_model_trains_in_mixed_precision_on_the_torch_builder(update_path):
    """An ONNX model's forward converted to float16 (build/onnx_float16.py) on float32 master weights, with the
    PyTorch models' tail: the loss scale, unscaling, clipping to norm 1, Adam. Against PyTorch in float32 with the
    same clipping: within `FP16_TOLERANCE` after 30 steps (measured 1.4e-5, both runtimes); the outputs keep their
    precisions."""
    torch.manual_seed(0)
    module = _MLPWithLoss()
    reference = copy.deepcopy(module)
    options = _amp(amp.DynamicLossScaler(1024.0))
    trainer = make_trainer(_onnx_mlp(module), mlp_desc(), optim.AdamConfig(lr=1e-3), None, options)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    for x, y in mlp_batches(30, scale=4.0, seed=5):
        loss, logits = trainer.train_step(x, y)
        ref_loss = reference(x, y)[0]
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-3)  # measured 7e-5
        _reference_step(reference, ref_opt, ref_loss)
    assert trainer.gradient_builder == "torch" and trainer._train_step_info.optimization_step == 30
    assert (loss.dtype, logits.dtype) == (torch.float32, torch.float16)
    ours = trainer_weights(trainer)
    assert {v.dtype for v in ours.values()} == {np.dtype(np.float32)}  # the master weights
    assert max_difference(ours, torch_weights(reference)) < FP16_TOLERANCE
    graph = trainer._training_session.graph
    casts = [a.i for n in graph.model.graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"]
    assert onnx.TensorProto.FLOAT16 in casts  # it computes in float16
    assert graph.loss_scale_input == "loss_scale" and graph.all_finite_output is not None


def test_an_onnx_models_overflowing_step_is_skipped_and_the_scale_backs_off():
    torch.manual_seed(0)
    scaler = amp.DynamicLossScaler(loss_scale=1024.0)
    trainer = make_trainer(_onnx_mlp(_MLPWithLoss()), mlp_desc(), optim.AdamConfig(lr=1e-2), None, _amp(scaler))
    for x, y in mlp_batches(2, seed=5):
        trainer.train_step(x, y)
    before = state_and_counters(trainer)
    trainer.train_step(*mlp_batches(1, scale=1e20, seed=5)[0])  # float16 activations overflow: gradients not finite
    after = state_and_counters(trainer)
    assert trainer._train_step_info.all_finite.tolist() == [False]
    assert scaler.loss_scale == 512.0 and trainer._train_step_info.optimization_step == 2
    for name, value in before.items():
        if name != "counters":
            assert np.array_equal(value, after[name]), name  # bit-identical, moments included
    trainer.train_step(*mlp_batches(1, seed=11)[0])
    assert trainer._train_step_info.all_finite.tolist() == [True]
    assert trainer._train_step_info.optimization_step == 3


@pytest.mark.distributed
def test_two_ranks_equal_one_process(tmp_path):
    """The gradient-step graph under data parallelism (accumulating in the graph, two batch sizes: the first batch's
    static graph, then the dynamic graph for the other size); the ranks' float16 sums over half batches round
    differently from one process's."""
    from test_distributed import _max_difference, run_ranks

    cfg = {"accumulation": 2, "halve_odd_steps": True, "mixed_precision": True, "builder": "torch"}
    single = run_ranks(tmp_path, 1, **cfg)[0]
    ranks = run_ranks(tmp_path, 2, post=True, **cfg)
    for result in [single, *ranks]:
        assert result["gradient_builder"] == "torch" and result["graphs"] == 2
    for result in ranks:
        assert _max_difference(result["all_weights"], single["all_weights"]) < FP16_TOLERANCE
        assert result["counters"] == single["counters"]


def test_float16_helpers():
    linear = torch.nn.Linear(2, 2)
    tied = torch.nn.Sequential(linear, linear)
    state = float16_state(tied)
    assert set(state) == {"0.weight", "0.bias", "1.weight", "1.bias"} and state["0.weight"] is state["1.weight"]
    assert {t.dtype for t in state.values()} == {torch.float16}
    x, label, tokens = torch.ones(2), torch.ones(2), torch.ones(2, dtype=torch.int64)
    cast = float16_inputs([x, tokens, label], label=True)
    assert [t.dtype for t in cast] == [torch.float16, torch.int64, torch.float32]
    Pair = namedtuple("Pair", "a b")
    back = float32_values(Pair(x.half(), [tokens, x.half()]))
    assert isinstance(back, Pair) and back.a.dtype == torch.float32 and back.b[1].dtype == torch.float32
