"""Every example runs in a short mode and does what it says."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_classifier_learns_in_a_few_epochs(capsys):
    accuracy = _load("digits").main(["--epochs", "4"])
    assert accuracy > 0.8
    assert "test accuracy" in capsys.readouterr().out


def test_mlm_demo_trains_resumes_and_exports(tmp_path, capsys):
    """`make demo` in miniature: the loss falls, the resumed trainer continues from the checkpoint's step with the
    same held-out loss (the example raises otherwise), the saved ONNX model matches eval_step, PNG and table appear."""
    result = _load("pretrain_mlm").main(
        [
            "--steps",
            "24",
            "--batch",
            "8",
            "--seq",
            "32",
            "--eval-every",
            "12",
            "--eval-batches",
            "2",
            "--lr",
            "1e-2",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert result["last_loss"] < result["first_loss"] - 0.3
    assert [step for step, _ in result["history"]["eval"]] == [12, 24]
    assert "resumed from" in out and "optimizer step 12" in out
    assert result["onnx_diff"] < 1e-4
    files = set(os.listdir(result["run_dir"]))
    assert {"step12.ortcp", "byte_bert.onnx", "loss.png"} <= files
    assert "| steady samples/s |" in out


def test_bert_for_pretraining_trains_and_returns_to_pytorch():
    pytest.importorskip("transformers")
    result = _load("bert_pretraining").main(["--steps", "16", "--batch", "8", "--half", "15"])
    losses = result["losses"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.2
    assert abs(result["torch_loss"] - result["eval_loss"]) < 1e-4  # the trained weights, back in PyTorch


def test_onnx_model_trains_without_pytorch_module(tmp_path):
    result = _load("onnx_model").main(["--epochs", "4", "--out", str(tmp_path)])
    assert result["accuracy"] > 0.85
    assert abs(result["onnx_accuracy"] - result["accuracy"]) < 1e-6
    assert result["max_diff"] < 1e-5


@pytest.mark.distributed
def test_distributed_example_two_ranks_with_zero(tmp_path):
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([os.path.join(EXAMPLES, ".."), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            os.path.join(EXAMPLES, "distributed.py"),
            "--steps",
            "12",
            "--zero",
            "--accumulation",
            "2",
            "--checkpoint-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"rank-0 loss ([0-9.]+)", done.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert sorted(os.listdir(tmp_path)) == ["distributed_rank0_of2.ortcp", "distributed_rank1_of2.ortcp"]
