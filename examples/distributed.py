"""Data-parallel training with ORTTrainer on torch.distributed (Gloo on CPU, NCCL on GPU).

    torchrun --nproc_per_node 2 examples/distributed.py [--steps 40] [--zero] [--accumulation 2]

Each rank trains on its own shard of every global batch; gradients are averaged across ranks once per optimizer step
(allreduce_post_accumulation), so the result equals one process training on the whole batch. `--zero` partitions
the optimizer state across ranks (ZeRO stage 1). Rank and world size come from torchrun's environment: the options
keep their defaults. Rank 0 saves one checkpoint per rank at the end and prints the loss curve.
"""

from __future__ import annotations

import argparse
import os

import onnxruntime as ort
import torch

from orttrainer import ORTTrainer, ORTTrainerOptions, optim


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))

    def forward(self, features):
        return self.net(features)


def global_batch(step: int, size: int):
    """A synthetic, learnable task: the label is the quadrant of two fixed projections."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, 64, generator=g)
    label = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
    return x, label


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split across ranks)")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--zero", action="store_true", help="ZeRO stage 1: partition the optimizer state")
    parser.add_argument("--checkpoint-dir", default="examples/output")
    args = parser.parse_args(argv)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = 1  # one core per rank on a small machine
    options = ORTTrainerOptions(
        {
            "device": {"id": "cpu"},
            "session_options": session_options,
            "batch": {"gradient_accumulation_steps": args.accumulation},
            "distributed": {
                "allreduce_post_accumulation": True,
                "deepspeed_zero_optimization": {"stage": 1 if args.zero else 0},
            },
        }
    )
    model_desc = {"inputs": [("features", ["batch", 64]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(
        Classifier(), model_desc, optim.AdamConfig(lr=3e-3), loss_fn=torch.nn.functional.cross_entropy, options=options
    )
    per_rank = args.batch // world
    for step in range(args.steps * args.accumulation):
        x, label = global_batch(step, args.batch)
        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = trainer.train_step(x[shard], label[shard])
        if rank == 0 and step % (10 * args.accumulation) == 0:
            print(f"step {step:4d}  rank-0 loss {loss.item():.4f}")
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    path = os.path.join(args.checkpoint_dir, f"distributed_rank{rank}_of{world}.ortcp")
    if os.path.exists(path):
        os.remove(path)
    trainer.save_checkpoint(path)
    if rank == 0:
        print(f"final rank-0 loss {loss.item():.4f}; {world} rank(s); checkpoint {path} (one per rank)")
    return loss.item()


if __name__ == "__main__":
    main()
