"""orttrainer against its peers, in one run on the same models, batches, optimizer and thread count.

    python benchmarks/run_all.py [--threads 1] [--rounds 12] [--steps 3] [--warmup 5] [--workloads mlp transformer]
                                 [--runners ...] [--no-variants] [--other-python PYTHON] [--profile]

Runners: benchmarks/runners.py (eager PyTorch as users run it and with fused Adam, torch.compile, orttrainer with
each gradient builder, ONNX Runtime's training API; unless `--no-variants`, orttrainer[ort] also with each
optimisation switched off; `--other-python` runs the orttrainer runners again under a second interpreter, e.g. a
virtual environment with the maintained `onnxruntime` instead of `onnxruntime-training`: rows marked `@other`).
Each runner has its own process; the processes step in turn (benchmarks/lockstep.py): after `--warmup` steps each,
`--rounds` rounds of `--steps` steps per runner in a shuffled order, so the load of other jobs on a shared machine
falls on all runners alike. Reported per runner: the median step time and the range of the per-round medians; the
ratio to eager PyTorch (as users run it, and with fused Adam) as the median of the per-round ratios with its
interquartile range; the time to the first step (export, compile, artifact generation and session creation
included; each process starts alone, with an empty compile cache of its own: orttrainer/trainer/compile/cache.py,
and orttrainer byte-compiled beforehand, as an installed package is);
for orttrainer's runners the first step of a second process on the cache the first one filled (unless
`--no-cache-run`); the process's peak resident memory (`ru_maxrss`) and its growth over the
same process after importing torch and onnxruntime and making the batches; the loss after the last step (the
same for runners computing the same thing). `--profile` adds ONNX Runtime's kernel time per op type (and torch's
self time per op for eager PyTorch); the profilers slow the steps they record. Prints a markdown table and writes
benchmarks/results/run_all.json.

Threads: one per runner by default (`torch.set_num_threads`, ONNX Runtime `intra_op_num_threads`): with two OpenMP
threads on a 2-core machine that something else also uses, the threads spin-wait on each other (eager PyTorch
measured 15x slower that way). Use `--threads 2` on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import (  # noqa: E402
    DEFAULT_WORKLOADS,
    WORKLOADS,
    compile_bytecode,
    environment,
    environment_line,
    markdown_table,
    save_json,
)
from lockstep import Worker, interleave, ratio_statistics, serve, time_statistics  # noqa: E402
from runners import DEFAULT_VARIANTS, RUNNERS, VARIANTS, make_runner, runner_env, scalar  # noqa: E402

BASELINES = ("pytorch", "pytorch-fused")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def worker(runner: str, workload_name: str, threads: int, profile: bool) -> None:
    import onnxruntime  # imported by every runner, so the baseline below includes it
    import torch

    ort_version = onnxruntime.__version__
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name]
    batches = [workload.make_batch() for _ in range(4)]
    baseline = _rss_mb()
    if runner.startswith("orttrainer["):  # imported before the clock: the first step is construction and one step
        import orttrainer  # noqa: F401
    torch.manual_seed(1)  # the same initial weights for every runner
    state: dict = {"i": 0}

    def first() -> dict:
        start = time.perf_counter()
        state["step"], state["note"], state["profile"] = make_runner(runner, workload, threads, profile)
        state["loss"] = state["step"](*batches[0])
        first_s = time.perf_counter() - start
        return {"first_step_s": first_s, "baseline_rss_mb": baseline, "note": state["note"], "onnxruntime": ort_version}

    def step() -> None:
        state["i"] += 1
        state["loss"] = state["step"](*batches[state["i"] % len(batches)])

    def summary() -> dict:
        result = {"peak_rss_mb": _rss_mb(), "last_loss": scalar(state["loss"]), "steps": state["i"] + 1}
        if profile:
            result["profile"] = state["profile"]() if state["profile"] else _torch_profile(step)
        return result

    serve(first, step, summary)


def _torch_profile(step, steps: int = 3) -> dict[str, float]:
    """Self CPU time per aten op (ms per step) of eager PyTorch."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    totals = {e.key: e.self_cpu_time_total / 1000.0 / steps for e in prof.key_averages()}
    return dict(sorted(((k, v) for k, v in totals.items() if v > 0), key=lambda kv: -kv[1]))


