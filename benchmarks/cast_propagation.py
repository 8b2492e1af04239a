"""Cast propagation (`graph_transformer.propagate_cast_ops_config`) under mixed precision: Cast nodes, float16
nodes and ms per train_step for each strategy and level, per gradient builder of the installed runtime.

    python benchmarks/cast_propagation.py [--rounds 8] [--steps 2] [--workloads mlp transformer]

The 'ort' builder (onnxruntime-training only) hands the option to ONNX Runtime's PropagateCastOps, the torch builder
runs orttrainer's pass (orttrainer/trainer/graph/cast_propagation.py). Counted in the compiled training graph
(forward, backward and update; "Casts" are Cast nodes to float32 or float16). A last row per builder and workload
trains the float32 model with INSERT_AND_REDUCE at level 2, which must change nothing.

The settings of one builder and workload run in their own processes, all alive at once, stepping in turn
(benchmarks/lockstep.py): the step-time ratio to NONE is the median of the per-round ratios, with its
interquartile range. One thread per process. Run it with each runtime's Python to measure both. Prints a markdown
table and writes benchmarks/results/cast_propagation_<runtime>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import DEFAULT_WORKLOADS, WORKLOADS, markdown_table, save_json  # noqa: E402
from lockstep import Worker, interleave, ratio_statistics, serve, time_statistics  # noqa: E402

SETTINGS = [
    ("mixed", "NONE", 1),
    ("mixed", "FLOOD_FILL", 1),
    ("mixed", "FLOOD_FILL", 2),
    ("mixed", "INSERT_AND_REDUCE", 1),
    ("mixed", "INSERT_AND_REDUCE", 2),
    ("fp32", "INSERT_AND_REDUCE", 2),
]


def worker(builder: str, workload_name: str, precision: str, strategy: str, level: str) -> None:
    import time

    import onnx
    import onnxruntime as ort
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, PropagateCastOpsStrategy, amp, optim
    from orttrainer.trainer.graph.cast_propagation import count_casts

    torch.manual_seed(0)
    torch.set_num_threads(1)
    workload = WORKLOADS[workload_name]
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = 1
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
    losses: list[float] = []
    counter = [0]

    def step() -> None:
        loss = trainer.train_step(*batches[counter[0] % len(batches)])
        counter[0] += 1
        losses.append(float(loss[0] if isinstance(loss, list) else loss))

    def first() -> dict:
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        graph = trainer._built.compiled.training.model
        inferred = onnx.shape_inference.infer_shapes(graph).graph
        declared = [*inferred.value_info, *inferred.input, *inferred.output]
        types = {v.name: v.type.tensor_type.elem_type for v in declared}
        half = onnx.TensorProto.FLOAT16
        float16 = sum(n.op_type != "Cast" and bool(n.output) and types.get(n.output[0]) == half for n in inferred.node)
        return {
            "builder": trainer.gradient_builder,
            "casts": count_casts(graph),
            "float16_nodes": float16,
            "nodes": len(graph.graph.node),
            "first_step_s": seconds,
        }

    serve(first, step, lambda: {"last_loss": losses[-1]})


def measure(builder: str, workload: str, rounds: int, steps: int, warmup: int) -> list[dict]:
    """Every setting of one builder and workload, interleaved."""
    env = {"OMP_NUM_THREADS": "1"}
    workers = {
        f"{precision} {strategy} {level}": Worker(__file__, [builder, workload, precision, strategy, str(level)], env)
        for precision, strategy, level in SETTINGS
    }
    per_round = interleave(workers, rounds, steps, warmup)
    base = per_round["mixed NONE 1"]
    results = []
    for (precision, strategy, level), (name, w) in zip(SETTINGS, workers.items(), strict=True):
        summary = w.finish()
        results.append(
            {
                "workload": workload,
                "precision": precision,
                "strategy": strategy,
                "level": level,
                **w.ready,
                **summary,
                "ms_per_step": time_statistics(per_round[name]),
                "vs_none": ratio_statistics(per_round[name], base),
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=list(WORKLOADS))
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    from orttrainer.trainer.runtime import has_training_build

    runtime = "onnxruntime-training" if has_training_build() else "onnxruntime"
    builders = ["torch", "ort"] if has_training_build() else ["torch"]
    results = [
        {"requested_builder": builder, **r}
        for builder in builders
        for name in args.workloads
        for r in measure(builder, name, args.rounds, args.steps, args.warmup)
    ]
    rows = [
        [
            r["builder"],
            WORKLOADS[r["workload"]].name,
            r["precision"],
            f"{r['strategy']} {r['level']}",
            r["casts"],
            r["float16_nodes"],
            f"{r['ms_per_step']['median']:.1f}",
            f"{r['vs_none']['median']:.2f}x ({r['vs_none']['q1']:.2f}-{r['vs_none']['q3']:.2f})",
            f"{r['first_step_s']:.1f}",
            f"{r['last_loss']:.5f}",
        ]
        for r in results
    ]
    print(f"runtime: {runtime}; one thread per process; CPU; {args.rounds} rounds of {args.steps} steps\n")
    header = ["builder", "workload", "precision", "strategy level", "Casts", "float16 nodes", "ms/step (median)"]
    header += ["vs mixed NONE (IQR)", "first step (s)", "last loss"]
    print(markdown_table(header, rows))
    payload = {"runtime": runtime, "rounds": args.rounds, "steps": args.steps, "results": results}
    print(f"\nJSON: {save_json(f'cast_propagation_{runtime}.json', payload)}")


if __name__ == "__main__":
    main()
