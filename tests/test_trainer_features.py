"""ORTTrainer features: accumulation, parameter groups, frozen weights, ONNX-model input, fetches, save_as_onnx,
LR schedulers, eval semantics and the input conventions of docs/legacy_api.md §3.5–§3.9."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import (
    clone,
    export_training_onnx,
    make_trainer,
    max_difference,
    needs_training_build,
    torch_weights,
    trainer_weights,
)
from models import MLP, mlp_batches, mlp_desc

from orttrainer import optim
from orttrainer.optim import LinearWarmupLRScheduler
from orttrainer.trainer.runtime import ort_private

CE = torch.nn.functional.cross_entropy


@pytest.mark.parametrize("config", [optim.SGDConfig(lr=0.1), optim.AdamConfig(lr=1e-2)], ids=["sgd", "adam"])
def test_accumulation_of_four_equals_one_step_on_the_concatenation(config):
    torch.manual_seed(0)
    model = MLP()
    micro = mlp_batches(4, batch=4)
    accumulating = make_trainer(clone(model), mlp_desc(), config, CE, {"batch": {"gradient_accumulation_steps": 4}})
    single = make_trainer(clone(model), mlp_desc(), config, CE)
    initial = torch_weights(model)
    for i, (x, y) in enumerate(micro):
        accumulating.train_step(x, y)
        if i < 3:  # micro-steps accumulate only
            assert max_difference(trainer_weights(accumulating), initial) == 0.0
            assert accumulating._train_step_info.optimization_step == 0
    single.train_step(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))
    assert accumulating._train_step_info.optimization_step == 1
    assert max_difference(trainer_weights(accumulating), trainer_weights(single)) < 1e-5
    assert max_difference(trainer_weights(accumulating), initial) > 1e-3


def test_accumulation_continues_over_several_windows_like_pytorch():
    torch.manual_seed(0)
    model = MLP()
    reference = clone(model)
    trainer = make_trainer(
        model,
        mlp_desc(),
        optim.AdamConfig(lr=1e-2),
        CE,
        {"batch": {"gradient_accumulation_steps": 3}, "utils": {"grad_norm_clip": False}},
    )
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(mlp_batches(9)):
        trainer.train_step(x, y)
        (CE(reference(x), y) / 3).backward()
        if (i + 1) % 3 == 0:
            ref_opt.step()
            ref_opt.zero_grad()
    assert trainer._train_step_info.step == 9 and trainer._train_step_info.optimization_step == 3
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5


def test_two_parameter_groups_use_their_own_hyper_parameters():
    torch.manual_seed(0)
    model = MLP()
    reference = clone(model)
    config = optim.AdamConfig(
        params=[{"params": ["fc1.weight", "fc1.bias"], "alpha": 0.8, "lambda_coef": 0.1}], lr=5e-3
    )
    trainer = make_trainer(model, mlp_desc(), config, CE, {"utils": {"grad_norm_clip": False}})
    ref_opt = torch.optim.AdamW(
        [
            {"params": [reference.fc1.weight, reference.fc1.bias], "betas": (0.8, 0.999), "weight_decay": 0.1},
            {"params": [reference.fc2.weight, reference.fc2.bias], "betas": (0.9, 0.999), "weight_decay": 0.0},
        ],
        lr=5e-3,
    )
    for x, y in mlp_batches(10):
        trainer.train_step(x, y)
        ref_opt.zero_grad()
        CE(reference(x), y).backward()
        ref_opt.step()
    assert len(trainer._built.compiled.training.weight_updates) == 4
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-5


def test_frozen_weights_and_requires_grad_false_parameters_stay_unchanged():
    torch.manual_seed(0)
    model = MLP()
    model.fc2.bias.requires_grad_(False)
    reference = clone(model)
    reference.fc1.weight.requires_grad_(False)
    initial = torch_weights(model)
    trainer = make_trainer(
        model, mlp_desc(), optim.SGDConfig(lr=0.1), CE, {"utils": {"frozen_weights": ["fc1.weight"]}}
    )
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for x, y in mlp_batches(5):
        trainer.train_step(x, y)
        ref_opt.zero_grad()
        CE(reference(x), y).backward()
        ref_opt.step()
    state = trainer._training_session.get_state()
    assert np.array_equal(state["fc1.weight"], initial["fc1.weight"])
    assert np.array_equal(state["fc2.bias"], initial["fc2.bias"])
    assert sorted(trainer._built.compiled.training.weight_updates) == ["fc1.bias", "fc2.weight"]
    assert max_difference({k: state[k] for k in initial}, torch_weights(reference)) < 1e-6


class _ModelWithLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x, target):
        logits = self.mlp(x)
        return CE(logits, target), logits


def _export_with_loss(model: torch.nn.Module) -> onnx.ModelProto:
    axes = {"x": {0: "batch"}, "target": {0: "batch"}, "logits": {0: "batch"}}
    return export_training_onnx(model, tuple(mlp_batches(1)[0]), ["x", "target"], ["loss", "logits"], axes)


def test_an_onnx_model_with_a_loss_output_trains_like_pytorch():
    torch.manual_seed(0)
    model = _ModelWithLoss()
    reference = clone(model)
    trainer = make_trainer(_export_with_loss(model), mlp_desc(), optim.SGDConfig(lr=0.1))
    # with ONNX Runtime's gradient builder an ONNX model gets its session in the constructor; the torch builder
    # (without the training build) compiles on the first step
    assert (trainer._training_session is not None) == ort_private.has_training_build()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in mlp_batches(10):
        loss, logits = trainer.train_step(x, y)
        ref_opt.zero_grad()
        ref_loss, _ = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
    assert trainer.model_desc.inputs[0].dtype == torch.float32 and trainer.model_desc.inputs[1].dtype == torch.int64
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-6


def test_fetches_select_outputs_in_fetches_order_for_train_and_model_desc_order_for_eval():
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), CE)
    x, y = mlp_batches(1)[0]
    trainer.train_step(x, y)
    trainer._train_step_info.fetches = ["logits"]
    logits = trainer.train_step(x, y)
    assert isinstance(logits, torch.Tensor) and logits.shape == (8, 10)
    trainer._train_step_info.fetches = ["logits", "loss"]
    first, second = trainer.train_step(x, y)
    assert first.shape == (8, 10) and second.shape == ()
    first, second = trainer.eval_step(x, y)
    assert first.shape == () and second.shape == (8, 10)
    trainer._train_step_info.fetches = ["nope"]
    with pytest.raises(RuntimeError, match="^The specified fetches list contains invalid output names$"):
        trainer.train_step(x, y)
    trainer._train_step_info.fetches = []
    assert len(trainer.train_step(x, y)) == 2
    assert trainer._train_step_info.optimization_step == 4  # a fetches step still trains


def test_save_as_onnx_reloads_into_a_new_trainer_with_identical_eval_outputs(tmp_path):
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(lr=1e-2), CE)
    batches = mlp_batches(4)
    for x, y in batches[:3]:
        trainer.train_step(x, y)
    path = str(tmp_path / "model.onnx")
    trainer.save_as_onnx(path)
    reloaded = make_trainer(onnx.load(path), mlp_desc(), optim.AdamConfig(lr=1e-2))
    x, y = batches[3]
    for ours, theirs in zip(trainer.eval_step(x, y), reloaded.eval_step(x, y), strict=True):
        assert torch.equal(ours, theirs)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    loss = session.run(["loss"], {"x": x.numpy(), "target": y.numpy()})[0]
    np.testing.assert_allclose(loss, trainer.eval_step(x, y)[0].numpy(), rtol=1e-6)


def test_save_as_onnx_before_the_first_step_or_to_a_bad_path_warns_and_writes_nothing(tmp_path):
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), CE)
    path = tmp_path / "model.onnx"
    with pytest.warns(UserWarning, match="Training session is not initialized yet"):
        trainer.save_as_onnx(str(path))
    assert not path.exists()
    trainer.train_step(*mlp_batches(1)[0])
    with pytest.warns(UserWarning, match="'path' is not valid or does not exist"):
        trainer.save_as_onnx(str(tmp_path / "missing_dir" / "model.onnx"))
    with pytest.raises(AssertionError, match="'path' must be a valid path string"):
        trainer.save_as_onnx(path)
    assert list(tmp_path.iterdir()) == []


def test_an_lr_scheduler_drives_the_learning_rate_per_optimization_step():
    torch.manual_seed(0)
    model = MLP()
    reference = clone(model)
    scheduler = LinearWarmupLRScheduler(total_steps=8, warmup=0.25)
    trainer = make_trainer(
        model,
        mlp_desc(),
        optim.SGDConfig(lr=0.1),
        CE,
        {"lr_scheduler": scheduler, "batch": {"gradient_accumulation_steps": 2}},
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    seen = []
    for i, (x, y) in enumerate(mlp_batches(8)):
        trainer.train_step(x, y)
        seen.append(scheduler.get_last_lr()[0])
        (CE(reference(x), y) / 2).backward()
        if i % 2 == 1:
            s = i // 2  # optimization_step before this update
            ref_opt.param_groups[0]["lr"] = 0.1 * (s / 2 if s < 2 else (8 - s) / 6)
            ref_opt.step()
            ref_opt.zero_grad()
    assert seen == pytest.approx([0.0, 0.0, 0.05, 0.05, 0.1, 0.1, 0.1 * 5 / 6, 0.1 * 5 / 6])
    assert max_difference(trainer_weights(trainer), torch_weights(reference)) < 1e-6


class _DropoutMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))


def test_eval_step_disables_dropout_and_changes_nothing():
    torch.manual_seed(0)
    model = _DropoutMLP()
    trainer = make_trainer(model, mlp_desc(), optim.SGDConfig(lr=0.1), CE)
    x, y = mlp_batches(1)[0]
    first = trainer.eval_step(x, y)
    weights = trainer_weights(trainer)
    second = trainer.eval_step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert max_difference(trainer_weights(trainer), weights) == 0.0
    assert trainer._train_step_info.step == 0
    expected = model.eval()(x)
    torch.testing.assert_close(first[1], expected, rtol=1e-5, atol=1e-6)


def test_dropout_is_on_in_training_unless_the_model_was_handed_over_in_eval_mode():
    torch.manual_seed(0)
    x, y = mlp_batches(1)[0]
    training = make_trainer(_DropoutMLP(), mlp_desc(), optim.SGDConfig(lr=0.0), CE)
    assert not torch.equal(training.train_step(x, y)[1], training.eval_step(x, y)[1])
    evaluating = make_trainer(_DropoutMLP().eval(), mlp_desc(), optim.SGDConfig(lr=0.0), CE)
    # the torch builder's training graph (direct translation) and eval graph (torch.onnx) may round differently
    torch.testing.assert_close(evaluating.train_step(x, y)[1], evaluating.eval_step(x, y)[1], rtol=1e-6, atol=1e-6)


def test_positional_keyword_and_list_inputs_are_equivalent():
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(lr=0.1), CE)
    x, y = mlp_batches(1)[0]
    expected = trainer.eval_step(x, y)
    for result in (trainer.eval_step(x, target=y), trainer.eval_step([x, y]), trainer.eval_step(target=y, x=x)):
        assert all(torch.equal(a, b) for a, b in zip(expected, result, strict=True))


def test_single_output_is_returned_unwrapped_and_counters_follow_the_legacy_rules():
    torch.manual_seed(0)
    desc = {"inputs": [("x", ["batch", 32]), ("target", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(MLP(), desc, optim.SGDConfig(lr=0.1), CE, {"batch": {"gradient_accumulation_steps": 3}})
    results = [trainer.train_step(x, y) for x, y in mlp_batches(7)]
    assert all(isinstance(r, torch.Tensor) and r.shape == () and r.dtype == torch.float32 for r in results)
    assert (trainer._train_step_info.step, trainer._train_step_info.optimization_step) == (7, 2)


def test_returned_tensors_are_not_overwritten_by_later_steps():
    torch.manual_seed(0)
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(lr=1e-2), CE)
    batches = mlp_batches(6)
    loss, logits = trainer.train_step(*batches[0])
    kept = loss.clone(), logits.clone()
    for x, y in batches[1:]:
        trainer.train_step(x, y)
    assert torch.equal(loss, kept[0]) and torch.equal(logits, kept[1])


@needs_training_build
def test_debug_graph_save_paths_write_the_four_stages(tmp_path, monkeypatch):
    # the plain-op update in the graph and ONNX Runtime's cross-entropy kernels (the default update runs in torch
    # and the loss as plain ops: tests/test_rewrites_trainer.py checks the stages then)
    monkeypatch.setenv("ORTTRAINER_OPTIMIZER_UPDATE", "graph")
    monkeypatch.setenv("ORTTRAINER_DISABLE_REWRITES", "cross_entropy_as_plain_ops")
    names = [
        "model_after_graph_transforms_path",
        "model_with_gradient_graph_path",
        "model_with_training_graph_path",
        "model_with_training_graph_after_optimization_path",
    ]
    paths = {name: str(tmp_path / f"{name}.onnx") for name in names}
    trainer = make_trainer(MLP(), mlp_desc(), optim.AdamConfig(), CE, {"debug": {"graph_save_paths": paths}})
    trainer.train_step(*mlp_batches(1)[0])
    ops = {name: {n.op_type for n in onnx.load(path).graph.node} for name, path in paths.items()}
    assert "GeluGrad" not in ops["model_after_graph_transforms_path"]
    assert {"Gemm", "SoftmaxCrossEntropyLossGrad"} <= ops["model_with_gradient_graph_path"]
    assert "Sqrt" not in ops["model_with_gradient_graph_path"] and "Sqrt" in ops["model_with_training_graph_path"]
    assert ops["model_with_training_graph_after_optimization_path"]


@needs_training_build
def test_check_model_export_passes_for_a_faithful_export_and_fails_for_a_changed_graph():
    torch.manual_seed(0)
    x, y = mlp_batches(1)[0]
    make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"debug": {"check_model_export": True}}).train_step(x, y)

    def perturb(model: onnx.ModelProto) -> onnx.ModelProto:
        weight = next(i for i in model.graph.initializer if i.name == "fc2.bias")
        values = onnx.numpy_helper.to_array(weight) + 1.0
        weight.CopyFrom(onnx.numpy_helper.from_array(values, "fc2.bias"))
        return model

    broken = make_trainer(
        MLP(),
        mlp_desc(),
        optim.SGDConfig(),
        CE,
        {"debug": {"check_model_export": True}, "_internal_use": {"extra_postprocess": perturb}},
    )
    with pytest.raises(AssertionError, match="Mismatch between outputs of PyTorch model and exported ONNX model"):
        broken.train_step(x, y)


@needs_training_build
def test_run_symbolic_shape_infer_annotates_the_graph():
    torch.manual_seed(0)
    x, y = mlp_batches(1)[0]
    plain = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE)
    inferred = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"utils": {"run_symbolic_shape_infer": True}})
    plain.train_step(x, y)
    inferred.train_step(x, y)
    assert len(inferred._onnx_model.graph.value_info) > len(plain._onnx_model.graph.value_info)


def test_deterministic_compute_and_user_session_options_reach_onnxruntime():
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    trainer = make_trainer(
        MLP(), mlp_desc(), optim.SGDConfig(), CE, {"session_options": options, "debug": {"deterministic_compute": True}}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train_step(*mlp_batches(1)[0])
    assert options.use_deterministic_compute is True
    session_options = trainer._training_session.train_session.get_session_options()
    assert session_options.use_deterministic_compute and session_options.intra_op_num_threads == 1


@pytest.mark.parametrize("builder", [pytest.param("ort", marks=needs_training_build), "torch"])
def test_cpu_sessions_run_without_the_buffer_reuse_plan_and_leave_the_users_options_as_they_were(builder):
    """docs/engine.md §24: on the CPU every session (training and eval) frees each buffer when its tensor dies."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    extra = {"session_options": options, "_internal_use": {"gradient_builder": builder}}
    trainer = make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, extra)
    x, y = mlp_batches(1)[0]
    trainer.train_step(x, y)
    trainer.eval_step(x, y)
    session = trainer._training_session
    sessions = [session._runners.latest.session, session._evals.latest.session]
    for created in sessions:
        assert not created.get_session_options().enable_mem_reuse
        assert not created.get_session_options().enable_mem_pattern
    assert options.enable_mem_reuse and options.enable_mem_pattern  # the user's object is not changed