def measure(name: str, runners: list[str], args: argparse.Namespace, cache_root: str) -> list[dict]:
    """Start each runner's process (one at a time, each on an empty compile cache of its own), interleave their
    steps, collect the results; then a second process of each orttrainer runner on the cache the first filled."""
    flags = ["--threads", str(args.threads)] + (["--profile"] if args.profile else [])
    workers, results, environments = {}, [], {}
    for runner in runners:
        print(f"{name}: starting {runner} ...", file=sys.stderr, flush=True)
        base, _, other = runner.partition("@")
        python = args.other_python if other else sys.executable
        cache = os.path.join(cache_root, name, runner.replace("[", "-").replace("]", "").replace("@", "-"))
        environments[runner] = env = {**runner_env(base), "ORTTRAINER_COMPILE_CACHE": cache}
        try:
            workers[runner] = Worker(__file__, [base, name, *flags], env=env, python=python)
        except RuntimeError as err:  # report the others; the failure is in the table and the exit status
            results.append({"runner": runner, "workload": name, "failed": str(err).strip().splitlines()[-1]})
    print(f"{name}: {args.rounds} interleaved rounds ...", file=sys.stderr, flush=True)
    per_round = interleave(workers, args.rounds, args.steps, args.warmup)
    for runner, w in workers.items():
        result = {"runner": runner, "workload": name, **w.ready, **w.finish(), "times_ms": per_round[runner]}
        result["time_ms"] = time_statistics(per_round[runner])
        for base in BASELINES:
            if base in per_round:
                result[f"vs_{base}"] = ratio_statistics(per_round[runner], per_round[base])
        results.append(result)
    for result in results:
        runner = result["runner"]
        if args.cache_run and runner.startswith("orttrainer[") and "failed" not in result:
            print(f"{name}: {runner} again, on the compile cache ...", file=sys.stderr, flush=True)
            base, _, other = runner.partition("@")
            python = args.other_python if other else sys.executable
            again = Worker(__file__, [base, name, *flags], env=environments[runner], python=python)
            result["cached_first_step_s"] = again.ready["first_step_s"]
            result["cached_peak_rss_growth_mb"] = again.finish()["peak_rss_mb"] - again.ready["baseline_rss_mb"]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="threads per runner (1: comparable on a shared machine)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3, help="steps per runner per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=list(WORKLOADS))
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS + VARIANTS))
    parser.add_argument(
        "--no-variants",
        dest="variants",
        action="store_false",
        help="leave out orttrainer[ort] with each switch flipped",
    )
    parser.add_argument(
        "--other-python",
        default="",
        help="a second interpreter (a venv with the maintained onnxruntime): its orttrainer runners, as '@other'",
    )
    parser.add_argument("--profile", action="store_true", help="kernel time per op type (slows the steps)")
    parser.add_argument(
        "--no-cache-run",
        dest="cache_run",
        action="store_false",
        help="leave out the second process of each orttrainer runner on the compile cache",
    )
    parser.add_argument("--worker", nargs=2, metavar=("RUNNER", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.threads, args.profile)
        return 0
    runners = list(dict.fromkeys(args.runners + (list(DEFAULT_VARIANTS) if args.variants else [])))
    if args.other_python:  # the orttrainer runners again, on the other interpreter's onnxruntime
        runners += [f"{r}@other" for r in other_runners(runners, args.other_python)]
    pythons = list(dict.fromkeys([sys.executable, *([args.other_python] if args.other_python else [])]))
    bytecode = compile_bytecode(pythons)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="orttrainer-bench-cache-") as cache_root:
        results = [r for name in args.workloads for r in measure(name, runners, args, cache_root)]
    text = report(results, args)
    print(text + f"\n\nBytecode: {bytecode}.")
    payload = {"arguments": vars(args), "environment": {**environment(), "bytecode": bytecode}, "results": results}
    payload["wall_s"] = time.perf_counter() - started
    print(f"\nJSON: {save_json('run_all.json', payload)}")
    return 1 if any("failed" in r for r in results) else 0


def other_runners(runners: list[str], python: str) -> list[str]:
    """The orttrainer runners that `python`'s onnxruntime can run: without the training build, those of the
    `torch` builder (the 'ort' builder needs onnxruntime-training), and that builder with the update in the graph."""
    probe = "from orttrainer.trainer.runtime import has_training_build; print(has_training_build())"
    training = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    chosen = [r for r in runners if r.startswith("orttrainer[")]
    if training == "True":
        return chosen
    return [r for r in chosen if r.startswith("orttrainer[torch]")] + ["orttrainer[torch]+graph-update"]


def _ratio(r: dict, base: str) -> str:
    s = r.get(f"vs_{base}")
    return f"{s['median']:.2f}x ({s['q1']:.2f}–{s['q3']:.2f})" if s else "–"


def report(results: list[dict], args: argparse.Namespace) -> str:
    rows = []
    for r in results:
        name = WORKLOADS[r["workload"]].name
        if "failed" in r:
            rows.append([name, r["runner"], *["–"] * 8, f"failed: {r['failed']}"])
            continue
        t = r["time_ms"]
        rows.append(
            [
                name,
                r["runner"] + (f" (onnxruntime {r['onnxruntime']})" if "@" in r["runner"] else ""),
                f"{t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f})",
                _ratio(r, "pytorch"),
                _ratio(r, "pytorch-fused"),
                f"{r['first_step_s']:.2f}",
                f"{r['cached_first_step_s']:.2f}" if "cached_first_step_s" in r else "–",
                f"{r['peak_rss_mb']:.0f}",
                f"{r['peak_rss_mb'] - r['baseline_rss_mb']:.0f}",
                f"{r['last_loss']:.5g}",
                r["note"],
            ]
        )
    header = [
        "workload",
        "runner",
        "ms/step: median (range of round medians)",
        "vs eager (IQR)",
        "vs eager fused Adam (IQR)",
        "first step (s)",
        "first step, 2nd process, cache (s)",
        "peak RSS (MB)",
        "RSS growth (MB)",
        "last loss",
        "note",
    ]
    env = environment()
    text = (
        f"{environment_line(env)}; {args.threads} thread(s) per runner; Adam lr 1e-3; {args.rounds} interleaved rounds "
        f"of {args.steps} steps after {args.warmup} warm-up steps.\n\n" + markdown_table(header, rows)
    )
    for r in results:
        if r.get("profile"):
            top = list(r["profile"].items())[:15]
            text += f"\n\nKernel time per op type, {WORKLOADS[r['workload']].name}, {r['runner']} (ms/step):\n\n"
            text += markdown_table(["op type", "ms/step"], [[op, f"{ms:.2f}"] for op, ms in top])
    return text


if __name__ == "__main__":
    sys.exit(main())
