"""The older `onnxruntime.capi.ort_trainer.ORTTrainer` API (orttrainer.capi) on the new trainer: constructor
arguments, the learning rate as an input or from get_lr_this_step, fetches, __call__, state and checkpoints, and a
transformer trained with the older conventions matching the new API."""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import onnx
import pytest
import torch
from helpers import max_difference, needs_training_build, torch_weights
from models import MLP, TinyTransformer, transformer_loss

from orttrainer import ORTTrainer as NewORTTrainer
from orttrainer import ORTTrainerOptions, amp, optim
from orttrainer.capi import (
    IODescription,
    LossScaler,
    ModelDescription,
    ORTTrainer,
    get_checkpoint_name,
    list_checkpoint_files,
    load_checkpoint,
    save_checkpoint,
)
from orttrainer.trainer.runtime import has_training_build

ce = torch.nn.functional.cross_entropy
LR = IODescription("Learning_Rate", [1], torch.float32)


def mlp_description():
    return ModelDescription(
        [IODescription("input1", ["batch", 32], torch.float32), IODescription("label", ["batch"], torch.int64, 10)],
        [IODescription("loss", [], torch.float32), IODescription("probs", ["batch", 10], torch.float32)],
    )


def legacy_mlp(optimizer="SGDOptimizer", attributes=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = MLP()
    return model, ORTTrainer(model, ce, mlp_description(), optimizer, attributes, LR, "cpu", **kwargs)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


def weights(trainer):
    return {k: v.numpy() for k, v in trainer.state_dict(include_optimizer_state=False).items()}


# --- constructor ----------------------------------------------------------------------------------------------------
def test_arguments_reach_the_new_trainer(tmp_path):
    _, trainer = legacy_mlp(
        "AdamOptimizer",
        gradient_accumulation_steps=3,
        enable_grad_norm_clip=False,
        frozen_weights=["fc1.bias"],
        _opset_version=13,
        _use_deterministic_compute=True,
        optimized_model_filepath=str(tmp_path / "opt.onnx"),
        global_step=7,
    )
    opts = trainer.ort_trainer.options
    assert opts.batch.gradient_accumulation_steps == 3 and opts.utils.grad_norm_clip is False
    assert opts.utils.frozen_weights == ["fc1.bias"] and opts.debug.deterministic_compute is True
    assert opts._internal_use.onnx_opset_version == 13 and opts.device.id == "cpu"
    assert trainer.global_step_ == 7 and trainer.device_ == torch.device("cpu")
    x, y = batches(1)[0]
    trainer.train_step(x, y, torch.tensor([0.01]))
    # the torch builder's graphs are opset >= 18, whatever the option (the dynamo exporter's lowest)
    opset = 13 if trainer.ort_trainer.gradient_builder == "ort" else 18
    assert trainer.onnx_model_.opset_import[0].version == opset and (tmp_path / "opt.onnx").exists()
    assert "fc1.bias" not in trainer.ort_trainer._built.compiled.training.weight_updates


def test_use_memory_efficient_gradient_reaches_the_option():
    """On both runtimes (the torch builder honours it too, README § Memory)."""
    _, trainer = legacy_mlp(use_memory_efficient_gradient=True)
    assert trainer.ort_trainer.options.utils.memory_efficient_gradient is True


def test_distributed_arguments_reach_the_distributed_layer(monkeypatch):
    """world_size > 1 goes to torch.distributed (2-process training itself is tested in test_distributed.py)."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised and MASTER_PORT is not set"):
        legacy_mlp(world_size=2, deepspeed_zero_stage=1, allreduce_post_accumulation=True)


def test_onnx_model_extra_postprocess_in_place_and_loss_fn_warning(tmp_path):
    source = NewORTTrainer(
        MLP(),
        {
            "inputs": [("x", ["batch", 32]), ("target", ["batch"])],
            "outputs": [("loss", [], True), ("probs", ["batch", 10])],
        },
        optim.SGDConfig(),
        loss_fn=ce,
        options=ORTTrainerOptions({"device": {"id": "cpu"}}),
    )
    source.eval_step(*batches(1)[0])
    source.save_as_onnx(str(tmp_path / "forward.onnx"))
    desc = ModelDescription(
        [IODescription("x", ["batch", 32]), IODescription("target", ["batch"])], mlp_description().outputs_
    )

    def touch(model):
        model.doc_string = "post-processed in place"

    with pytest.warns(UserWarning, match="loss_fn is not used when creating ORTTrainer because an ONNX model") as seen:
        trainer = ORTTrainer(
            onnx.load(str(tmp_path / "forward.onnx")),
            ce,
            desc,
            "SGDOptimizer",
            None,
            LR,
            torch.device("cpu"),
            _extra_postprocess=touch,
        )
    assert seen[0].filename == __file__  # the warning points at the constructor call
    # the 'ort' builder compiles an ONNX model at construction, the torch builder (no onnxruntime-training) on the
    # first step (README: ONNX models on the torch builder)
    assert (trainer.session is not None) == has_training_build()
    assert trainer.onnx_model_.doc_string == "post-processed in place"
    loss, probs = trainer.train_step(*batches(1)[0], torch.tensor([0.1]))
    assert loss.shape == () and probs.shape == (8, 10) and trainer.session is not None
    trainer = ORTTrainer(
        onnx.load(str(tmp_path / "forward.onnx")), None, desc, "SGDOptimizer", None, LR, "cpu", postprocess_model=touch
    )
    assert trainer.onnx_model_.doc_string == "post-processed in place"


def test_constructor_errors_and_ignored_loss_scaler():
    with pytest.raises(TypeError, match="learning_rate_description must be an IODescription"):
        ORTTrainer(MLP(), ce, mlp_description(), "SGDOptimizer", None, "lr", "cpu")
    with pytest.raises(TypeError, match="ModelDescription"):
        ORTTrainer(MLP(), ce, {"inputs": []}, "SGDOptimizer", None, LR, "cpu")
    with pytest.warns(UserWarning, match="loss_scaler is ignored"):
        _, trainer = legacy_mlp(loss_scaler=LossScaler("ls", True))
    assert trainer.loss_scaler_ is None


# --- train_step / eval_step conventions -----------------------------------------------------------------------------
def test_learning_rate_input_trains_like_pytorch_sgd():
    model, trainer = legacy_mlp()
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(reference.parameters(), lr=1.0)
    for i, (x, y) in enumerate(batches(6)):
        lr = [0.1, 0.05, 0.02][i % 3]
        if i % 3 == 0:
            trainer.train_step(x, y, torch.tensor([lr]))  # positional
        elif i % 3 == 1:
            trainer.train_step(input1=x, label=y, Learning_Rate=torch.tensor([lr]))  # by description name
        else:
            trainer.train_step([x, y, torch.tensor([lr])])  # one list
        for group in sgd.param_groups:
            group["lr"] = lr
        sgd.zero_grad()
        ce(reference(x), y).backward()
        sgd.step()
    assert max_difference(weights(trainer), torch_weights(reference)) < 1e-5
    assert trainer.current_step == 6 and trainer.global_step_ == 6


def test_get_lr_this_step_sees_global_step_of_applied_updates():
    seen = []
    _, trainer = legacy_mlp(
        gradient_accumulation_steps=2, global_step=5, get_lr_this_step=lambda step: seen.append(step) or 0.01
    )
    for x, y in batches(5):
        trainer.train_step(x, y)
    assert seen == [5, 5, 6, 6, 7] and trainer.global_step_ == 7 and trainer.current_step == 5
    x, y = batches(1)[0]
    with pytest.raises(TypeError, match="get_lr_this_step is set"):
        trainer.train_step(x, y, torch.tensor([0.1]))
    with pytest.raises(TypeError, match="get_lr_this_step is set"):
        trainer.train_step(x, y, Learning_Rate=torch.tensor([0.1]))


def test_input_errors():
    _, trainer = legacy_mlp()
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match=r"expected 3 inputs \['input1', 'label', 'Learning_Rate'\], got 2"):
        trainer.train_step(x, y)
    with pytest.raises(ValueError, match="learning rate input must hold one value"):
        trainer.train_step(x, y, torch.tensor([0.1, 0.2]))
    with pytest.raises(TypeError, match="fetches must be a list of output names"):
        trainer.train_step(x, y, torch.tensor([0.1]), fetches="loss")


def test_fetches_come_back_in_fetches_order():
    _, trainer = legacy_mlp()
    x, y = batches(1)[0]
    loss, probs = trainer.eval_step(x, y)
    probs2, loss2 = trainer.eval_step(x, y, fetches=["probs", "loss"])
    assert torch.equal(probs, probs2) and torch.equal(loss, loss2)
    assert torch.equal(trainer.eval_step(x, y, fetches=["loss"]), loss)
    train_probs, train_loss = trainer.train_step(x, y, torch.tensor([0.0]), fetches=["probs", "loss"])
    assert torch.allclose(train_loss, loss, atol=1e-6) and train_probs.shape == (8, 10)
    with pytest.raises(RuntimeError, match="invalid output names"):
        trainer.eval_step(x, y, fetches=["nope"])
    assert trainer.ort_trainer._train_step_info.fetches == []  # restored after each call


def test_call_dispatches_on_train_and_eval_mode():
    _, trainer = legacy_mlp()
    x, y = batches(1)[0]
    loss, _ = trainer(x, y, torch.tensor([0.5]))
    before = weights(trainer)
    trainer.eval()
    eval_loss, _ = trainer(x, y, torch.tensor([0.5]))  # a trailing learning rate is accepted and ignored
    assert max_difference(weights(trainer), before) == 0 and not torch.equal(loss, eval_loss)
    trainer.train()
    trainer(x, y, torch.tensor([0.5]))
    assert max_difference(weights(trainer), before) > 0


# --- state ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "optimizer, counters",
    [("AdamOptimizer", {"Update_Count_fc1.weight"}), ("LambOptimizer", {"Step"}), ("SGDOptimizer", set())],
)
def test_state_dict_is_flat_with_optimizer_tensors(optimizer, counters):
    _, trainer = legacy_mlp(optimizer)
    with pytest.warns(UserWarning, match="not initialized yet"):
        assert trainer.state_dict() == {}
    trainer.train_step(*batches(1)[0], torch.tensor([0.01]))
    state = trainer.state_dict()
    params = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert params <= set(state) and all(isinstance(v, torch.Tensor) for v in state.values())
    assert counters <= set(state)
    assert ("Moment_1_fc2.bias" in state) == (optimizer != "SGDOptimizer")
    assert set(trainer.state_dict(include_optimizer_state=False)) == params


def test_load_state_dict_before_and_after_the_first_step():
    _, source = legacy_mlp("AdamOptimizer", seed=0)
    for x, y in batches(3):
        source.train_step(x, y, torch.tensor([0.01]))
    _, target = legacy_mlp("AdamOptimizer", seed=5)
    target.load_state_dict(source.state_dict())  # deferred until the session exists
    x, y = batches(1, seed=9)[0]
    assert torch.equal(target.eval_step(x, y)[0], source.eval_step(x, y)[0])
    for trainer in (source, target):
        trainer.train_step(x, y, torch.tensor([0.01]))
    assert max_difference(weights(target), weights(source)) == 0
    with pytest.raises(RuntimeError, match="Checkpoint tensor: nope is not present in the model."):
        target.load_state_dict({"nope": torch.zeros(1)}, strict=True)


def test_checkpoint_helpers_resume_exactly(tmp_path):
    _, trainer = legacy_mlp("LambOptimizer", gradient_accumulation_steps=2)
    data = batches(8)
    for x, y in data[:4]:
        trainer.train_step(x, y, torch.tensor([0.01]))
    extra = {"epoch": 3}
    save_checkpoint(trainer, str(tmp_path), checkpoint_state_dict=extra)
    assert extra == {"epoch": 3} and os.listdir(tmp_path) == [get_checkpoint_name("ORT_checkpoint", False)]
    assert list_checkpoint_files(str(tmp_path), "ORT_checkpoint") == [str(tmp_path / "ORT_checkpoint.ort.pt")]
    for x, y in data[4:]:
        trainer.train_step(x, y, torch.tensor([0.01]))
    _, resumed = legacy_mlp("LambOptimizer", seed=3, gradient_accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the older API's helpers do not warn
        assert load_checkpoint(resumed, str(tmp_path)) == {"epoch": 3}
    for x, y in data[4:]:
        resumed.train_step(x, y, torch.tensor([0.01]))
    assert max_difference(weights(resumed), weights(trainer)) == 0


def test_checkpoint_helper_errors(tmp_path):
    _, trainer = legacy_mlp()
    with pytest.raises(AssertionError, match="ERROR: Checkpoint directory doesn't exist: /nonexistent"):
        save_checkpoint(trainer, "/nonexistent")
    with pytest.raises(AssertionError, match=f'No checkpoint files found with prefix "ck" in directory {tmp_path}.'):
        list_checkpoint_files(str(tmp_path), "ck")
    with pytest.raises(TypeError, match="orttrainer.capi.ORTTrainer"):
        save_checkpoint(trainer.ort_trainer, str(tmp_path))
    assert get_checkpoint_name("ck", True, 1, 4) == "ck.ZeRO.1.3.ort.pt"


class _NotPlainData:
    """Any object that is not plain data: loading it needs trusted=True."""

    def __eq__(self, other):
        return isinstance(other, _NotPlainData)


def test_checkpoint_helpers_load_objects_only_when_trusted(tmp_path):
    _, trainer = legacy_mlp()
    trainer.train_step(*batches(1)[0], torch.tensor([0.01]))
    save_checkpoint(trainer, str(tmp_path), checkpoint_state_dict={"obj": _NotPlainData()})
    _, resumed = legacy_mlp()
    with pytest.raises(Exception, match="_NotPlainData"):
        load_checkpoint(resumed, str(tmp_path))
    assert load_checkpoint(resumed, str(tmp_path), trusted=True) == {"obj": _NotPlainData()}


# --- the transformer: older conventions vs the new API -------------------------------------------------------------
STEPS, TOTAL_UPDATES, WARMUP, BASE_LR = 12, 6, 0.3, 3e-3


def _schedule(step: int) -> float:
    """LinearWarmupLRScheduler(TOTAL_UPDATES, WARMUP) written out, as a legacy script would."""
    n_w = WARMUP * TOTAL_UPDATES
    factor = step / max(1, n_w) if step < n_w else max(0.0, (TOTAL_UPDATES - step) / max(1, TOTAL_UPDATES - n_w))
    return BASE_LR * factor


def _no_decay(name: str) -> bool:
    return "bias" in name or "norm" in name


def _transformer_batches():
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)) for _ in range(STEPS)
    ]


def _train_new(model):
    no_decay = [n for n, _ in model.named_parameters() if _no_decay(n)]
    config = optim.LambConfig([{"params": no_decay, "lambda_coef": 0.0}], lr=BASE_LR, lambda_coef=0.01)
    options = ORTTrainerOptions(
        {
            "device": {"id": "cpu"},
            "batch": {"gradient_accumulation_steps": 2},
            "lr_scheduler": optim.LinearWarmupLRScheduler(TOTAL_UPDATES, WARMUP),
        }
    )
    desc = {
        "inputs": [("tokens", ["batch", "seq"]), ("target", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("logits", ["batch", "seq", 50])],
    }
    trainer = NewORTTrainer(model, desc, config, loss_fn=transformer_loss, options=options)
    for tokens, target in _transformer_batches():
        trainer.train_step(tokens, target)
    return {k: v.numpy() for k, v in trainer.state_dict(pytorch_format=True).items()}


def _train_legacy(model, lr_as_input: bool):
    desc = ModelDescription(  # names unlike forward's parameter (`tokens`): fed by position, as the original did
        [
            IODescription("input_ids", ["batch", "seq"], torch.int64, num_classes=50),
            IODescription("labels", ["batch", "seq"], torch.int64, num_classes=50),
        ],
        [IODescription("loss", [], torch.float32), IODescription("logits", ["batch", "seq", 50], torch.float32)],
    )

    def attributes(name):
        return {"alpha": 0.9, "beta": 0.999, "lambda": 0.0 if _no_decay(name) else 0.01, "epsilon": 1e-6}

    trainer = ORTTrainer(
        model,
        transformer_loss,
        desc,
        "LambOptimizer",
        attributes,
        IODescription("Learning_Rate", [1], torch.float32),
        torch.device("cpu"),
        gradient_accumulation_steps=2,
        get_lr_this_step=None if lr_as_input else _schedule,
    )
    for tokens, target in _transformer_batches():
        if lr_as_input:
            trainer.train_step(tokens, target, torch.tensor([_schedule(trainer.global_step_)]))
        else:
            trainer.train_step(input_ids=tokens, labels=target)
    assert trainer.global_step_ == STEPS // 2
    return weights(trainer)


@pytest.mark.parametrize("lr_as_input", [True, False])
def test_transformer_with_older_conventions_matches_the_new_api(lr_as_input):
    torch.manual_seed(0)
    model = TinyTransformer(dropout=0.1).eval()
    expected = _train_new(copy.deepcopy(model))
    actual = _train_legacy(copy.deepcopy(model), lr_as_input)
    initial = {n: p.detach().numpy() for n, p in model.named_parameters()}
    assert max_difference(actual, {k: expected[k] for k in actual}) < 1e-6
    assert max(float(np.abs(actual[k] - initial[k]).max()) for k in initial) > 1e-3  # it did train


# --- mixed precision ----------------------------------------------------------------------------------------------
def _overflowing_batch():
    g = torch.Generator().manual_seed(2)
    return 1e20 * torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)  # fp16 gradients: inf


@needs_training_build
def test_mixed_precision_with_a_legacy_loss_scaler_matches_the_new_api():
    scaler = LossScaler("loss_scale_input_name", True, loss_scale=8.0, up_scale_window=2)
    _, trainer = legacy_mlp("AdamOptimizer", use_mixed_precision=True, loss_scaler=scaler)
    torch.manual_seed(0)
    new_scaler = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=2)
    reference = NewORTTrainer(
        MLP(),
        {
            "inputs": [("x", ["batch", 32]), ("target", ["batch"])],
            "outputs": [("loss", [], True), ("probs", ["batch", 10])],
        },
        optim.AdamConfig(lr=1e-2),
        loss_fn=ce,
        options=ORTTrainerOptions(
            {"device": {"id": "cpu"}, "mixed_precision": {"enabled": True, "loss_scaler": new_scaler}}
        ),
    )
    data = batches(5)
    data.insert(2, _overflowing_batch())
    for x, y in data:
        outputs = trainer.train_step(x, y, torch.tensor([1e-2]))
        reference.train_step(x, y)
        assert len(outputs) == 2  # the trainer keeps the scale: no all-finite flag returned
        assert scaler.loss_scale_ == new_scaler.loss_scale
    assert scaler.loss_scale_ == 16.0 and trainer.global_step_ == 5  # 8 -> 16 -> 8 (overflow) -> 16; 1 skipped
    assert max_difference(weights(trainer), {k: v.numpy() for k, v in reference.state_dict(True).items()}) == 0


@needs_training_build
def test_mixed_precision_caller_feeds_the_loss_scale_and_gets_all_finite():
    _, trainer = legacy_mlp("SGDOptimizer", use_mixed_precision=True, gradient_accumulation_steps=2)
    x, y = batches(1)[0]
    lr, scale = torch.tensor([0.1]), torch.tensor([128.0])
    assert len(trainer.train_step(x, y, lr, scale)) == 2  # accumulation step
    loss, probs, all_finite = trainer.train_step(x, y, lr, default_loss_scale_input_name=scale)
    assert all_finite.tolist() == [True] and probs.dtype == torch.float16 and trainer.global_step_ == 1
    before = weights(trainer)
    big_x, big_y = _overflowing_batch()
    trainer.train_step(big_x, big_y, lr, scale)
    *_, all_finite = trainer.train_step(big_x, big_y, lr, scale)
    assert all_finite.tolist() == [False] and trainer.global_step_ == 1
    assert max_difference(weights(trainer), before) == 0  # the overflowing update was not applied
    assert len(trainer.train_step(x, y, lr, scale, fetches=["loss"]).shape) == 0  # fetches: just those outputs
    trainer.eval()
    assert len(trainer(x, y, lr, scale)) == 2  # eval ignores the learning rate and the loss scale
    with pytest.raises(ValueError, match=r"expected 4 inputs .*'default_loss_scale_input_name'\], got 3"):
        trainer.train_step(x, y, lr)
