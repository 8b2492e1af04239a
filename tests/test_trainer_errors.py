"""Bad input gets a clear error before anything runs, and leaves the trainer usable."""

from __future__ import annotations

import onnx
import pytest
import torch
from helpers import cpu_options, make_trainer, needs_training_build, trainer_weights
from models import MLP, mlp_desc

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.trainer.model import Unbuilt

CE = torch.nn.functional.cross_entropy
X, Y = torch.randn(8, 32), torch.randint(0, 10, (8,))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (None, mlp_desc(), optim.SGDConfig()),
            "'model' is required and must be either a 'torch.nn.Module' or ONNX model",
        ),
        ((MLP(), [], optim.SGDConfig()), "'model_desc' must be a 'dict'"),
        (
            (MLP(), mlp_desc(), {"lr": 1}),
            "'optim_config' is required and must be any of 'AdamConfig', 'LambConfig' or 'SGDConfig'",
        ),
        (
            (MLP(), mlp_desc(), optim.SGDConfig(), lambda pred: pred),
            "'loss_fn' must be either 'None' or a callable with two parameters",
        ),
        (
            (MLP(), mlp_desc(), optim.SGDConfig(), None, {"device": {"id": "cpu"}}),
            "'options' must be either 'None' or 'ORTTrainerOptions'",
        ),
        (
            (onnx.ModelProto(), mlp_desc(), optim.SGDConfig(), CE),
            "'loss_fn' must not be specified when 'model' is an ONNX model",
        ),
    ],
)
def test_constructor_arguments_are_checked_with_the_legacy_messages(args, message):
    with pytest.raises(AssertionError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        ORTTrainer(*args)


def test_a_model_of_another_type_is_rejected():
    with pytest.raises(ValueError, match="'model' must be either 'torch.nn.Module' or 'onnx.ModelProto'"):
        ORTTrainer("model.onnx", mlp_desc(), optim.SGDConfig())


def test_loss_functions_with_optional_extra_parameters_are_accepted():
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE)  # cross_entropy has 8 parameters
    assert trainer.train_step(X, Y)[0].shape == ()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda t: t.train_step(X), ValueError, r"expected 2 inputs \['x', 'target'\], got 1"),
        (lambda t: t.train_step(X, Y, Y), ValueError, r"expected 2 inputs \['x', 'target'\], got 3"),
        (lambda t: t.train_step(X, label=Y), TypeError, r"unexpected keyword input \['label'\]"),
        (lambda t: t.train_step(X, Y, x=X), TypeError, r"\['x'\] given both positionally and by keyword"),
        (lambda t: t.train_step(X.numpy(), Y), TypeError, "input 'x' must be a torch.Tensor, got ndarray"),
        (
            lambda t: t.train_step(torch.randn(8, 31), Y),
            ValueError,
            r"input 'x' has shape \[8, 31\], but model_desc declares \['batch', 32\]",
        ),
        (lambda t: t.train_step(torch.randn(8, 4, 32), Y), ValueError, r"\(rank 2\)"),
        (lambda t: t.train_step(X, Y[:4]), ValueError, "another input bound 'batch' to 8"),
        (lambda t: t.eval_step(), ValueError, r"expected 2 inputs"),  # the data alone is accepted (legacy scripts)
        (lambda t: t.eval_step(target=Y), ValueError, r"expected 2 inputs"),  # but not a later input alone
    ],
)
def test_bad_inputs_are_rejected_before_anything_runs(call, error, message):
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), CE)
    trainer.train_step(X, Y)
    before = trainer_weights(trainer)
    with pytest.raises(error, match=message):
        call(trainer)
    assert trainer._train_step_info.step == 1
    after = trainer_weights(trainer)
    assert all((before[k] == after[k]).all() for k in before)
    trainer.train_step(X, Y)  # still usable


def test_a_dtype_other_than_the_exported_one_is_rejected():
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE)
    trainer.train_step(X, Y)
    with pytest.raises(
        TypeError, match="input 'x' has dtype torch.float64, but the model was exported for torch.float32"
    ):
        trainer.train_step(X.double(), Y)
    with pytest.raises(TypeError, match="input 'target' has dtype torch.int32"):
        trainer.eval_step(X, Y.int())


def test_bad_inputs_on_the_first_step_fail_before_export():
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE)
    with pytest.raises(ValueError, match="model_desc declares"):
        trainer.train_step(torch.randn(8, 3), Y)
    assert trainer._onnx_model is None and trainer._training_session is None


