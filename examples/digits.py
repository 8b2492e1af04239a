"""Train a digit classifier with ORTTrainer on scikit-learn's bundled 8x8 digits (no download).

    python examples/digits.py [--epochs 30]

A flat training loop: ORTTrainer with Adam and a linear warm-up schedule, `eval_step` on held-out digits each epoch.
"""

from __future__ import annotations

import argparse
import time

import torch
from sklearn.datasets import load_digits

from orttrainer import ORTTrainer, ORTTrainerOptions, optim


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10)
        )

    def forward(self, pixels):
        return self.net(pixels)


def load(seed: int = 0):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(x))
    return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    (train_x, train_y), (test_x, test_y) = load()
    steps_per_epoch = len(train_x) // args.batch
    model_desc = {
        "inputs": [("pixels", ["batch", 64]), ("label", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", 10])],
    }
    options = ORTTrainerOptions(
        {
            "device": {"id": "cpu"},
            "lr_scheduler": optim.LinearWarmupLRScheduler(total_steps=args.epochs * steps_per_epoch, warmup=0.1),
        }
    )
    trainer = ORTTrainer(
        Classifier(), model_desc, optim.AdamConfig(lr=3e-3), loss_fn=torch.nn.functional.cross_entropy, options=options
    )

    start = time.perf_counter()
    accuracy = 0.0
    for epoch in range(args.epochs):
        order = torch.randperm(len(train_x))
        for i in range(steps_per_epoch):
            batch = order[i * args.batch : (i + 1) * args.batch]
            loss, _ = trainer.train_step(train_x[batch], train_y[batch])
        test_loss, logits = trainer.eval_step(test_x, test_y)
        accuracy = (logits.argmax(dim=1) == test_y).float().mean().item()
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            print(
                f"epoch {epoch + 1:3d}  train loss {loss.item():.4f}  test loss {test_loss.item():.4f}  "
                f"test accuracy {accuracy:.3f}"
            )
    print(f"{trainer.optimization_step} steps in {time.perf_counter() - start:.1f} s; test accuracy {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
