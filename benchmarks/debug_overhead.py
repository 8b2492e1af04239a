"""ms per train_step of ORTTrainer with and without an activation-statistics subscriber (orttrainer.debug).

    python benchmarks/debug_overhead.py [--threads 2] [--steps 30] [--repeats 5] [--baseline /path/to/checkout]

Modes, each in its own process (benchmarks/common.py), on the MLP workload (784-1024-1024-10, batch 64, Adam):
  none     no subscriber: the graph and the step are those of a trainer without orttrainer.debug
  idle     one StatisticsSubscriber whose range starts after the run: marked graph, nothing extra fetched
  collect  one StatisticsSubscriber collecting every step: forward and backward statistics of the 4 module
           outputs computed in the graph, fetched and written (8 files per step)
`--baseline` adds a `none` run of another checkout's orttrainer (e.g. the main branch) for comparison.
Processes run round robin, `--repeats` per mode; the table shows the best per-process median (the least disturbed
by other load) and all of them. Prints a markdown table and writes benchmarks/results/debug_overhead.json.
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

from common import WORKLOADS, markdown_table, run_worker, save_json  # noqa: E402

MODES = ("none", "idle", "collect")


def worker(mode: str, threads: int, steps: int, warmup: int) -> dict:
    import onnxruntime as ort
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim
    from orttrainer.debug import GlobalSubscriberManager, StatisticsSubscriber

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS["mlp"]
    batches = [workload.make_batch() for _ in range(4)]
    model = workload.make_model()
    out = tempfile.mkdtemp()
    if mode != "none":
        start = 10**9 if mode == "idle" else None
        GlobalSubscriberManager.subscribe(
            model, [StatisticsSubscriber(out, override_output_dir=True, start_step=start)]
        )
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = threads
    session_options.inter_op_num_threads = 1
    session_options.log_severity_level = 3
    options = ORTTrainerOptions(
        {"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False}, "session_options": session_options}
    )
    trainer = ORTTrainer(
        model, workload.model_desc, optim.AdamConfig(lr=1e-3), loss_fn=workload.loss_fn, options=options
    )
    start_time = time.perf_counter()
    trainer.train_step(*batches[0])
    first = time.perf_counter() - start_time
    writing = _time_file_writing(trainer)
    times = []
    for i in range(warmup + steps):
        start_time = time.perf_counter()
        trainer.train_step(*batches[i % len(batches)])
        times.append(time.perf_counter() - start_time)
    times, writing = times[warmup:], writing[warmup:]
    files = sum(len(f) for _, _, f in os.walk(out))
    return {
        "mode": mode,
        "threads": threads,
        "first_step_s": first,
        "median_ms": 1000 * statistics.median(times),
        "min_ms": 1000 * min(times),
        "write_ms": 1000 * statistics.median(writing) if writing else None,
        "steps": len(times),
        "files_written": files,
    }


def _time_file_writing(trainer) -> list[float]:
    """Seconds per step spent decoding and writing the statistics files (after the ONNX Runtime run)."""
    times: list[float] = []
    statistics_side = getattr(trainer, "_activations", None)  # absent in a checkout without orttrainer.debug support
    if statistics_side is None:
        return times
    end_step = statistics_side.end_step

    def timed(results):
        start = time.perf_counter()
        end_step(results)
        times.append(time.perf_counter() - start)

    statistics_side.end_step = timed
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="processes per mode (the table shows the best)")
    parser.add_argument("--baseline", help="another checkout whose orttrainer runs the 'none' mode too")
    parser.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    flags = ["--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.steps, args.warmup)))
        return
    runs = [("this checkout", mode, None) for mode in MODES]
    if args.baseline:
        runs.insert(0, (f"baseline {args.baseline}", "none", os.path.abspath(args.baseline)))
    samples: dict[int, list[dict]] = {i: [] for i in range(len(runs))}
    for _ in range(args.repeats):  # round robin, so load changes on the machine hit every mode alike
        for i, (_, mode, path) in enumerate(runs):
            samples[i].append(run_worker(__file__, [mode, *flags], env={"PYTHONPATH": path} if path else None))
    results = []
    for i, (label, _, _) in enumerate(runs):
        best = min(samples[i], key=lambda r: r["median_ms"])
        results.append({**best, "code": label, "median_ms_all": [r["median_ms"] for r in samples[i]]})
    print(report(results, args.threads))
    print(f"\nJSON: {save_json('debug_overhead.json', {'threads': args.threads, 'results': results})}")


def report(results: list[dict], threads: int) -> str:
    base = next(r for r in results if r["mode"] == "none" and r["code"] == "this checkout")
    rows = [
        [
            r["code"],
            r["mode"],
            f"{r['median_ms']:.2f}",
            " / ".join(f"{m:.2f}" for m in r["median_ms_all"]),
            f"{r['median_ms'] / base['median_ms']:.3f}x",
            f"{r['write_ms']:.2f}" if r.get("write_ms") is not None else "-",
            f"{r['first_step_s']:.2f}",
            r["files_written"],
        ]
        for r in results
    ]
    return f"{WORKLOADS['mlp'].name}, threads: {threads}\n\n" + markdown_table(
        [
            "code",
            "mode",
            "ms/step (best median)",
            "medians per process",
            "vs none",
            "of which writing files (ms)",
            "first step (s)",
            "files",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
