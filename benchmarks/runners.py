"""The runners `run_all.py` compares. Each factory builds one on a workload and returns `(step, note, profile)`:
`step(x, target)` trains one step and returns the loss, `profile()` (or None) the kernel time per op type.

- `pytorch`: eager PyTorch as users run it: `torch.optim.Adam(params, lr)` (its default foreach implementation).
- `pytorch-fused`: eager PyTorch with `torch.optim.Adam(..., fused=True)`, the fastest Adam PyTorch has on a CPU.
- `torch.compile`: the model compiled by Inductor, Adam eager (foreach); its first step includes the compilation.
- `orttrainer[ort]`, `orttrainer[torch]`: ORTTrainer with each gradient builder and the default update path.
- `orttrainer[<builder>]+<variant>`: the same with one optimisation switched, to measure its effect: `graph-update`
  (`ORTTRAINER_OPTIMIZER_UPDATE=graph`, the plain-op update in the graph), `fused-update` (ONNX Runtime's AdamOptimizer
  kernel; orttrainer/trainer/update/path.py), `no-rewrites`, `no-static-shapes`, `no-cross-entropy`, `no-where-concat`,
  `no-summed-uses`, `no-noop-reductions`, `no-nchwc`, `no-conv-per-offset` (`ORTTRAINER_DISABLE_REWRITES`,
  orttrainer/trainer/graph/passes.py).
- `ort-training-api`: ONNX Runtime's on-device training API (`artifacts.generate_artifacts`, `Module`, `Optimizer`),
  its AdamW switched to PyTorch's formula (`adam_mode=0`).

Every runner does Adam with lr 1e-3, betas (0.9, 0.999), eps 1e-8, bias correction, no weight decay, no clipping.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

LR = 1e-3
RUNNERS = ("pytorch", "pytorch-fused", "torch.compile", "orttrainer[ort]", "orttrainer[torch]", "ort-training-api")
# `<orttrainer runner>+<variant>`: the same runner with one optimisation switched (its environment variable)
VARIANT_ENV = {
    "graph-update": ("ORTTRAINER_OPTIMIZER_UPDATE", "graph"),
    "fused-update": ("ORTTRAINER_OPTIMIZER_UPDATE", "fused"),
    "no-rewrites": ("ORTTRAINER_DISABLE_REWRITES", "all"),
    "no-static-shapes": ("ORTTRAINER_DISABLE_REWRITES", "static_shapes"),
    "no-cross-entropy": ("ORTTRAINER_DISABLE_REWRITES", "cross_entropy_as_plain_ops"),
    "no-where-concat": ("ORTTRAINER_DISABLE_REWRITES", "where_sum_to_concat"),
    "no-summed-uses": ("ORTTRAINER_DISABLE_REWRITES", "summed_uses_to_one"),
    "no-noop-reductions": ("ORTTRAINER_DISABLE_REWRITES", "noop_reductions"),
    "no-nchwc": ("ORTTRAINER_DISABLE_REWRITES", "blocked_convolutions"),
    "no-conv-per-offset": ("ORTTRAINER_DISABLE_REWRITES", "conv_weight_gradient_per_offset"),
    "no-recurrence-op": ("ORTTRAINER_DISABLE_REWRITES", "recurrences_as_one_op"),
    "no-relu-product": ("ORTTRAINER_DISABLE_REWRITES", "threshold_backward_as_product"),
    "no-safe-softmax-product": ("ORTTRAINER_DISABLE_REWRITES", "safe_softmax_as_product"),
}
VARIANTS = tuple(f"{r}+{v}" for r in ("orttrainer[ort]", "orttrainer[torch]") for v in VARIANT_ENV)
DEFAULT_VARIANTS = ("orttrainer[ort]+graph-update", "orttrainer[ort]+fused-update", "orttrainer[ort]+no-rewrites")


def runner_env(runner: str) -> dict[str, str]:
    """Environment of a runner's process (a variant sets its switch)."""
    env = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}  # every torch.compile process compiles, as on a fresh machine
    if "+" in runner:
        name, value = VARIANT_ENV[runner.split("+", 1)[1]]
        env[name] = value
    return env