def test_a_model_desc_input_that_forward_does_not_take_is_named():
    desc = {"inputs": [("inputs", ["batch", 32]), ("target", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(MLP(), desc, optim.SGDConfig(), CE)
    with pytest.raises(ValueError, match=r"model_desc inputs \['inputs'\] are not parameters of MLP.forward\(x\)"):
        trainer.train_step(X, Y)


def test_a_loss_that_is_not_a_scalar_is_rejected():
    trainer = make_trainer(
        MLP(), mlp_desc(), optim.SGDConfig(), lambda logits, target: CE(logits, target, reduction="none")
    )
    with pytest.raises(
        ValueError,
        match=r"the loss output 'loss' must be a scalar \(shape \[\]\), but the model "
        r"returns shape \[8\]",
    ):
        trainer.train_step(X, Y)


def test_more_described_outputs_than_the_model_returns():
    desc = mlp_desc()
    desc["outputs"].append(("extra", ["batch"]))
    with pytest.raises(
        ValueError,
        match=r"model_desc describes 3 outputs \['loss', 'logits', 'extra'\], but the "
        "model with its loss_fn returns 2",
    ):
        make_trainer(MLP(), desc, optim.SGDConfig(), CE).train_step(X, Y)


def test_a_model_desc_without_a_loss_output_fails_at_session_creation():
    desc = {"inputs": [("x", ["batch", 32])], "outputs": [("logits", ["batch", 10])]}
    trainer = make_trainer(MLP(), desc, optim.SGDConfig())
    with pytest.raises(AssertionError, match=r"^Only one loss output is supported \(0 were specified\)$"):
        trainer.train_step(X)


@needs_training_build
def test_an_op_without_a_gradient_is_named_with_its_node():
    class CumulativeHead(MLP):
        def forward(self, x):
            return torch.cumsum(super().forward(x), dim=1)

    trainer = make_trainer(
        CumulativeHead(), mlp_desc(), optim.SGDConfig(), CE, {"_internal_use": {"gradient_builder": "ort"}}
    )  # 'auto' would switch to 'torch'
    with pytest.raises(RuntimeError, match=r"cannot differentiate op 'CumSum' \(node '/model/CumSum'\)"):
        trainer.train_step(X, Y)


@needs_training_build
def test_custom_autograd_functions_are_refused_by_the_ort_gradient_builder():
    """The exporter inlines a Function's forward, so the 'ort' builder would ignore its backward: refused. 'auto'
    (the default) trains it with the torch builder instead (tests/test_trainer_torch_builder.py)."""

    class StraightThrough(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.round()

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Quantized(MLP):
        def forward(self, x):  # the Function sits on the gradient path of fc1
            return self.fc2(StraightThrough.apply(self.fc1(x)))

    trainer = make_trainer(
        Quantized(), mlp_desc(), optim.SGDConfig(), CE, {"_internal_use": {"gradient_builder": "ort"}}
    )
    with pytest.raises(
        NotImplementedError,
        match=r"Function\(s\) \['.*StraightThrough'\].*Set options "
        r"_internal_use.gradient_builder to 'torch' or 'auto'",
    ):
        trainer.train_step(X, Y)
    assert trainer._training_session is None


def test_unknown_frozen_weights_use_the_legacy_error():
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"utils": {"frozen_weights": ["fc9.weight"]}})
    with pytest.raises(
        RuntimeError,
        match=r"^\['fc9.weight'\] params from 'frozen_weights' not found in the ONNX "
        r"model.$",
    ):
        trainer.train_step(X, Y)


def test_onnx_model_descriptions_must_name_graph_inputs():
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["loss"])],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [])],
            [onnx.helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
        )
    )
    desc = {"inputs": [("input", [])], "outputs": [("loss", [], True)]}
    with pytest.raises(AssertionError, match=r"^ONNX model with unknown input type \(input\)$"):
        ORTTrainer(model, desc, optim.SGDConfig(), options=cpu_options())


def test_cuda_asked_for_without_cuda_is_a_clear_error():
    trainer = ORTTrainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, options=ORTTrainerOptions())  # device.id 'cuda'
    if torch.cuda.is_available():  # a GPU machine: the legacy default device works
        trainer.train_step(X.cuda(), Y.cuda())
        return
    with pytest.raises(RuntimeError, match=r"CUDA is not available here. Set options \{'device': \{'id': 'cpu'\}\}"):
        trainer.train_step(X, Y)


@pytest.mark.parametrize("builder", ["auto", "torch"])
def test_cuda_without_cuda_is_refused_before_the_model_is_exported_or_traced(builder, monkeypatch):
    """The first step checks the device before it exports or traces: the model's forward never runs, so a large
    model does not trace for seconds only to be refused at the session. (A GPU machine is made to say it has no
    CUDA.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []

    class Counted(MLP):
        def forward(self, x):
            calls.append(x.shape)
            return super().forward(x)

    options = ORTTrainerOptions({"_internal_use": {"gradient_builder": builder}})  # device.id 'cuda'
    trainer = ORTTrainer(Counted(), mlp_desc(), optim.SGDConfig(), CE, options=options)
    with pytest.raises(RuntimeError, match=r"options device.id asks for CUDA \(cuda:0\) but CUDA is not available"):
        trainer.train_step(X, Y)
    assert calls == []
    assert trainer._training_session is None


@pytest.mark.parametrize("device", ["gpu", "cuda:x"])
def test_a_malformed_device_id_is_rejected_in_the_constructor(device):
    with pytest.raises(ValueError, match=f"options device.id '{device}'"):
        ORTTrainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, options=ORTTrainerOptions({"device": {"id": device}}))


def test_eval_step_on_a_trainer_without_a_model_is_a_runtime_error():
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE)
    trainer._model = Unbuilt()  # neither a module nor a prepared ONNX model
    with pytest.raises(RuntimeError, match="^Model is uninitialized. Only ONNX and PyTorch models are supported$"):
        trainer.eval_step(X, Y)
