"""Cast propagation (`graph_transformer.propagate_cast_ops_config`) under mixed precision: Cast nodes, float16
nodes and ms per train_step for each strategy and level, per gradient builder of the installed runtime.

    python benchmarks/cast_propagation.py [--threads 2] [--steps 10] [--workloads mlp transformer]

The 'ort' builder (onnxruntime-training only) hands the option to ONNX Runtime's PropagateCastOps, the torch builder
runs orttrainer's pass (orttrainer/trainer/graph/cast_propagation.py). Counted in the compiled training graph
(forward, backward and update). A last row per builder trains the float32 model with INSERT_AND_REDUCE at level 2,
which must change nothing. Run it with each runtime's Python to measure both. Prints a markdown table and writes
benchmarks/results/cast_propagation_<runtime>.json; each measurement runs in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import WORKLOADS, markdown_table, run_worker, save_json  # noqa: E402

SETTINGS = [("NONE", 1), ("FLOOD_FILL", 1), ("FLOOD_FILL", 2), ("INSERT_AND_REDUCE", 1), ("INSERT_AND_REDUCE", 2)]


def worker(
    builder: str, workload_name: str, strategy: str, level: str, precision: str, threads: int, steps: int
) -> dict:
    import onnx
    import onnxruntime as ort
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, PropagateCastOpsStrategy, amp, optim
    from orttrainer.trainer.graph.cast_propagation import count_casts

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name]
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = threads
    session_options.log_severity_level = 3
    cast = {"strategy": PropagateCastOpsStrategy[strategy], "level": int(level)}
    options: dict = {
        "device": {"id": "cpu"},
        "session_options": session_options,
        "graph_transformer": {"propagate_cast_ops_config": cast},
        "_internal_use": {"gradient_builder": builder},
    }
    if precision == "mixed":
        options["mixed_precision"] = {"enabled": True, "loss_scaler": amp.DynamicLossScaler(loss_scale=1024.0)}
    trainer = ORTTrainer(
        workload.make_model(),
        workload.model_desc,
        optim.AdamConfig(lr=1e-4),
        loss_fn=workload.loss_fn,
        options=ORTTrainerOptions(options),
    )
    batches = [workload.make_batch() for _ in range(4)]
    start = time.perf_counter()
    trainer.train_step(*batches[0])
    first = time.perf_counter() - start
    times, losses = [], []
    for i in range(steps + 2):
        start = time.perf_counter()
        loss = trainer.train_step(*batches[i % len(batches)])
        times.append(time.perf_counter() - start)
        losses.append(float(loss[0] if isinstance(loss, list) else loss))
    graph = trainer._built.compiled.training.model
    inferred = onnx.shape_inference.infer_shapes(graph).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *inferred.input, *inferred.output]}
    float16 = sum(
        n.op_type != "Cast" and bool(n.output) and types.get(n.output[0]) == onnx.TensorProto.FLOAT16
        for n in inferred.node
    )
    return {
        "builder": trainer.gradient_builder,
        "workload": workload_name,
        "precision": precision,
        "strategy": strategy,
        "level": int(level),
        "casts": count_casts(graph),
        "float16_nodes": float16,
        "nodes": len(graph.graph.node),
        "first_step_s": first,
        "median_ms": 1000 * statistics.median(times[2:]),
        "last_loss": losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.threads, args.steps)))
        return
    from orttrainer.trainer.runtime import has_training_build

    runtime = "onnxruntime-training" if has_training_build() else "onnxruntime"
    builders = ["torch", "ort"] if has_training_build() else ["torch"]
    flags = ["--threads", str(args.threads), "--steps", str(args.steps)]
    results = []
    for builder in builders:
        for name in args.workloads:
            for strategy, level in SETTINGS:
                results.append(run_worker(__file__, [builder, name, strategy, str(level), "mixed", *flags]))
            results.append(run_worker(__file__, [builder, name, "INSERT_AND_REDUCE", "2", "fp32", *flags]))
    rows = []
    for r in results:
        base = next(
            b
            for b in results
            if (b["builder"], b["workload"], b["precision"], b["strategy"])
            == (r["builder"], r["workload"], "mixed", "NONE")
        )
        rows.append(
            [
                r["builder"],
                WORKLOADS[r["workload"]].name,
                r["precision"],
                f"{r['strategy']} {r['level']}",
                r["casts"],
                r["float16_nodes"],
                f"{r['median_ms']:.1f}",
                f"{r['median_ms'] / base['median_ms']:.2f}x",
                f"{r['first_step_s']:.1f}",
                f"{r['last_loss']:.5f}",
            ]
        )
    print(f"runtime: {runtime}; threads: {args.threads}; CPU\n")
    header = ["builder", "workload", "precision", "strategy level", "Casts", "float16 nodes", "ms/step (median)"]
    header += ["vs NONE", "first step (s)", "loss after the steps"]
    print(markdown_table(header, rows))
    payload = {"runtime": runtime, "threads": args.threads, "steps": args.steps, "results": results}
    print(f"\nJSON: {save_json(f'cast_propagation_{runtime}.json', payload)}")


if __name__ == "__main__":
    main()
