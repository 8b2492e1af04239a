"""Mixed precision on the CPU: overflow handling, loss-scale growth, fp32 parity, dtypes, and exact resume.

fp16 on CPU runs fp32 kernels between casts (slowly), so the models are small; the numerics are the point.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import (
    export_training_onnx,
    make_trainer,
    max_difference,
    needs_training_build,
    state_and_counters,
    torch_weights,
    trainer_weights,
)
from models import MLP, TinyTransformer, mlp_batches, mlp_desc, transformer_desc, transformer_loss

from orttrainer import amp, optim

CE = torch.nn.functional.cross_entropy
FP16_TOLERANCE = 5e-3  # max abs weight difference to an fp32 reference after 30 Adam steps at lr 1e-3


def _amp(scaler=None, **extra) -> dict:
    return {"mixed_precision": {"enabled": True, "loss_scaler": scaler}, **extra}


@needs_training_build
@pytest.mark.parametrize("accumulation", [1, 2])
def test_an_overflowing_step_changes_nothing_halves_the_scale_and_the_next_step_updates(accumulation):
    torch.manual_seed(0)
    scaler = amp.DynamicLossScaler(loss_scale=1024.0)
    trainer = make_trainer(
        MLP(),
        mlp_desc(),
        optim.AdamConfig(lr=1e-2),
        CE,
        _amp(scaler, batch={"gradient_accumulation_steps": accumulation}),
    )
    for x, y in mlp_batches(2 * accumulation, seed=5):
        trainer.train_step(x, y)
    assert trainer._train_step_info.optimization_step == 2 and scaler.loss_scale == 1024.0
    before = state_and_counters(trainer)
    overflow = mlp_batches(1, scale=1e20, seed=5)[0]  # gradients beyond the float range: not finite
    for _ in range(accumulation - 1):
        trainer.train_step(*mlp_batches(1, seed=9)[0])
    trainer.train_step(*overflow)
    after = state_and_counters(trainer)
    assert trainer._train_step_info.all_finite.tolist() == [False]
    assert scaler.loss_scale == 512.0
    assert trainer._train_step_info.optimization_step == 2
    assert trainer._train_step_info.step == 3 * accumulation
    for name, value in before.items():
        if name != "counters":
            assert np.array_equal(value, after[name]), name  # bit-identical, moments and buffers included
    trainer.train_step(*mlp_batches(1, seed=11)[0])
    if accumulation == 2:
        trainer.train_step(*mlp_batches(1, seed=12)[0])
    assert trainer._train_step_info.all_finite.tolist() == [True]
    assert trainer._train_step_info.optimization_step == 3
    assert max_difference(trainer_weights(trainer), {k: before[k] for k in trainer_weights(trainer)}) > 0


@needs_training_build
def test_the_scale_grows_after_each_window_of_finite_steps_up_to_the_cap():
    torch.manual_seed(0)
    scaler = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=3, max_loss_scale=32.0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), CE, _amp(scaler))
    seen = []
    for i, (x, y) in enumerate(mlp_batches(10, seed=5)):
        if i == 4:  # fetches do not stop the scaler (the original's scaler silently stopped updating with them)
            trainer._train_step_info.fetches = ["logits"]
        trainer.train_step(x, y)
        seen.append(scaler.loss_scale)
    assert seen == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 32.0, 32.0]


@needs_training_build
def test_a_scaler_with_automatic_update_off_keeps_its_scale():
    torch.manual_seed(0)
    scaler = amp.DynamicLossScaler(automatic_update=False, loss_scale=4.0, up_scale_window=1)
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), CE, _amp(scaler))
    for x, y in mlp_batches(3, seed=5):
        trainer.train_step(x, y)
    assert scaler.loss_scale == 4.0 and trainer._train_step_info.optimization_step == 3


@needs_training_build
def test_mixed_precision_tracks_fp32_on_the_transformer():
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.1).eval()
    reference = copy.deepcopy(model)
    trainer = make_trainer(
        model,
        transformer_desc(),
        optim.AdamConfig(lr=1e-3),
        transformer_loss,
        _amp(amp.DynamicLossScaler(loss_scale=1024.0)),
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        tokens, target = torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)
        loss, logits = trainer.train_step(tokens, target)
        ref_opt.zero_grad()
        ref_loss = transformer_loss(reference(tokens), target)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
    assert trainer._train_step_info.optimization_step == 30
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-3)
    ours, theirs = trainer_weights(trainer), torch_weights(reference)
    for name in [n for n in ours if n.endswith("self_attn.in_proj_bias")]:
        # the key bias has an identically zero gradient: only rounding noise, amplified by Adam (see the parity test)
        ours[name], theirs[name] = np.delete(ours[name], range(32, 64)), np.delete(theirs[name], range(32, 64))
    assert max_difference(ours, theirs) < FP16_TOLERANCE


@needs_training_build
def test_outputs_keep_their_graph_precision_and_model_desc_records_it():
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE, _amp())
    assert isinstance(trainer.options.mixed_precision.loss_scaler, amp.DynamicLossScaler)  # injected, as legacy did
    x, y = mlp_batches(1, seed=5)[0]
    loss, logits = trainer.train_step(x, y)
    assert (loss.dtype, logits.dtype) == (torch.float32, torch.float16)
    eval_loss, eval_logits = trainer.eval_step(x, y)
    assert (eval_loss.dtype, eval_logits.dtype) == (torch.float32, torch.float16)
    torch.testing.assert_close(eval_logits.float(), trainer_forward(trainer, x), rtol=2e-2, atol=2e-2)
    outputs = trainer.model_desc.outputs
    assert outputs[1].dtype_amp == torch.float16 and outputs[0].dtype_amp is None
    assert trainer.model_desc.loss_scale_input.name == trainer.options.mixed_precision.loss_scaler.input_name
    assert "all_gradients_finite" in trainer.model_desc.all_finite.name


def trainer_forward(trainer, x):
    model = MLP()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in trainer_weights(trainer).items()})
    return model(x)


def test_a_loss_scaler_without_mixed_precision_is_the_legacy_error():
    trainer = make_trainer(
        MLP(), mlp_desc(), optim.AdamConfig(), CE, {"mixed_precision": {"loss_scaler": amp.DynamicLossScaler()}}
    )
    with pytest.raises(ValueError, match="^Loss Scaler cannot be specified when Mixed Precision is not enabled$"):
        trainer.train_step(*mlp_batches(1, seed=5)[0])


@needs_training_build
def test_resume_under_mixed_precision_is_exact(tmp_path):
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(10, seed=5)
    batches[3] = mlp_batches(1, scale=1e20, seed=5)[
        0
    ]  # one overflow before the checkpoint: the scale must survive the resume

    def fresh():
        scaler = amp.DynamicLossScaler(loss_scale=1024.0, up_scale_window=3)
        return make_trainer(
            copy.deepcopy(model),
            mlp_desc(),
            optim.LambConfig(lr=1e-2),
            CE,
            _amp(scaler, batch={"gradient_accumulation_steps": 2}),
        )

    straight = fresh()
    for x, y in batches:
        straight.train_step(x, y)
    first = fresh()
    for x, y in batches[:5]:
        first.train_step(x, y)
    first.save_checkpoint(str(tmp_path / "amp.ortcp"))
    resumed = fresh()
    resumed.load_checkpoint(str(tmp_path / "amp.ortcp"))  # applied when the session is created, at the first step
    for i, (x, y) in enumerate(batches[5:]):
        resumed.train_step(x, y)
        if i == 0:
            assert resumed.options.mixed_precision.loss_scaler.loss_scale == 512.0
    assert max_difference(state_and_counters(resumed), state_and_counters(straight)) <= 1e-6
    scalers = [t.options.mixed_precision.loss_scaler for t in (resumed, straight)]
    assert scalers[0].loss_scale == scalers[1].loss_scale


@needs_training_build
def test_mixed_precision_checkpoints_load_into_fp32_trainers_and_back(tmp_path):
    torch.manual_seed(0)
    mixed = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(lr=1e-2), CE, _amp())
    for x, y in mlp_batches(3, seed=5):
        mixed.train_step(x, y)
    mixed.save_checkpoint(str(tmp_path / "mixed.ortcp"))
    full = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(lr=1e-2), CE)
    full.load_checkpoint(str(tmp_path / "mixed.ortcp"))
    x, y = mlp_batches(1, seed=20)[0]
    full.train_step(x, y)
    assert max_difference(trainer_weights(full), trainer_weights(mixed)) > 0  # trained on from the mixed weights
    full.save_checkpoint(str(tmp_path / "full.ortcp"))
    back = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(lr=1e-2), CE, _amp())
    back.load_checkpoint(str(tmp_path / "full.ortcp"))
    back.eval_step(x, y)
    assert max_difference(trainer_weights(back), trainer_weights(full)) == 0.0
    assert (
        back._state.counters.optimizer_updates
        == full._state.counters.optimizer_updates
        == mixed._state.counters.optimizer_updates + 1
    )


@needs_training_build
def test_an_onnx_model_trains_in_mixed_precision():

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP()

        def forward(self, x, target):
            logits = self.mlp(x)
            return CE(logits, target), logits

    torch.manual_seed(0)
    axes = {"x": {0: "batch"}, "target": {0: "batch"}, "logits": {0: "batch"}}
    model = export_training_onnx(WithLoss(), mlp_batches(1, seed=5)[0], ["x", "target"], ["loss", "logits"], axes)
    trainer = make_trainer(model, mlp_desc(), optim.SGDConfig(lr=0.1), None, _amp())
    losses = [trainer.train_step(x, y)[0].item() for x, y in mlp_batches(8, seed=5) * 3]
    assert losses[-1] < losses[0]
