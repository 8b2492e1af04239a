"""A second process's first step on the compile cache, with and without ONNX Runtime's optimised graphs.

    python benchmarks/cached_start.py [--workloads lstm cnn transformer mlp] [--builder torch] [--pairs 3]

For each workload a first process fills a compile cache of its own; then `--pairs` pairs of processes run in turn:
one finds ONNX Runtime's optimised graphs in the cache's folder `onnxruntime/` (orttrainer/trainer/runtime/ort.py,
`OptimizedGraphs`) and loads them with the optimiser off; the other finds that folder removed, so ONNX Runtime
optimises the graphs again, as every process did before they were kept (and stores them for the next). Each
process times the trainer's construction and first `train_step` after its imports. The trainers use orttrainer's
own SessionOptions, as the optimised graphs are kept only for those (ONNX Runtime's default thread count; the
first step's run is the same in both). Prints a markdown table (median and range per variant) and writes
benchmarks/results/cached_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import WORKLOADS, compile_bytecode, markdown_table, run_worker, save_json  # noqa: E402


def worker(workload_name: str, builder: str) -> dict:
    import onnxruntime  # noqa: F401  (imported before the clock, as the other benchmarks do)
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    torch.manual_seed(0)
    workload = WORKLOADS[workload_name]
    x, y = workload.make_batch()
    model = workload.make_model()
    options = ORTTrainerOptions(
        {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False}, "_internal_use": {"gradient_builder": builder}}
    )
    start = time.perf_counter()
    adam = optim.AdamConfig(lr=1e-3)
    trainer = ORTTrainer(model, workload.model_desc, adam, loss_fn=workload.loss_fn, options=options)
    trainer.train_step(x, y)
    return {"first_step_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["lstm", "cnn", "transformer", "mlp"], choices=WORKLOADS)
    parser.add_argument("--builder", default="torch", choices=["torch", "ort", "auto"])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "BUILDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    bytecode = compile_bytecode()
    results: dict[str, dict[str, list[float]]] = {}
    for name in args.workloads:
        cache = tempfile.mkdtemp(prefix="orttrainer-cached-start-")
        env = {"ORTTRAINER_COMPILE_CACHE": cache}
        try:
            print(f"{name}: filling the cache ...", file=sys.stderr, flush=True)
            filled = run_worker(__file__, [name, args.builder], env=env)["first_step_s"]
            times: dict[str, list[float]] = {"with": [], "without": []}
            for _ in range(args.pairs):
                times["with"].append(run_worker(__file__, [name, args.builder], env=env)["first_step_s"])
                shutil.rmtree(os.path.join(cache, "onnxruntime"), ignore_errors=True)
                times["without"].append(run_worker(__file__, [name, args.builder], env=env)["first_step_s"])
            results[name] = {"first_process": [filled], **times}
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    rows = []
    for name, times in results.items():
        cells = [f"{times['first_process'][0]:.2f}"]
        for variant in ("with", "without"):
            values = times[variant]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})")
        rows.append([WORKLOADS[name].name, *cells])
    header = [
        f"workload ({args.builder} builder)",
        "first process (s)",
        "cached: with ONNX Runtime's optimised graphs (s)",
        "cached: optimised again (s)",
    ]
    print(f"{args.pairs} interleaved pairs of processes\n\n" + markdown_table(header, rows))
    payload = {"builder": args.builder, "bytecode": bytecode, "results": results}
    print(f"\nJSON: {save_json('cached_start.json', payload)}")


if __name__ == "__main__":
    main()
