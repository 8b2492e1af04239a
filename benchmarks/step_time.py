"""ms per train_step: ORTTrainer (both gradient builders) vs PyTorch eager, same model, batches, optimizer (Adam)
and thread count.

    python benchmarks/step_time.py [--threads 2] [--steps 30] [--profile] [--runners pytorch orttrainer-ort ...]

Runners: `pytorch` (eager), `orttrainer-ort` (ONNX Runtime's gradient builder) and `orttrainer-torch` (PyTorch's
autograd traced into the graph), chosen with options `_internal_use.gradient_builder`. Prints a markdown table and
writes benchmarks/results/step_time.json. Each measurement runs in its own process; the table reports the median
step time after warm-up, the ratio to PyTorch measured in the same run, and the time to the first step (export +
compile + session creation + first run). `--profile` adds ONNX Runtime's kernel time per op type of each
workload's training graph, per builder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import DEFAULT_WORKLOADS, WORKLOADS, markdown_table, run_worker, save_json  # noqa: E402
from runners import make_trainer, session_options  # noqa: E402

RUNNERS = ("pytorch", "orttrainer-ort", "orttrainer-torch")


def _timed_steps(step, batches, steps: int, warmup: int) -> tuple[float, list[float]]:
    start = time.perf_counter()
    step(*batches[0])
    first = time.perf_counter() - start
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step(*batches[i % len(batches)])
        times.append(time.perf_counter() - start)
    return first, times[warmup:]


def _pytorch_step(workload):
    import torch

    model = workload.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, target):
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss_fn(model(x), target)
        loss.backward()
        optimizer.step()
        return loss

    return step, None


def _orttrainer_step(workload, threads: int, profile_prefix: str | None, builder: str):
    options = session_options(threads, profile_prefix, spinning=False)  # as orttrainer's own SessionOptions
    trainer = make_trainer(workload, options, builder)
    return trainer.train_step, trainer


def worker(runner: str, workload_name: str, threads: int, steps: int, warmup: int, profile: bool) -> dict:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name]
    batches = [workload.make_batch() for _ in range(4)]
    prefix = os.path.join(tempfile.mkdtemp(), "ort_profile") if profile else None
    if runner == "pytorch":
        step, trainer = _pytorch_step(workload)
    else:
        step, trainer = _orttrainer_step(workload, threads, prefix, runner.removeprefix("orttrainer-"))
    first, times = _timed_steps(step, batches, steps, warmup)
    result = {
        "runner": runner,
        "workload": workload_name,
        "threads": threads,
        "first_step_s": first,
        "median_ms": 1000 * statistics.median(times),
        "min_ms": 1000 * min(times),
        "steps": len(times),
    }
    if profile and trainer is not None:
        result["profile"] = op_type_profile(trainer._training_session.train_session.end_profiling(), warmup + steps + 1)
    return result


def op_type_profile(path: str, runs: int) -> dict[str, float]:
    """Kernel time per op type (ms per step) from an ONNX Runtime profile."""
    with open(path) as f:
        events = json.load(f)
    per_op: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            per_op[op] = per_op.get(op, 0.0) + event["dur"] / 1000.0 / runs
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS)
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    parser.add_argument("--profile", action="store_true", help="ORT kernel time per op type of each workload")
    parser.add_argument("--worker", nargs=2, metavar=("RUNNER", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.threads, args.steps, args.warmup, args.profile)))
        return
    results = []
    for name in args.workloads:
        for runner in args.runners:
            flags = ["--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            if args.profile and runner != "pytorch":
                flags.append("--profile")
            results.append(run_worker(__file__, [runner, name, *flags]))
    print(report(results, args.threads))
    print(f"\nJSON: {save_json('step_time.json', {'threads': args.threads, 'results': results})}")


def report(results: list[dict], threads: int) -> str:
    rows = []
    for name in dict.fromkeys(r["workload"] for r in results):
        base = next((r for r in results if r["workload"] == name and r["runner"] == "pytorch"), None)
        for r in (r for r in results if r["workload"] == name):
            ratio = f"{r['median_ms'] / base['median_ms']:.2f}x" if base else "-"
            rows.append([WORKLOADS[name].name, r["runner"], f"{r['median_ms']:.1f}", ratio, f"{r['first_step_s']:.2f}"])
    text = f"threads: {threads}\n\n" + markdown_table(
        ["workload", "runner", "ms/step (median)", "vs PyTorch eager", "first step (s)"], rows
    )
    for r in results:
        if "profile" in r:
            top = list(r["profile"].items())[:15]
            caption = f"ONNX Runtime kernel time per op type, {r['workload']} train step, {r['runner']} (ms/step)"
            text += f"\n\n{caption}:\n\n"
            text += markdown_table(["op type", "ms/step"], [[op, f"{ms:.2f}"] for op, ms in top])
    return text


if __name__ == "__main__":
    main()
