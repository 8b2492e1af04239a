"""One rank of a distributed test scenario: `python dist_worker.py CONFIG_JSON`.

The config names the scenario, rank, world size and options; the worker trains the MLP on its shard of a fixed
sequence of global batches and saves what the test compares (weights, optimizer state, counters, collective calls).
Run by `helpers.run_ranks` with MASTER_ADDR/MASTER_PORT set; world_size 1 gives the single-process reference. A config
with "runs" (a list of partial configs) trains one trainer per entry, in order, in the same processes, and saves their
results as {"runs": [...]}.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.dirname(__file__))

from models import MLP, mlp_desc  # noqa: E402

from orttrainer import ORTTrainer, ORTTrainerOptions, amp, optim  # noqa: E402

CE = torch.nn.functional.cross_entropy


def global_batches(steps: int, global_batch: int, seed: int = 7, halve_odd_steps: bool = False):
    """Fixed batches; with `halve_odd_steps`, every second one has half the rows (a second input shape)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [global_batch // 2 if halve_odd_steps and i % 2 else global_batch for i in range(steps)]
    return [(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in sizes]


def make_trainer(cfg: dict) -> ORTTrainer:
    torch.manual_seed(cfg["rank"] if cfg.get("seed_per_rank") else 0)
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = 1
    options = {
        "device": {"id": "cpu"},
        "session_options": session_options,
        "batch": {"gradient_accumulation_steps": cfg.get("accumulation", 1)},
        "distributed": {
            "world_rank": cfg["rank"],
            "world_size": cfg["world_size"],
            "allreduce_post_accumulation": cfg.get("post", False),
            "deepspeed_zero_optimization": {"stage": cfg.get("zero", 0)},
            "enable_adasum": cfg.get("adasum", False),
        },
        "_internal_use": {"gradient_builder": cfg.get("builder", "auto")},
    }
    if cfg.get("mixed_precision"):
        options["mixed_precision"] = {"enabled": True, "loss_scaler": amp.DynamicLossScaler(loss_scale=256.0)}
    config = {"adam": optim.AdamConfig(lr=1e-2), "lamb": optim.LambConfig(lr=1e-2), "sgd": optim.SGDConfig(lr=0.1)}[
        cfg.get("optimizer", "adam")
    ]
    model = MLP(hidden=16 + 8 * cfg["rank"]) if cfg.get("hidden_per_rank") else MLP()
    return ORTTrainer(model, mlp_desc(), config, loss_fn=CE, options=ORTTrainerOptions(options))


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = tensor.shape[0] // world_size
    return tensor[rank * per_rank : (rank + 1) * per_rank]


def run(cfg: dict) -> dict:
    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world_size"]
    trainer = make_trainer(cfg)
    batches = global_batches(cfg["steps"], cfg["global_batch"], halve_odd_steps=cfg.get("halve_odd_steps", False))
    start, stop = cfg.get("start", 0), cfg.get("stop", cfg["steps"])
    if cfg.get("load"):
        trainer.load_checkpoint(*cfg["load"])
    try:
        for x, y in batches[start:stop]:
            trainer.train_step(shard(x, rank, world), shard(y, rank, world))
    except RuntimeError as err:
        if not cfg.get("expect_error"):
            raise
        return {"error": str(err)}
    save_error = None
    if cfg.get("save"):
        try:
            trainer.save_checkpoint(cfg["save"])
        except RuntimeError as err:
            save_error = str(err)
    if save_error is not None:
        return {"save_error": save_error}
    state = trainer.state_dict()
    session = trainer._training_session
    return {
        "weights": {k: v.tolist() for k, v in state["model"]["full_precision"].items()},
        "all_weights": {k: v.tolist() for k, v in session.get_state(trainer._built.compiled.trainable).items()},
        "optimizer": {w: {k: np.asarray(v).tolist() for k, v in e.items()} for w, e in state["optimizer"].items()},
        "counters": [
            trainer._train_step_info.step,
            trainer._train_step_info.optimization_step,
            trainer._state.counters.optimizer_updates,
        ],
        "calls": dict(getattr(session, "comm", None).calls) if hasattr(session, "comm") else {},
        "moment_elements": sum(
            int(np.prod(session.get_state([m])[m].shape)) for m in trainer._built.compiled.training.optimizer_state
        ),
        "partition_info": sorted(state.get("partition_info", {})),
        "gradient_builder": trainer.gradient_builder,
        "graphs": session.training_graph_count,
    }


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    result = {"runs": [run({**config, **part}) for part in config["runs"]]} if "runs" in config else run(config)
    with open(config["out"], "w") as f:
        json.dump(result, f)
    if torch.distributed.is_initialized():
        # leave together: a rank that exits while its peer's Gloo threads still talk to it makes the peer abort
        # ("terminate called without an active exception")
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
