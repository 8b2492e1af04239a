"""ms per train_step of ORTTrainer in float32 vs mixed precision (fp16 compute, fp32 master weights).

    python benchmarks/mixed_precision.py [--threads 2] [--steps 20]

On a CPU, ONNX Runtime has no float16 kernels: mixed precision wraps the fp32 kernels in casts and is expected to be
slower — it exists there to be correct, not fast. On a machine where ONNX Runtime's CUDA provider works, the script
also measures device.id 'cuda'. Prints a markdown table and writes benchmarks/results/mixed_precision.json; each
measurement runs in its own process.
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


def worker(precision: str, workload_name: str, device: str, threads: int, steps: int, warmup: int) -> dict:
    import onnxruntime as ort
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, amp, optim

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name]
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = threads
    session_options.log_severity_level = 3
    options = {"device": {"id": device}, "session_options": session_options}
    if precision == "mixed":
        options["mixed_precision"] = {"enabled": True, "loss_scaler": amp.DynamicLossScaler(loss_scale=1024.0)}
    trainer = ORTTrainer(
        workload.make_model(),
        workload.model_desc,
        optim.AdamConfig(lr=1e-4),
        loss_fn=workload.loss_fn,
        options=ORTTrainerOptions(options),
    )
    batches = [tuple(t.to(device) for t in workload.make_batch()) for _ in range(4)]
    start = time.perf_counter()
    trainer.train_step(*batches[0])
    first = time.perf_counter() - start
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        trainer.train_step(*batches[i % len(batches)])
        times.append(time.perf_counter() - start)
    return {
        "precision": precision,
        "workload": workload_name,
        "device": device,
        "first_step_s": first,
        "median_ms": 1000 * statistics.median(times[warmup:]),
        "finite_steps": trainer.optimization_step,
    }


def cuda_usable() -> bool:
    try:
        import onnxruntime as ort
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", nargs=3, metavar=("PRECISION", "WORKLOAD", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.threads, args.steps, args.warmup)))
        return
    devices = ["cpu"] + (["cuda"] if cuda_usable() else [])
    flags = ["--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    results = [
        run_worker(__file__, [precision, name, device, *flags])
        for device in devices
        for name in WORKLOADS
        for precision in ("fp32", "mixed")
    ]
    rows = []
    for r in results:
        base = next(
            b
            for b in results
            if b["workload"] == r["workload"] and b["device"] == r["device"] and b["precision"] == "fp32"
        )
        rows.append(
            [
                WORKLOADS[r["workload"]].name,
                r["device"],
                r["precision"],
                f"{r['median_ms']:.1f}",
                f"{r['median_ms'] / base['median_ms']:.2f}x",
                f"{r['first_step_s']:.2f}",
            ]
        )
    print(f"threads: {args.threads}{'' if 'cuda' in devices else '; no usable CUDA device here: CPU only'}\n")
    print(markdown_table(["workload", "device", "precision", "ms/step (median)", "vs fp32", "first step (s)"], rows))
    print(f"\nJSON: {save_json('mixed_precision.json', {'threads': args.threads, 'results': results})}")


if __name__ == "__main__":
    main()
