"""ONNX Runtime's thread pool spinning between runs, on every core: orttrainer's own SessionOptions (no spinning
between runs) against ONNX Runtime's defaults (a user's plain `SessionOptions()`, which spin) and against spinning
during a run only (a user's `SessionOptions()` with `session.force_spinning_stop`), beside eager PyTorch.

    python benchmarks/thread_spinning.py [--workloads mlp lstm transformer cnn] [--rounds 2] [--steps 15]

Threads are each library's default (every core), as a user gets them; the other benchmarks give each runner one
thread, where ONNX Runtime has no pool to spin. A step of the trainer is an ONNX Runtime run, then torch's fused
update; the pool's threads, spinning after the run, take the cores that torch's update needs (docs/engine.md
§3.3). For each workload a first process fills a compile cache; then `--rounds` rounds run one process per variant
in turn, each timing `--steps` steps after 3 warm-up steps (their median). Prints a markdown table (the median of
the rounds) and writes benchmarks/results/thread_spinning.json.
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
from runners import make_runner, make_trainer  # noqa: E402

# variant -> the session config entries of a user's SessionOptions (None: orttrainer's own SessionOptions)
VARIANTS: dict[str, dict[str, str] | None] = {
    "orttrainer": None,
    "ONNX Runtime's spinning": {},
    "spinning stopped after each run": {"session.force_spinning_stop": "1"},
}


def worker(variant: str, workload_name: str, steps: int) -> dict:
    import onnxruntime as ort
    import torch

    torch.manual_seed(0)
    workload = WORKLOADS[workload_name]
    batch = workload.make_batch()
    if variant == "pytorch":
        step = make_runner("pytorch", workload, torch.get_num_threads(), False)[0]
    else:
        session_options = None
        entries = VARIANTS[variant]
        if entries is not None:  # a user's SessionOptions: ONNX Runtime's defaults (spinning) and `entries`
            session_options = ort.SessionOptions()
            session_options.log_severity_level = 3
            for key, value in entries.items():
                session_options.add_session_config_entry(key, value)
        step = make_trainer(workload, session_options).train_step
    return {"step_ms": median_step_ms(step, batch, steps), "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "lstm", "transformer", "cnn"], choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps)))
        return
    bytecode = compile_bytecode()
    results: dict[str, dict[str, list[float]]] = {}
    for name in args.workloads:
        with tempfile.TemporaryDirectory(prefix="orttrainer-thread-spinning-") as cache:
            env = {"ORTTRAINER_COMPILE_CACHE": cache}
            run_worker(__file__, ["orttrainer", name, "--steps", "1"], env=env)  # fills the cache
            results[name] = {variant: [] for variant in ("pytorch", *VARIANTS)}
            for _ in range(args.rounds):
                for variant in results[name]:
                    measured = run_worker(__file__, [variant, name, "--steps", str(args.steps)], env=env)
                    results[name][variant].append(measured["step_ms"])
    rows = []
    for name, by_variant in results.items():
        eager = statistics.median(by_variant["pytorch"])
        medians = [statistics.median(by_variant[v]) for v in VARIANTS]
        rows.append([WORKLOADS[name].name, f"{eager:.1f}", *(f"{m:.1f} ({m / eager:.2f}x)" for m in medians)])
    header = ["workload", "eager PyTorch (ms/step)", *(f"{v} (vs eager)" for v in VARIANTS)]
    env = environment()
    print(
        f"{environment_line(env)}; each library's default threads; {args.rounds} rounds\n\n"
        + markdown_table(header, rows)
    )
    payload = {"environment": {**env, "bytecode": bytecode}, "arguments": vars(args), "results": results}
    print(f"\nJSON: {save_json('thread_spinning.json', payload)}")


if __name__ == "__main__":
    main()
