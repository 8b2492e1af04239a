"""ONNX Runtime's published training scripts, called as they call the trainer, on both runtimes (README § Legacy
scripts): the MNIST sample evaluates with the data alone, the getting-started `capi` script's wrong descriptions give
way to the real tensors with a warning, an opset the TorchScript exporter cannot meet is an error naming the op and
the opset that works, and `testORTTrainerDynamicShape`'s shorter sequences train. Models at test size
(tests/legacy_samples.py); numbers checked against PyTorch."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from legacy_samples import (
    MnistNet,
    TransformerLM,
    batchify,
    get_batch,
    mnist_desc,
    mnist_loss,
    transformer_desc_dynamic,
    transformer_loss,
)
from reference_optim import ReferenceLamb

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.capi import IODescription, ModelDescription
from orttrainer.capi import ORTTrainer as LegacyORTTrainer
from orttrainer.trainer.build.export import OpsetTooLowError
from orttrainer.trainer.runtime import has_training_build

NTOKENS, BPTT, BATCH = 64, 35, 4


def _cpu(extra: dict | None = None) -> ORTTrainerOptions:
    return ORTTrainerOptions({"device": {"id": "cpu"}, **(extra or {})})


def _mnist_batches(n: int, batch: int = 20):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def test_the_mnist_sample_evaluates_with_the_data_alone():
    torch.manual_seed(1)
    model = MnistNet()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, mnist_desc(), optim.SGDConfig(lr=0.01), loss_fn=mnist_loss, options=_cpu())
    data, target = _mnist_batches(1)[0]
    with pytest.raises(ValueError, match=r"without \['label'\]: the first step builds the model"):
        trainer.eval_step(data)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    for data, target in _mnist_batches(3):
        trainer.train_step(data, target)
        ref_opt.zero_grad()
        mnist_loss(reference(data), target).backward()
        ref_opt.step()
    data, target = _mnist_batches(1, batch=50)[0]  # the sample's test batches are larger
    with torch.no_grad():
        expected = reference(data)
    # the sample's test(): fetches around eval_step, so that the label need not be passed
    trainer._train_step_info.fetches = ["probability"]
    output = trainer.eval_step(data)
    trainer._train_step_info.fetches = []
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        trainer.eval_step(data), expected, rtol=1e-5, atol=1e-5
    )  # no fetches: the loss is left out
    loss, probability = trainer.eval_step(data, target)  # with the label, as before
    torch.testing.assert_close(probability, expected, rtol=1e-5, atol=1e-5)
    assert float(loss) == pytest.approx(float(mnist_loss(expected, target)), rel=1e-5)
    trainer._train_step_info.fetches = ["loss"]
    with pytest.raises(ValueError, match=r"without \['label'\]: the outputs \['loss'\] need them"):
        trainer.eval_step(data)


def test_the_capi_api_evaluates_with_the_data_alone():
    torch.manual_seed(1)
    model = MnistNet()
    descs = ModelDescription(
        [IODescription("input1", ["batch", 784], torch.float32), IODescription("label", ["batch"], torch.int64)],
        [IODescription("loss", [], torch.float32), IODescription("probability", ["batch", 10], torch.float32)],
    )
    lr_desc = IODescription("Learning_Rate", [1], torch.float32)
    trainer = LegacyORTTrainer(model, mnist_loss, descs, "SGDOptimizer", None, lr_desc, "cpu")
    data, target = _mnist_batches(1)[0]
    trainer.train_step(data, target, torch.tensor([0.01]))
    params = dict(model.named_parameters())
    with torch.no_grad():  # the trainer's weights after the step, in PyTorch
        for name, value in trainer.state_dict().items():
            if name in params:
                params[name].copy_(value)
        expected = model(data)
    torch.testing.assert_close(trainer.eval_step(data, fetches=["probability"]), expected, rtol=1e-5, atol=1e-5)


def _getting_started_descriptions(lr: float):
    """The getting-started `capi` script's descriptions, as published: its int64 tokens declared float32 and its
    flat label declared [bptt, batch_size, ntokens]."""
    input_desc = IODescription("input1", [BPTT, BATCH], torch.float32)
    label_desc = IODescription("label", [BPTT, BATCH, NTOKENS], torch.int64)
    loss_desc = IODescription("loss", [], torch.float32)
    prediction_desc = IODescription("prediction", [BPTT, BATCH, NTOKENS], torch.float32)
    return ModelDescription([input_desc, label_desc], [loss_desc, prediction_desc]), IODescription(
        "Learning_Rate", [lr], torch.float32
    )


def test_the_getting_started_capi_script_binds_the_real_tensors_with_a_warning():
    torch.manual_seed(0)
    model = TransformerLM(NTOKENS, 32, 2, 32, 1)
    reference = copy.deepcopy(model)
    lr = 0.001
    model_desc, lr_desc = _getting_started_descriptions(lr)
    loss_fn = transformer_loss(NTOKENS)
    trainer = LegacyORTTrainer(
        model, loss_fn, model_desc, "LambOptimizer", None, lr_desc, "cpu", _use_deterministic_compute=True
    )
    source = batchify(torch.randint(0, NTOKENS, (2000,), generator=torch.Generator().manual_seed(3)), BATCH)
    ref_opt = ReferenceLamb(list(reference.parameters()), lr=lr)
    for step, i in enumerate(range(0, 3 * BPTT, BPTT)):
        data, targets = get_batch(source, i)
        if step == 0:
            with pytest.warns(UserWarning) as seen:
                loss, _ = trainer.train_step(data, targets, torch.tensor([lr]))
            named = " ".join(str(w.message) for w in seen)
            assert "'input1' declares dtype torch.float32, but the input is torch.int64" in named
            assert f"'label' declares shape [{BPTT}, {BATCH}, {NTOKENS}], but the input has shape [{BPTT * BATCH}]" in (
                named
            )
        else:
            loss, _ = trainer.train_step(data, targets, torch.tensor([lr]))
        ref_opt.zero_grad()
        expected = loss_fn(reference(data), targets)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        assert float(loss) == pytest.approx(float(expected), rel=1e-4)
    data, targets = get_batch(source, 3 * BPTT)
    eval_loss = trainer.eval_step(data, targets, fetches=["loss"])
    with torch.no_grad():
        assert float(eval_loss) == pytest.approx(float(loss_fn(reference(data), targets)), rel=1e-4)


def test_an_opset_the_torchscript_exporter_cannot_meet_names_the_op_and_the_opset_that_works():
    """The transformer at the `capi` API's `_opset_version=12`: the TorchScript exporter has `aten::unflatten`
    from opset 13 and the model exports at 14. 'auto' does not move to the torch builder over it (that hid the
    real error). The maintained runtime trains with the torch builder, whose exporter writes opset 18 or later:
    the opset is a lower bound there (README § Gradient builders)."""
    torch.manual_seed(0)
    model = TransformerLM(NTOKENS, 32, 2, 32, 1)
    model_desc, lr_desc = _getting_started_descriptions(0.001)
    model_desc.inputs_[0].dtype_, model_desc.inputs_[1].shape_ = torch.int64, [BPTT * BATCH]
    trainer = LegacyORTTrainer(
        model, transformer_loss(NTOKENS), model_desc, "LambOptimizer", None, lr_desc, "cpu", _opset_version=12
    )
    data, targets = get_batch(batchify(torch.randint(0, NTOKENS, (2000,)), BATCH), 0)
    if has_training_build():
        with pytest.raises(OpsetTooLowError, match=r"'aten::unflatten' at opset 12; .* the model exports at opset 14"):
            trainer.train_step(data, targets, torch.tensor([0.001]))
        assert trainer.ort_trainer.gradient_builder is None  # nothing was built, no builder chosen behind the error
    else:
        loss, _ = trainer.train_step(data, targets, torch.tensor([0.001]))
        assert math.isfinite(float(loss)) and trainer.ort_trainer.gradient_builder == "torch"


@pytest.mark.parametrize("builder", ["auto", "torch"])
def test_the_dynamic_shape_test_of_the_original_ci_trains_shorter_sequences(builder):
    """`testORTTrainerDynamicShape`: each step drops i+1 positions from the sequence axis. The sample's causal mask
    is made with `torch.ones(sz, sz)`, which the TorchScript export fixes to the first length: the 'ort' builder
    exports the model again for each new length, the torch builder traces the mask's size symbolically."""
    torch.manual_seed(0)
    model = TransformerLM(NTOKENS, 32, 2, 32, 1)
    reference = copy.deepcopy(model)
    options = _cpu({"_internal_use": {"gradient_builder": builder}})
    trainer = ORTTrainer(
        model, transformer_desc_dynamic(NTOKENS), optim.LambConfig(lr=0.001), transformer_loss(NTOKENS), options
    )
    source = batchify(torch.randint(0, NTOKENS, (4000,), generator=torch.Generator().manual_seed(2)), BATCH)
    ref_opt = ReferenceLamb(list(reference.parameters()), lr=0.001)
    for i in range(4):
        data, targets = get_batch(source, i * BPTT)
        data = data[: -(i + 1)]
        targets = targets[: -(i + 1) * data.size(1)]
        loss, predictions = trainer.train_step(data, targets)
        ref_opt.zero_grad()
        expected = transformer_loss(NTOKENS)(reference(data), targets)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        assert list(predictions.shape) == [BPTT - i - 1, BATCH, NTOKENS]
        assert float(loss) == pytest.approx(float(expected), rel=1e-4)
    assert model.input1_mask is None or type(model.input1_mask) is torch.Tensor  # no traced tensor left behind
    data, targets = get_batch(source, 10 * BPTT)
    eval_loss, _ = trainer.eval_step(data[:20], targets[: 20 * BATCH])  # a length no step had
    with torch.no_grad():
        expected = transformer_loss(NTOKENS)(reference(data[:20]), targets[: 20 * BATCH])
    assert float(eval_loss) == pytest.approx(float(expected), rel=1e-4)