def test_the_legacy_wrapper_passes_inputs_to_forward_by_name():
    class Named(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, b, a):  # model_desc order differs from forward's order
            return self.fc(a - b)

    torch.manual_seed(0)
    model = Named()
    desc = {"inputs": [("a", ["n", 4]), ("b", ["n", 4]), ("target", ["n"])], "outputs": [("loss", [], True)]}
    trainer = make_trainer(model, desc, optim.SGDConfig(), CE)
    a, b, t = torch.randn(3, 4), torch.randn(3, 4), torch.tensor([0, 1, 0])
    torch.testing.assert_close(trainer.eval_step(a, b, t), CE(model(b=b, a=a), t))


def _log_softmax_nll_model() -> onnx.ModelProto:
    """logits = x @ W; loss = NegativeLogLikelihoodLoss(LogSoftmax(logits), target) — the pattern ORT cannot
    differentiate unless the internal post-processing fuses it."""
    rng = np.random.default_rng(0)
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "W"], ["logits"]),
        onnx.helper.make_node("LogSoftmax", ["logits"], ["log_prob"], axis=1),
        onnx.helper.make_node("NegativeLogLikelihoodLoss", ["log_prob", "target"], ["loss"], reduction="mean"),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "nll",
        [
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 32]),
            onnx.helper.make_tensor_value_info("target", onnx.TensorProto.INT64, ["batch"]),
        ],
        [onnx.helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
        [onnx.numpy_helper.from_array(rng.standard_normal((32, 10)).astype(np.float32), "W")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model


def test_internal_postprocess_fuses_log_softmax_and_nll_so_the_model_trains():
    desc = {"inputs": [("x", ["batch", 32]), ("target", ["batch"])], "outputs": [("loss", [], True)]}
    x, y = mlp_batches(1)[0]
    weight = torch.from_numpy(onnx.numpy_helper.to_array(_log_softmax_nll_model().graph.initializer[0]).copy())
    weight.requires_grad_(True)
    trainer = make_trainer(_log_softmax_nll_model(), desc, optim.SGDConfig(lr=0.5))
    trainer.train_step(x, y)
    CE(x @ weight, y).backward()
    np.testing.assert_allclose(
        trainer_weights(trainer)["W"], (weight - 0.5 * weight.grad).detach().numpy(), rtol=1e-5, atol=1e-6
    )
    unfused = {"_internal_use": {"enable_internal_postprocess": False, "gradient_builder": "ort"}}
    if ort_private.has_training_build():  # the torch builder (tests/test_onnx_model_torch_builder.py) needs no fusion
        with pytest.raises(RuntimeError, match="cannot differentiate op 'NegativeLogLikelihoodLoss'"):
            make_trainer(_log_softmax_nll_model(), desc, optim.SGDConfig(), extra=unfused)


def test_provider_options_are_merged_into_the_provider_list_given_to_onnxruntime(monkeypatch):
    from orttrainer.trainer.runtime.ort import Device, providers_for

    with monkeypatch.context() as patched:  # a build with the CUDA provider (the maintained CPU wheel has none)
        patched.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
        merged = providers_for(Device("cpu"), 0, {"CUDAExecutionProvider": {"b": 2}})
    assert merged == [
        ("CUDAExecutionProvider", {"b": "2"}),
        ("CPUExecutionProvider", {}),
    ]
    with pytest.raises(
        ValueError,
        match="provider_options names 'NoSuchExecutionProvider', which this onnxruntime build does not provide",
    ):  # ONNX Runtime itself would drop it silently; refused at construction
        make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"provider_options": {"NoSuchExecutionProvider": {}}})


