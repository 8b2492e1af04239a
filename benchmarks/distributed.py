"""Data-parallel throughput: 1 rank vs N ranks (Gloo, one thread per rank), same global batch.

    python benchmarks/distributed.py [--ranks 2] [--steps 30]

Trains the MLP of benchmarks/common.py with a global batch of 128 split across ranks, with and without ZeRO stage 1,
and reports samples/s and the collective calls per optimizer step. On a 2-core machine the gain is small; the point
is that it works and what it costs. Prints a markdown table and writes benchmarks/results/distributed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import WORKLOADS, markdown_table, save_json  # noqa: E402

GLOBAL_BATCH = 128


def worker(rank: int, world: int, zero: int, steps: int, warmup: int) -> dict:
    import onnxruntime as ort
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    torch.manual_seed(0)
    torch.set_num_threads(1)
    workload = WORKLOADS["mlp"]
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = 1
    options = ORTTrainerOptions(
        {
            "device": {"id": "cpu"},
            "session_options": session_options,
            "distributed": {"world_rank": rank, "world_size": world, "deepspeed_zero_optimization": {"stage": zero}},
        }
    )
    trainer = ORTTrainer(
        workload.make_model(), workload.model_desc, optim.AdamConfig(lr=1e-4), loss_fn=workload.loss_fn, options=options
    )
    per_rank = GLOBAL_BATCH // world
    x, y = torch.randn(per_rank, 784), torch.randint(0, 10, (per_rank,))
    for _ in range(warmup):
        trainer.train_step(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(x, y)
    elapsed = time.perf_counter() - start
    calls = dict(getattr(trainer._training_session, "comm", None).calls) if world > 1 else {}
    return {
        "rank": rank,
        "world": world,
        "zero": zero,
        "seconds": elapsed,
        "steps": steps,
        "calls_per_step": {k: v / (steps + warmup) for k, v in calls.items()},
    }


def run(world: int, zero: int, steps: int, warmup: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), str(world), str(zero), str(steps), str(warmup)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    slowest = max(r["seconds"] for r in results)
    return {
        "world": world,
        "zero": zero,
        "samples_per_s": GLOBAL_BATCH * steps / slowest,
        "ms_per_step": 1000 * slowest / steps,
        "calls_per_step": results[0]["calls_per_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", nargs=5, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    results = [
        run(1, 0, args.steps, args.warmup),
        run(args.ranks, 0, args.steps, args.warmup),
        run(args.ranks, 1, args.steps, args.warmup),
    ]
    base = results[0]["samples_per_s"]
    rows = [
        [
            r["world"],
            "stage 1" if r["zero"] else "off",
            f"{r['ms_per_step']:.1f}",
            f"{r['samples_per_s']:.0f}",
            f"{r['samples_per_s'] / base:.2f}x",
            ", ".join(f"{k} {v:g}" for k, v in r["calls_per_step"].items() if v) or "-",
        ]
        for r in results
    ]
    print(f"MLP 784-1024-1024-10, Adam, global batch {GLOBAL_BATCH}, 1 thread per rank\n")
    print(markdown_table(["ranks", "ZeRO", "ms/step", "samples/s", "vs 1 rank", "collectives per step"], rows))
    print(f"\nJSON: {save_json('distributed.json', {'results': results})}")


if __name__ == "__main__":
    main()
