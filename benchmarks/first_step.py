"""Time to the first train_step and eval_step, and to the first step of a new batch size, with the `torch` gradient
builder.

    python benchmarks/first_step.py [--threads 2] [--workloads transformer mlp] [--repeats 3] [--rewrite-off NAME]

For each workload, a fresh process builds an ORTTrainer (Adam, `_internal_use.gradient_builder='torch'`) and times
(1) the first `train_step` (trace + export + compile + session + run), (2) a second step on the same shapes,
(3) the first step on a batch of another size (half the batch: a new input-shape signature), (4) the training
graphs the session then holds (1: the new batch size reused the dynamic-shape graph; 2: it built a graph for
the new shape), (5) the first `eval_step`, on the first batch's shapes, and (6) the first `eval_step` on the half
batch. The compile cache is off. `--rewrite-off NAME` also runs, alternating with each process, one with the
rewrite NAME off (`ORTTRAINER_DISABLE_REWRITES`, orttrainer/trainer/graph/passes.py), e.g. `traced_eval_graphs`.
Prints a markdown table (medians over `--repeats` processes) and writes benchmarks/results/first_step.json.
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
    half = (x[: len(x) // 2], y[: len(y) // 2])
    times = []
    for step, batch in ((trainer.train_step, (x, y)), (trainer.train_step, (x, y)), (trainer.train_step, half)):
        start = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - start)
    graphs = trainer._training_session.training_graph_count
    for batch in ((x, y), half):
        start = time.perf_counter()
        trainer.eval_step(*batch)
        times.append(time.perf_counter() - start)
    return {
        "workload": workload_name,
        "first_step_s": times[0],
        "second_step_s": times[1],
        "new_batch_size_step_s": times[2],
        "training_graphs": graphs,
        "first_eval_s": times[3],
        "new_batch_size_eval_s": times[4],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["transformer", "mlp"])
    parser.add_argument("--rewrite-off", metavar="NAME", help="also run with this rewrite off, alternating")
    parser.add_argument("--worker", metavar="WORKLOAD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads)))
        return
    bytecode = compile_bytecode()
    variants: dict[str, dict[str, str]] = {"": {}}
    if args.rewrite_off:
        variants[f" ({args.rewrite_off} off)"] = {"ORTTRAINER_DISABLE_REWRITES": args.rewrite_off}
    cache_off = {"ORTTRAINER_COMPILE_CACHE": "off"}
    results: dict[str, list[dict]] = {}
    for name in args.workloads:
        for _ in range(args.repeats):
            for label, env in variants.items():
                run = run_worker(__file__, [name, "--threads", str(args.threads)], env={**cache_off, **env})
                results.setdefault(name + label, []).append(run)
    keys = ("first_step_s", "second_step_s", "new_batch_size_step_s", "first_eval_s", "new_batch_size_eval_s")
    rows = []
    for name, runs in results.items():
        medians = [statistics.median(r[key] for r in runs) for key in keys]
        graphs = sorted({r["training_graphs"] for r in runs})
        label = WORKLOADS[runs[0]["workload"]].name + name.removeprefix(runs[0]["workload"])
        rows.append([label, *(f"{m:.2f}" for m in medians), "/".join(map(str, graphs))])
    header = [
        "workload (torch builder)",
        "first step (s)",
        "second step (s)",
        "new batch size (s)",
        "first eval (s)",
        "eval, new batch size (s)",
        "graphs",
    ]
    print(f"threads: {args.threads}, medians of {args.repeats} processes\n\n" + markdown_table(header, rows))
    payload = {"threads": args.threads, "bytecode": bytecode, "rewrite_off": args.rewrite_off, "results": results}
    print(f"\nJSON: {save_json('first_step.json', payload)}")


if __name__ == "__main__":
    main()
