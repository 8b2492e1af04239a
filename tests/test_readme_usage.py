"""The README's Usage example, run as written with the default options (the 'ort' builder with onnxruntime-training,
'torch' without it), trains the same weights as PyTorch on the same batches: Adam with the default gradient-norm
clip, the linear warm-up schedule and two accumulated micro-batches per update."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import torch
from helpers import max_difference, torch_weights, trainer_weights

from orttrainer import TrainStepInfo, optim
from orttrainer.trainer.runtime import has_training_build

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
MICRO_BATCHES = 8


def usage_code() -> str:
    with open(README, encoding="utf-8") as f:
        section = f.read().split("\n## Usage\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_usage_example_trains_like_pytorch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example writes classifier.onnx
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(16, 784, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(8)]
    namespace: dict = {"loader": loader}
    torch.manual_seed(0)
    exec(compile(usage_code(), "README.md", "exec"), namespace)
    trainer, options = namespace["trainer"], namespace["options"]
    assert trainer.gradient_builder == ("ort" if has_training_build() else "torch")

    torch.manual_seed(0)  # the example draws nothing else before Classifier(): the same initial weights
    reference = namespace["Classifier"]()
    initial = torch_weights(reference)
    adam = torch.optim.Adam(reference.parameters(), lr=1e-3, eps=1e-8)
    ce = torch.nn.functional.cross_entropy
    for step in range(MICRO_BATCHES // 2):
        for x, target in loader[2 * step : 2 * step + 2]:
            (ce(reference(x), target) / 2).backward()  # the mean gradient of the two micro-batches
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        info = TrainStepInfo(optim.AdamConfig(lr=1e-3), optimization_step=step)
        adam.param_groups[0]["lr"] = options.lr_scheduler.get_lr(info)[0]
        adam.step()
        adam.zero_grad()
    ours = trainer_weights(trainer)
    assert max_difference(ours, initial) > 2e-5  # it trained (warm-up: the first update has lr 0)
    assert max_difference(ours, torch_weights(reference)) < 1e-6

    x, target = loader[-1]
    reference.eval()
    with torch.no_grad():
        logits = reference(x)
    np.testing.assert_allclose(namespace["logits"].numpy(), logits.numpy(), atol=1e-5)
    np.testing.assert_allclose(namespace["loss"].item(), ce(logits, target).item(), atol=1e-5)
    session = ort.InferenceSession(str(tmp_path / "classifier.onnx"), providers=["CPUExecutionProvider"])
    (saved,) = session.run(["logits"], {"x": x.numpy(), "target": target.numpy()})
    np.testing.assert_allclose(saved, logits.numpy(), atol=1e-5)
