"""orttrainer.compat.install() and `python -m orttrainer.run`: legacy import paths serve orttrainer, the installed
onnxruntime keeps working, and an unmodified legacy script trains to the same weights as its orttrainer twin."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import needs_training_build

import orttrainer
from orttrainer import compat
from orttrainer.trainer.runtime import has_training_build

REPO = os.path.dirname(os.path.dirname(os.path.abspath(orttrainer.__file__)))


@pytest.fixture
def installed():
    compat.install()
    compat.install()  # idempotent
    try:
        yield
    finally:
        compat.uninstall()


def test_legacy_names_resolve_to_orttrainer(installed):
    import onnxruntime.training
    from onnxruntime.capi.ort_trainer import IODescription, ModelDescription
    from onnxruntime.capi.ort_trainer import ORTTrainer as OlderORTTrainer
    from onnxruntime.training import ORTTrainer, ORTTrainerOptions, TrainStepInfo, amp, checkpoint, optim

    import orttrainer.capi

    assert (ORTTrainer, ORTTrainerOptions, TrainStepInfo) == (
        orttrainer.ORTTrainer,
        orttrainer.ORTTrainerOptions,
        orttrainer.TrainStepInfo,
    )
    assert onnxruntime.training.ORTTrainer is ORTTrainer and checkpoint is orttrainer.checkpoint
    assert (OlderORTTrainer, IODescription, ModelDescription) == (
        orttrainer.capi.ORTTrainer,
        orttrainer.capi.IODescription,
        orttrainer.capi.ModelDescription,
    )
    assert optim.LambConfig is orttrainer.optim.LambConfig and amp.DynamicLossScaler is orttrainer.amp.DynamicLossScaler
    for name, target in compat.ALIASES.items():
        assert importlib.import_module(name) is importlib.import_module(target), name
    from onnxruntime.training import _utils, model_desc_validation, orttrainer_options
    from onnxruntime.training import orttrainer as trainer_module
    from onnxruntime.training.amp.loss_scaler import LossScaler
    from onnxruntime.training.optim.lr_scheduler import LinearWarmupLRScheduler

    assert trainer_module.TrainStepInfo is TrainStepInfo and trainer_module.ORTTrainer is ORTTrainer
    assert orttrainer_options.ORTTrainerOptions is ORTTrainerOptions and LossScaler is orttrainer.amp.LossScaler
    assert model_desc_validation._ORTTrainerModelDesc is orttrainer.model_desc_validation._ORTTrainerModelDesc
    assert LinearWarmupLRScheduler is orttrainer.optim.LinearWarmupLRScheduler
    assert _utils.state_dict_model_key() == "model"
    assert _utils.dtype_onnx_to_torch is orttrainer._utils.dtype_onnx_to_torch
    # the real package's names too, where there is one (onnxruntime-training)
    real_names = {"TrainingParameters", "artifacts"} if has_training_build() else set()
    assert {"ORTTrainer", "checkpoint", *real_names} <= set(onnxruntime.training.__all__)


@needs_training_build
def test_the_installed_onnxruntime_keeps_its_names(installed):
    import onnxruntime
    import onnxruntime.training
    from onnxruntime.training import artifacts, onnxblock
    from onnxruntime.training.optim import FusedAdam
    from onnxruntime.training.optim.fused_adam import AdamWMode

    real = compat._import_real("onnxruntime.training")
    assert onnxruntime.training.TrainingParameters is real.TrainingParameters
    assert artifacts.generate_artifacts and onnxblock.blocks.Linear and FusedAdam and AdamWMode
    assert onnxruntime.training._utils.get_device_str("cpu:0") == "cpu:0"  # only the real _utils has it
    assert onnxruntime.training.__path__ == real.__path__ and callable(onnxruntime.InferenceSession)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        onnxruntime.training.nope  # noqa: B018


def test_uninstall_restores_the_real_modules():
    import onnxruntime

    before = {name: sys.modules.get(name) for name in [*compat.ALIASES, *compat.OVERLAYS]}
    real_training = getattr(onnxruntime, "training", None)  # None: the maintained onnxruntime has no such package
    compat.install()
    assert compat.is_installed() and onnxruntime.training is not real_training
    compat.uninstall()
    assert not compat.is_installed() and getattr(onnxruntime, "training", None) is real_training
    assert {name: sys.modules.get(name) for name in before} == before
    assert not hasattr(real_training, "ORTTrainer") and not hasattr(onnxruntime.capi, "ort_trainer")


# --- both worlds, in a fresh interpreter ---------------------------------------------------------------------------
BOTH_WORLDS = """
import io, os, sys, tempfile
import numpy as np, onnx, torch
import orttrainer.compat
orttrainer.compat.install()
import onnxruntime
from onnxruntime.training import ORTTrainer, ORTTrainerOptions, artifacts, optim
from onnxruntime.capi.ort_trainer import IODescription