def session_options(threads: int, profile_prefix: str | None = None, spinning: bool = True):
    """A user's SessionOptions of `threads` threads; `spinning=False` stops the pool's spinning between runs, as
    orttrainer's own SessionOptions do (docs/engine.md §3.3)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


def make_runner(runner: str, workload, threads: int, profile: bool) -> tuple[Callable, str, Callable | None]:
    if runner in ("pytorch", "pytorch-fused", "torch.compile"):
        return _pytorch(workload, fused=runner == "pytorch-fused", compiled=runner == "torch.compile")
    if runner.startswith("orttrainer["):
        return _orttrainer(workload, threads, runner[len("orttrainer[") : runner.index("]")], profile)
    if runner == "ort-training-api":
        return _training_api(workload, threads)
    raise ValueError(f"unknown runner {runner!r}")


def _pytorch(workload, fused: bool, compiled: bool):
    import torch

    model = workload.make_model()
    optimizer = (
        torch.optim.Adam(model.parameters(), lr=LR, fused=True)
        if fused
        else torch.optim.Adam(model.parameters(), lr=LR)
    )
    forward = torch.compile(model) if compiled else model

    def step(x, target):
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss_fn(forward(x), target)
        loss.backward()
        optimizer.step()
        return loss

    return step, "first step includes Inductor compilation" if compiled else "", None


def make_trainer(workload, session_options=None, builder: str = "auto"):
    """An ORTTrainer of `workload`'s model with Adam (lr `LR`) and no clipping, as every orttrainer runner has it;
    `session_options`: a user's SessionOptions (None: orttrainer's own)."""
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    options: dict[str, Any] = {
        "device": {"id": "cpu"},
        "utils": {"grad_norm_clip": False},
        "_internal_use": {"gradient_builder": builder},
    }
    if session_options is not None:
        options["session_options"] = session_options
    return ORTTrainer(
        workload.make_model(),
        workload.model_desc,
        optim.AdamConfig(lr=LR),
        loss_fn=workload.loss_fn,
        options=ORTTrainerOptions(options),
    )


def _orttrainer(workload, threads: int, builder: str, profile: bool):
    prefix = os.path.join(tempfile.mkdtemp(), "ort_profile") if profile else None
    trainer = make_trainer(workload, session_options(threads, prefix), builder)

    def profile_result() -> dict[str, float]:
        session = trainer._training_session.train_session
        return op_type_profile(session.end_profiling())

    return trainer.train_step, "first step includes export and graph compilation", profile_result if profile else None


def op_type_profile(path: str) -> dict[str, float]:
    """Kernel time per op type (ms per run) from an ONNX Runtime profile, over the runs it recorded."""
    with open(path) as f:
        events = json.load(f)
    runs = max(1, sum(1 for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"))
    per_op: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            per_op[op] = per_op.get(op, 0.0) + event["dur"] / 1000.0 / runs
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1]))


def _training_api(workload, threads: int):
    import onnx
    from onnxruntime.training import artifacts, onnxblock
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from orttrainer.trainer.graph.fixups import name_optional_outputs

    path = tempfile.mkdtemp(prefix="ort_training_api_")
    exported = _export_with_loss(workload, os.path.join(path, "model.onnx"))
    # onnxblock's gradient builder needs the optional outputs of LayerNormalization/SoftmaxCrossEntropyLoss named
    # (docs/engine.md §3.3); orttrainer's own fix-up pass does exactly that.
    forward = name_optional_outputs(onnx.load(exported))
    float_inits = [i.name for i in forward.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    artifacts.generate_artifacts(
        forward,
        requires_grad=[n for n in float_inits if n.startswith("model.")],  # the exporter prefixes the wrapped module
        frozen_params=[],
        loss=None,
        optimizer=onnxblock.optim.AdamW(eps=1e-8, weight_decay=0.0),
        artifact_directory=path,
    )
    optimizer_path = _pytorch_adam_mode(os.path.join(path, "optimizer_model.onnx"))
    state = CheckpointState.load_checkpoint(os.path.join(path, "checkpoint"))
    module = Module(
        os.path.join(path, "training_model.onnx"),
        state,
        os.path.join(path, "eval_model.onnx"),
        device="cpu",
        session_options=session_options(threads),
    )
    optimizer = Optimizer(optimizer_path, module)
    optimizer.set_learning_rate(LR)
    module.train()

    def step(x, target):
        outputs = module(x.numpy(), target.numpy())  # the training graph's outputs: (loss,)
        optimizer.step()
        module.lazy_reset_grad()
        return outputs[0]

    return step, "first step includes export and generate_artifacts; AdamW adam_mode patched to 0", None


def _export_with_loss(workload, path: str) -> str:
    """The model and its loss exported as one ONNX graph whose output is the loss (TorchScript exporter)."""
    import torch

    from orttrainer.trainer.build.export import _ModelWithLoss

    names = [name for name, _ in workload.model_desc["inputs"]]
    torch.onnx.export(
        _ModelWithLoss(workload.make_model(), workload.loss_fn, names),
        workload.make_batch(),
        path,
        input_names=names,
        output_names=["loss"],
        dynamic_axes={n: {0: "batch"} for n in names},
        opset_version=14,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
        dynamo=False,
    )
    return path


def _pytorch_adam_mode(path: str) -> str:
    """Switch onnxblock's AdamWOptimizer nodes to `adam_mode=0` (PyTorch's formula; its default 1 is Hugging Face's)."""
    import onnx

    model = onnx.load(path)
    for node in model.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attribute in node.attribute:
                if attribute.name == "adam_mode":
                    attribute.i = 0
    onnx.save(model, path)
    return path


def scalar(value: Any) -> float:
    return float(value.detach()) if hasattr(value, "detach") else float(value)
