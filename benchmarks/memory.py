"""Peak memory of a training step with each recompute option (graph_transformer.*_recompute) and
utils.memory_efficient_gradient off and on.

    python benchmarks/memory.py [--steps 3] [--threads 1]

The 2-layer transformer of common.py (Embedding(1000, 256), 2 x TransformerEncoderLayer(256, 4 heads, ff 1024,
GELU), batch 16 x seq 128), once as common.py builds it (dropout 0: the GELU output feeds linear2 directly) and once
with dropout 0.1 (attention dropout exists; the GELU output then only feeds a dropout, whose output is what the
backward pass keeps). Every configuration runs in its own process: it trains one step (export, compile, first run),
resets the kernel's peak-RSS counter (`/proc/self/clear_refs`), trains `--steps` more and reads `VmHWM`.

Measured: the *step peak*, `VmHWM` minus the resident memory between steps. ONNX Runtime's CPU arena is off
(`SessionOptions.enable_cpu_mem_arena = False`), so each run allocates its planned block of intermediate tensors
(the memory pattern: its size is the planner's peak) and returns it afterwards; the step peak is that block plus
the step's other transient buffers. With the arena on, the arena keeps its high-water mark between steps and the
difference drowns in allocator noise (`--arena` shows it). Prints a markdown table and writes
benchmarks/results/memory.json. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import WORKLOADS, markdown_table, run_worker, save_json  # noqa: E402

CONFIGS = {
    "off": {},
    "gelu_recompute": {"graph_transformer": {"gelu_recompute": True}},
    "attn_dropout_recompute": {"graph_transformer": {"attn_dropout_recompute": True}},
    "transformer_layer_recompute": {"graph_transformer": {"transformer_layer_recompute": True}},
    "memory_efficient_gradient": {"utils": {"memory_efficient_gradient": True}},
}
DROPOUTS = (0.0, 0.1)


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _set_dropout(model, p: float) -> None:
    for layer in model.encoder.layers:
        layer.dropout.p = layer.dropout1.p = layer.dropout2.p = p
        layer.self_attn.dropout = p


def worker(config: str, dropout: float, steps: int, threads: int, arena: bool) -> dict:
    import warnings

    import onnxruntime as ort
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim
    from orttrainer.trainer.graph.recompute import count_recompute_nodes

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS["transformer"]
    model = workload.make_model()
    _set_dropout(model, dropout)
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = threads
    session_options.log_severity_level = 3
    session_options.enable_cpu_mem_arena = arena
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "session_options": session_options, **CONFIGS[config]})
    trainer = ORTTrainer(
        model, workload.model_desc, optim.AdamConfig(lr=1e-4), loss_fn=workload.loss_fn, options=options
    )
    batch = workload.make_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train_step(*batch)
    notes = [str(w.message) for w in caught if "recompute" in str(w.message)]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(*batch)
    seconds = (time.perf_counter() - start) / steps
    peak = _status_mib("VmHWM")
    return {
        "config": config,
        "dropout": dropout,
        "peak_rss_mib": peak,
        "rss_before_mib": before,
        "step_peak_mib": peak - before,
        "step_s": seconds,
        "recompute_nodes": sum(count_recompute_nodes(trainer._built.compiled.training.model).values()),
        "notes": notes,
    }


def _median(runs: list[dict]) -> dict:
    """The run with the median step peak, with every run's step peak attached."""
    ordered = sorted(runs, key=lambda r: r["step_peak_mib"])
    return {**ordered[len(ordered) // 2], "step_peaks_mib": [r["step_peak_mib"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arena", action="store_true", help="keep ONNX Runtime's CPU arena on")
    parser.add_argument("--repeat", type=int, default=1, help="processes per configuration (the median is shown)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "DROPOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], float(args.worker[1]), args.steps, args.threads, args.arena)))
        return
    flags = ["--steps", str(args.steps), "--threads", str(args.threads)] + (["--arena"] if args.arena else [])
    results = [
        _median([run_worker(__file__, [config, str(p), *flags]) for _ in range(args.repeat)])
        for p in DROPOUTS
        for config in CONFIGS
    ]
    rows = []
    for r in results:
        base = next(b for b in results if b["dropout"] == r["dropout"] and b["config"] == "off")
        change = r["step_peak_mib"] - base["step_peak_mib"]
        rows.append(
            [
                f"dropout {r['dropout']}",
                r["config"],
                r["recompute_nodes"],
                f"{r['rss_before_mib']:.0f}",
                f"{r['step_peak_mib']:.0f}",
                "" if r is base else f"{change:+.0f}",
                f"{1000 * r['step_s']:.0f}",
                "nothing to recompute (warns)" if r["notes"] else "",
            ]
        )
    print(
        f"{WORKLOADS['transformer'].name}; threads: {args.threads}; CPU arena {'on' if args.arena else 'off'}; "
        f"{args.steps} steady-state steps per process; median of {args.repeat} process(es)\n"
    )
    print(
        markdown_table(
            [
                "model",
                "option",
                "recompute nodes",
                "RSS between steps (MiB)",
                "step peak above it (MiB)",
                "vs off (MiB)",
                "ms/step",
                "note",
            ],
            rows,
        )
    )
    payload = {"steps": args.steps, "threads": args.threads, "arena": args.arena, "results": results}
    print(f"\nJSON: {save_json('memory.json', payload)}")


if __name__ == "__main__":
    main()