@pytest.mark.parametrize(
    ("provider_options", "message"),
    [
        ({"CPUExecutionProvider": {"arena_extend_strategy": "1"}}, "CPU provider takes no options from Python"),
        ({"CUDAExecutionProvider": {"device_id": None}}, r"these are not: \['device_id'\]"),
        ({"CUDAExecutionProvider": ["device_id"]}, "must be a dict of option names to values, got list"),
    ],
)
def test_provider_options_that_onnxruntime_would_drop_are_refused_at_construction(provider_options, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(MLP(), mlp_desc(), optim.SGDConfig(), CE, {"provider_options": provider_options})


def test_parameters_without_a_path_to_the_loss_are_left_alone_like_pytorch():
    """Parameters the loss does not depend on get no gradient in PyTorch (grad None) and optimizers skip them."""
    model = _log_softmax_nll_model()
    extra = onnx.numpy_helper.from_array(np.ones((3,), np.float32), "unused_scale")
    model.graph.initializer.append(extra)
    model.graph.node.append(onnx.helper.make_node("Mul", ["unused_scale", "unused_scale"], ["side"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("side", onnx.TensorProto.FLOAT, [3]))
    desc = {"inputs": [("x", ["batch", 32]), ("target", ["batch"])], "outputs": [("loss", [], True), ("side", [3])]}
    # named at construction by the 'ort' builder, when the first step traces the graph by the torch builder
    with pytest.warns(UserWarning, match=r"parameters \['unused_scale'\] do not influence the loss"):
        trainer = make_trainer(model, desc, optim.AdamConfig(lambda_coef=0.1))
        trainer.train_step(*mlp_batches(1)[0])
    assert trainer._training_session.get_state(["unused_scale"])["unused_scale"].tolist() == [1.0, 1.0, 1.0]
    assert "unused_scale" in trainer.state_dict()["model"]["full_precision"]


def test_bool_inputs_and_outputs_cross_between_torch_and_onnxruntime():
    """DLPack bool is rejected by onnxruntime 1.19 and exported by it as uint8: both directions are bridged."""

    class Masked(MLP):
        def forward(self, x, mask):
            logits = super().forward(x)
            return logits.masked_fill(~mask[:, None], 0.0), mask.logical_not()

    torch.manual_seed(0)
    desc = {
        "inputs": [("x", ["batch", 32]), ("mask", ["batch"]), ("target", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", 10]), ("unmasked", ["batch"])],
    }

    def loss_fn(outputs, target):
        return CE(outputs[0], target)

    model = Masked()
    trainer = make_trainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn)
    x, y = mlp_batches(1)[0]
    mask = torch.arange(8) % 3 != 0
    loss, logits, unmasked = trainer.train_step(x, mask, y)
    assert unmasked.dtype == torch.bool and torch.equal(unmasked, ~mask)
    assert torch.equal(logits[~mask], torch.zeros(3, 10)) and logits[mask].abs().sum() > 0


def test_the_export_leaves_batch_norm_statistics_alone():
    """The TorchScript export runs the model once in training mode, which moves BatchNorm's running statistics; the
    user's module and the trainer's initial state must keep the values the model was handed over with."""

    class Normalised(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(64)

        def forward(self, x):
            return self.fc2(self.bn(self.fc1(x)))

    torch.manual_seed(0)
    model = Normalised()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    trainer = make_trainer(model, mlp_desc(), optim.SGDConfig(), CE)
    trainer.eval_step(*mlp_batches(1)[0])
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    state = trainer._training_session.get_state(["bn.running_mean", "bn.running_var"])
    assert all(np.array_equal(v, buffers[n].numpy()) for n, v in state.items())