net = torch.nn.Linear(6, 3)
buffer = io.BytesIO()
torch.onnx.export(net, (torch.randn(2, 6),), buffer, input_names=["x"], output_names=["logits"],
                  dynamic_axes={"x": {0: "b"}, "logits": {0: "b"}}, training=torch.onnx.TrainingMode.TRAINING,
                  do_constant_folding=False, dynamo=False)
x, y = np.random.randn(4, 6).astype(np.float32), np.array([0, 1, 2, 0])
session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
assert session.run(None, {"x": x})[0].shape == (4, 3)
# onnxruntime's on-device training API, imported for the first time after install()
d = tempfile.mkdtemp()
model = onnx.load_from_string(buffer.getvalue())
artifacts.generate_artifacts(model, requires_grad=[i.name for i in model.graph.initializer], frozen_params=[],
                             loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                             artifact_directory=d)
from onnxruntime.training.api import CheckpointState, Module, Optimizer
module = Module(os.path.join(d, "training_model.onnx"), CheckpointState.load_checkpoint(os.path.join(d, "checkpoint")))
optimizer = Optimizer(os.path.join(d, "optimizer_model.onnx"), module)
module.train()
first = module(x, y); optimizer.step(); module.lazy_reset_grad()
assert module(x, y) < first
orttrainer.compat.uninstall()
import onnxruntime.training as real
assert real.api.Module is Module and not hasattr(real, "ORTTrainer")  # submodule kept on the real package
print("ok")
"""


def _run(args: list[str], cwd: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@needs_training_build  # onnxruntime-training's own training API is the other world
def test_both_worlds_work_after_install():
    result = _run(["-c", BOTH_WORLDS])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


# --- python -m orttrainer.run -------------------------------------------------------------------------------------
LEGACY_SCRIPT = '''
"""A training script written for the ORTTrainer API of 2022 (release 1.13)."""
import sys

import torch
import onnxruntime.training as ort_training
from onnxruntime.training import ORTTrainer, ORTTrainerOptions, TrainStepInfo, amp, checkpoint, optim


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def loss_fn(logits, target):
    return torch.nn.functional.cross_entropy(logits, target)


torch.manual_seed(0)
model_desc = {"inputs": [("x", ["batch", 16]), ("target", ["batch"])],
              "outputs": [("loss", [], True), ("logits", ["batch", 4])]}
options = ORTTrainerOptions({"device": {"id": "cpu"},
                             "batch": {"gradient_accumulation_steps": 2},
                             "lr_scheduler": optim.LinearWarmupLRScheduler(total_steps=10, warmup=0.2)})
optim_config = optim.LambConfig(params=[{"params": ["fc1.bias", "fc2.bias"], "lambda_coef": 0.0}],
                                lr=1e-2, lambda_coef=0.01)
trainer = ORTTrainer(Net(), model_desc, optim_config, loss_fn=loss_fn, options=options)
generator = torch.Generator().manual_seed(1)
for step in range(20):
    x = torch.randn(8, 16, generator=generator)
    target = torch.randint(0, 4, (8,), generator=generator)
    loss, logits = trainer.train_step(x, target)
trainer.save_checkpoint(sys.argv[1], user_dict={"epoch": 1, "script": sys.argv[0]})
print("final loss", float(loss))
'''


def test_unchanged_legacy_script_matches_its_orttrainer_twin(tmp_path):
    legacy = tmp_path / "train_legacy.py"
    legacy.write_text(LEGACY_SCRIPT)
    twin = tmp_path / "train_orttrainer.py"
    twin.write_text(
        LEGACY_SCRIPT.replace("import onnxruntime.training as", "import orttrainer as").replace(
            "from onnxruntime.training import", "from orttrainer import"
        )
    )
    assert "onnxruntime" not in twin.read_text()

    plain = _run([str(legacy), str(tmp_path / "never.ortcp")])
    # really the legacy API: onnxruntime-training 1.19 no longer has ORTTrainer, the maintained onnxruntime has no
    # onnxruntime.training at all
    missing = "cannot import name 'ORTTrainer'" if has_training_build() else "No module named 'onnxruntime.training'"
    assert plain.returncode != 0 and missing in plain.stderr
    result = _run(["-m", "orttrainer.run", str(legacy), str(tmp_path / "legacy.ortcp")])
    assert result.returncode == 0, result.stderr[-3000:]
    expected = _run([str(twin), str(tmp_path / "orttrainer.ortcp")])
    assert expected.returncode == 0, expected.stderr[-3000:]
    assert result.stdout.strip() == expected.stdout.strip()

    from orttrainer.checkpoint import storage

    actual, reference = storage.load(str(tmp_path / "legacy.ortcp")), storage.load(str(tmp_path / "orttrainer.ortcp"))
    weights = actual["model"]["full_precision"]
    assert set(weights) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    for name, value in reference["model"]["full_precision"].items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    for name, state in reference["optimizer"].items():
        for key, value in state.items():
            np.testing.assert_array_equal(actual["optimizer"][name][key], value, err_msg=f"{name}/{key}")
    assert actual["train_step_info"] == reference["train_step_info"] == {"optimization_step": 10, "step": 20}
    from orttrainer.checkpoint.user_dict import decode_user_dict

    assert decode_user_dict(actual["user_dict"]) == {"epoch": 1, "script": str(legacy)}


ARGV_SCRIPT = """
import json, sys
from onnxruntime.capi.ort_trainer import ORTTrainer
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "trainer": ORTTrainer.__module__}))
sys.exit(3)
"""


def test_run_sets_argv_path_and_exit_status(tmp_path):
    script = tmp_path / "scripts" / "show.py"
    script.parent.mkdir()
    script.write_text(ARGV_SCRIPT)
    result = _run(["-m", "orttrainer.run", str(script), "--flag", "value"], cwd=str(tmp_path))
    assert result.returncode == 3, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {
        "argv": [str(script), "--flag", "value"],
        "path0": str(script.parent),
        "name": "__main__",
        "trainer": "orttrainer.capi.ort_trainer",
    }
    (tmp_path / "showmod.py").write_text(ARGV_SCRIPT)
    result = _run(["-m", "orttrainer.run", "-m", "showmod", "a"], cwd=str(tmp_path))
    assert result.returncode == 3, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["argv"] == [str(tmp_path / "showmod.py"), "a"] and seen["name"] == "__main__"


def test_run_usage_errors(tmp_path):
    assert _run(["-m", "orttrainer.run"]).returncode == 2
    missing = _run(["-m", "orttrainer.run", str(tmp_path / "missing.py")])
    assert missing.returncode == 2 and "can't open file" in missing.stderr
    assert "usage: python -m orttrainer.run" in _run(["-m", "orttrainer.run", "--help"]).stdout


def test_run_under_torchrun_aliases_every_rank(tmp_path):
    """`torchrun --module orttrainer.run script.py` (README): each rank runs the script with the aliases installed."""
    # each rank writes a file of its own: the workers share torchrun's stdout, whose output went missing once in CI
    # (exit status 0, no line from either rank)
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os\nfrom onnxruntime.training import ORTTrainer\n"
        "with open(f\"rank{os.environ['RANK']}.txt\", 'w') as f:\n"
        "    f.write(f\"rank {os.environ['RANK']} {ORTTrainer.__module__}\")\n"
    )
    result = _run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "--module",
            "orttrainer.run",
            str(script),
        ],
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(path.read_text() for path in tmp_path.glob("rank*.txt"))
    assert lines == ["rank 0 orttrainer.trainer.orttrainer", "rank 1 orttrainer.trainer.orttrainer"], (
        result.stdout[-2000:] + result.stderr[-3000:]
    )
