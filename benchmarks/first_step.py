"""Time to the first train_step, and to the first step of a new batch size, with the `torch` gradient builder.

    python benchmarks/first_step.py [--threads 2] [--workloads transformer mlp] [--repeats 3]

For each workload, a fresh process builds an ORTTrainer (Adam, `_internal_use.gradient_builder='torch'`) and times
(1) the first `train_step` (trace + export + compile + session + run), (2) a second step on the same shapes,
(3) the first step on a batch of another size (half the batch: a new input-shape signature) and (4) the training
graphs the session then holds (1: the new batch size reused the dynamic-shape graph; 2: it built a graph for
the new shape). Prints a markdown table (medians over `--repeats` processes) and writes
benchmarks/results/first_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import WORKLOADS, compile_bytecode, markdown_table, run_worker, save_json  # noqa: E402


def worker(workload_name: str, threads: int) -> dict:
    import onnxruntime as ort
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name]
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = threads
    session_options.inter_op_num_threads = 1
    session_options.log_severity_level = 3
    options = ORTTrainerOptions(
        {
            "device": {"id": "cpu"},
            "utils": {"grad_norm_clip": False},
            "session_options": session_options,
            "_internal_use": {"gradient_builder": "torch"},
        }
    )
    trainer = ORTTrainer(
        workload.make_model(), workload.model_desc, optim.AdamConfig(lr=1e-3), loss_fn=workload.loss_fn, options=options
    )
    x, y = workload.make_batch()
    times = []
    for batch in ((x, y), (x, y), (x[: len(x) // 2], y[: len(y) // 2])):
        start = time.perf_counter()
        trainer.train_step(*batch)
        times.append(time.perf_counter() - start)
    return {
        "workload": workload_name,
        "first_step_s": times[0],
        "second_step_s": times[1],
        "new_batch_size_step_s": times[2],
        "training_graphs": trainer._training_session.training_graph_count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["transformer", "mlp"])
    parser.add_argument("--worker", metavar="WORKLOAD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads)))
        return
    bytecode = compile_bytecode()
    results = {
        name: [run_worker(__file__, [name, "--threads", str(args.threads)]) for _ in range(args.repeats)]
        for name in args.workloads
    }
    rows = []
    for name, runs in results.items():
        medians = [statistics.median(r[key] for r in runs) for key in ("first_step_s", "second_step_s")]
        medians.append(statistics.median(r["new_batch_size_step_s"] for r in runs))
        graphs = sorted({r["training_graphs"] for r in runs})
        rows.append([WORKLOADS[name].name, *(f"{m:.2f}" for m in medians), "/".join(map(str, graphs))])
    header = ["workload (torch builder)", "first step (s)", "second step (s)", "new batch size (s)", "graphs"]
    print(f"threads: {args.threads}, medians of {args.repeats} processes\n\n" + markdown_table(header, rows))
    payload = {"threads": args.threads, "bytecode": bytecode, "results": results}
    print(f"\nJSON: {save_json('first_step.json', payload)}")


if __name__ == "__main__":
    main()
