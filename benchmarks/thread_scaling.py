"""Step time against the thread count: eager PyTorch and orttrainer (and orttrainer with one rewrite switched off)
at each of `--threads`, to find where a graph form that wins on one thread stops winning on many.

    python benchmarks/thread_scaling.py [--threads 1 2 4 8 16] [--workloads cnn mlp] [--variants no-conv-per-offset]
                                        [--rounds 2] [--steps 10]

Each process sets one thread count for both libraries: `torch.set_num_threads(t)`, and for ONNX Runtime a user's
SessionOptions with `intra_op_num_threads` = t and the pool's spinning between runs off, as orttrainer's own
SessionOptions have it (docs/engine.md §3.3). A variant is `runners.VARIANT_ENV`'s switch (e.g. `no-conv-per-offset`:
the convolution weight gradient as one convolution; `no-relu-product`: ReLU's backward as a `Where`). For each
workload and variant a first process fills a compile cache of its own; then `--rounds` rounds run one process per
(runner, thread count) in turn, each timing `--steps` steps after 3 warm-up steps (their median). Prints a markdown
table (the median of the rounds, and each orttrainer row's ratio to eager at the same thread count) and writes
benchmarks/results/thread_scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from common import (  # noqa: E402
    WORKLOADS,
    compile_bytecode,
    environment,
    environment_line,
    markdown_table,
    median_step_ms,
    run_worker,
    save_json,
)
from runners import VARIANT_ENV, make_runner, make_trainer, session_options  # noqa: E402


def worker(runner: str, workload_name: str, threads: int, steps: int) -> dict:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name]
    batch = workload.make_batch()
    if runner == "pytorch":
        step = make_runner("pytorch", workload, threads, False)[0]
    else:
        step = make_trainer(workload, session_options(threads, spinning=False)).train_step
    return {"step_ms": median_step_ms(step, batch, steps), "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--workloads", nargs="+", default=["cnn", "mlp"], choices=WORKLOADS)
    parser.add_argument("--variants", nargs="*", default=["no-conv-per-offset"], choices=list(VARIANT_ENV))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", nargs=3, metavar=("RUNNER", "WORKLOAD", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        runner, name, threads = args.worker
        print(json.dumps(worker(runner, name, int(threads), args.steps)))
        return
    bytecode = compile_bytecode()
    runners = ["pytorch", "orttrainer", *(f"orttrainer+{v}" for v in args.variants)]
    results: dict[str, dict[str, dict[int, list[float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="orttrainer-thread-scaling-") as caches:
        for name in args.workloads:
            environments: dict[str, dict[str, str]] = {}
            for runner in runners[1:]:
                env = {"ORTTRAINER_COMPILE_CACHE": os.path.join(caches, name, runner)}
                if "+" in runner:
                    variable, value = VARIANT_ENV[runner.split("+", 1)[1]]
                    env[variable] = value
                environments[runner] = env
                run_worker(__file__, ["orttrainer", name, "1", "--steps", "1"], env=env)  # fills the cache
            results[name] = {runner: {t: [] for t in args.threads} for runner in runners}
            for _ in range(args.rounds):
                for threads in args.threads:
                    for runner in runners:
                        base = runner.split("+", 1)[0]
                        flags = [base, name, str(threads), "--steps", str(args.steps)]
                        measured = run_worker(__file__, flags, env=environments.get(runner))
                        results[name][runner][threads].append(measured["step_ms"])
    rows = []
    for name, by_runner in results.items():
        eager = {t: statistics.median(v) for t, v in by_runner["pytorch"].items()}
        for runner, by_threads in by_runner.items():
            cells = []
            for t, values in by_threads.items():
                median = statistics.median(values)
                cells.append(f"{median:.1f}" + ("" if runner == "pytorch" else f" ({median / eager[t]:.2f}x)"))
            rows.append([WORKLOADS[name].name if runner == "pytorch" else "", runner, *cells])
    header = ["workload", "runner", *(f"{t} thread{'s' if t > 1 else ''}: ms/step (vs eager)" for t in args.threads)]
    env = environment()
    print(f"{environment_line(env)}; {args.rounds} rounds\n\n" + markdown_table(header, rows))
    payload = {"environment": {**env, "bytecode": bytecode}, "arguments": vars(args), "results": results}
    print(f"\nJSON: {save_json('thread_scaling.json', payload)}")


if __name__ == "__main__":
    main()
