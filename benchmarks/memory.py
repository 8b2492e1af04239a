"""Peak memory and step time of a training step with each recompute option (graph_transformer.*_recompute) and
utils.memory_efficient_gradient off and on, for each gradient builder.

    python benchmarks/memory.py [--builders ort torch] [--layers 2 6] [--dropouts 0.0 0.1] [--repeat 1]
                                [--steps 3] [--rounds 6] [--threads 1]

The transformer of common.py (Embedding(1000, 256), TransformerEncoderLayer(256, 4 heads, ff 1024, GELU) x
`--layers`, batch 16 x seq 128), with dropout 0 (as common.py builds it: the GELU output feeds linear2 directly)
and 0.1 (attention dropout exists; the GELU output then only feeds a dropout, whose output is what the backward
pass keeps). Configurations: off, each recompute option, `number_recompute_layers` = layers // 2 (the first half),
and memory-efficient gradients. The `ort` builder runs where onnxruntime-training is installed.

Memory, each configuration in its own process: it trains one step (export, compile, first run), resets the
kernel's peak-RSS counter (`/proc/self/clear_refs`), trains `--steps` more and reads `VmHWM`. The *step peak* is
`VmHWM` minus the resident memory between steps. ONNX Runtime's CPU arena is off
(`SessionOptions.enable_cpu_mem_arena = False`), so each run allocates its intermediate tensors and returns them,
and glibc's mmap threshold is fixed at 64 KiB (`MALLOC_MMAP_THRESHOLD_`): every tensor is its own mapping, given
back to the kernel when freed, so the resident memory follows the live tensors. (glibc's default threshold adapts
to the allocation history; the torch builder's step peak then moved by up to 20 MiB between identical runs.)

Time, interleaved (benchmarks/lockstep.py): one process per configuration with the arena on and the default
allocator (as training runs), all alive at once, stepping in turn for `--rounds` rounds of 2 steps after 2 warm-up
steps; the ratio to `off` is the median of the per-round ratios (with the quartiles).

Prints a markdown table per builder and workload and writes benchmarks/results/memory.json. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import WORKLOADS, markdown_table, run_worker, save_json  # noqa: E402
from lockstep import Worker, interleave, ratio_statistics, serve, time_statistics  # noqa: E402

DROPOUTS = (0.0, 0.1)
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def configs(layers: int) -> dict[str, dict]:
    return {
        "off": {},
        "gelu_recompute": {"graph_transformer": {"gelu_recompute": True}},
        "attn_dropout_recompute": {"graph_transformer": {"attn_dropout_recompute": True}},
        "transformer_layer_recompute": {"graph_transformer": {"transformer_layer_recompute": True}},
        f"first {layers // 2} layers": {
            "graph_transformer": {"transformer_layer_recompute": True, "number_recompute_layers": layers // 2}
        },
        "memory_efficient_gradient": {"utils": {"memory_efficient_gradient": True}},
    }


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


def _trainer(builder: str, layers: int, config: str, dropout: float, threads: int, arena: bool):
    import warnings

    import onnxruntime as ort
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS["transformer"]
    model = workload.make_model()
    if layers != len(model.encoder.layers):
        model.encoder = torch.nn.TransformerEncoder(model.encoder.layers[0], layers, enable_nested_tensor=False)
    _set_dropout(model, dropout)
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = threads
    session_options.log_severity_level = 3
    session_options.enable_cpu_mem_arena = arena
    options = ORTTrainerOptions(
        {
            "device": {"id": "cpu"},
            "session_options": session_options,
            "_internal_use": {"gradient_builder": builder},
            **configs(layers)[config],
        }
    )
    trainer = ORTTrainer(
        model, workload.model_desc, optim.AdamConfig(lr=1e-4), loss_fn=workload.loss_fn, options=options
    )
    batch = workload.make_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        trainer.train_step(*batch)
        first = time.perf_counter() - start
    notes = [str(w.message) for w in caught if "recompute" in str(w.message)]
    return trainer, batch, first, notes


def _recomputed(trainer) -> int:
    from orttrainer.trainer.gradient.torch_builder import RECOMPUTED_KEY
    from orttrainer.trainer.graph.recompute import count_recompute_nodes

    model = trainer._built.compiled.training.model
    meta = {p.key: p.value for p in model.metadata_props}
    if RECOMPUTED_KEY in meta:  # the torch builder: how many nodes its backward recomputes
        return int(meta[RECOMPUTED_KEY])
    return sum(count_recompute_nodes(model).values())


def memory_worker(builder: str, layers: int, config: str, dropout: float, steps: int, threads: int) -> dict:
    trainer, batch, first, notes = _trainer(builder, layers, config, dropout, threads, arena=False)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(*batch)
    seconds = (time.perf_counter() - start) / steps
    peak = _status_mib("VmHWM")
    return {
        "builder": builder,
        "layers": layers,
        "config": config,
        "dropout": dropout,
        "peak_rss_mib": peak,
        "rss_before_mib": before,
        "step_peak_mib": peak - before,
        "step_s_arena_off": seconds,
        "first_step_s": first,
        "recomputed_nodes": _recomputed(trainer),
        "notes": notes,
    }


def time_worker(builder: str, layers: int, config: str, dropout: float, threads: int) -> None:
    state: dict = {}

    def first() -> dict:
        state["trainer"], state["batch"], seconds, _ = _trainer(builder, layers, config, dropout, threads, True)
        return {"first_step_s": seconds}

    def step():
        return state["trainer"].train_step(*state["batch"])

    serve(first, step, lambda: {})


def _median_run(runs: list[dict]) -> dict:
    """The run with the median step peak, with every run's step peak attached."""
    ordered = sorted(runs, key=lambda r: r["step_peak_mib"])
    return {**ordered[len(ordered) // 2], "step_peaks_mib": [r["step_peak_mib"] for r in runs]}


def _builders(requested: list[str] | None) -> list[str]:
    if requested:
        return requested
    from orttrainer.trainer.runtime.ort import has_training_build

    return ["ort", "torch"] if has_training_build() else ["torch"]


def _cpu() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPU(s)"
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builders", nargs="*", choices=("ort", "torch"), help="default: every one installed")
    parser.add_argument("--layers", nargs="*", type=int, default=[2, 6])
    parser.add_argument("--dropouts", nargs="*", type=float, default=list(DROPOUTS))
    parser.add_argument("--configs", nargs="*", help="a subset of the configurations (names as in the table)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="memory processes per configuration (median shown)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved timing rounds (0: no timing)")
    parser.add_argument("--worker", nargs=5, metavar=("KIND", "BUILDER", "LAYERS", "CONFIG", "DROPOUT"))
    args = parser.parse_args()
    if args.worker:
        kind, builder, layers, config, dropout = args.worker
        if kind == "memory":
            result = memory_worker(builder, int(layers), config, float(dropout), args.steps, args.threads)
            print(json.dumps(result))
        else:
            time_worker(builder, int(layers), config, float(dropout), args.threads)
        return
    started = time.perf_counter()
    results = []
    for builder in _builders(args.builders):
        for layers in args.layers:
            wanted = set(args.configs or configs(layers)) | {"off"}  # `first` selects the first-half config
            names = [c for c in configs(layers) if c in wanted or (c.startswith("first") and "first" in wanted)]
            for dropout in args.dropouts:
                results += _measure(builder, layers, dropout, names, args)
    cpu = _cpu()
    print(
        f"{WORKLOADS['transformer'].name} with --layers layers; CPU: {cpu}; threads: {args.threads}; memory: "
        f"{args.steps} steady-state steps per process, arena off, {MMAP_ENV}, median of {args.repeat} process(es); "
        f"time: arena on, {args.rounds} interleaved rounds; {time.perf_counter() - started:.0f} s in all\n"
    )
    print(report(results))
    payload = {"cpu": cpu, "args": vars(args), "results": results}
    print(f"\nJSON: {save_json('memory.json', payload)}")


def _measure(builder: str, layers: int, dropout: float, names: list[str], args) -> list[dict]:
    flags = ["--steps", str(args.steps), "--threads", str(args.threads)]
    group = []
    for config in names:
        runs = [
            run_worker(__file__, ["memory", builder, str(layers), config, str(dropout), *flags], env=MMAP_ENV)
            for _ in range(args.repeat)
        ]
        group.append(_median_run(runs))
    if args.rounds > 0:
        workers = {
            config: Worker(__file__, ["time", builder, str(layers), config, str(dropout), *flags]) for config in names
        }
        try:
            per_round = interleave(workers, rounds=args.rounds, steps=2, warmup=2)
        finally:
            for worker in workers.values():
                worker.finish()
        for result in group:
            times = per_round[result["config"]]
            result["step_ms"] = time_statistics(times)
            result["vs_off"] = ratio_statistics(times, per_round["off"])
    return group


def report(results: list[dict]) -> str:
    rows = []
    for r in results:
        base = next(
            b
            for b in results
            if (b["builder"], b["layers"], b["dropout"], b["config"])
            == (r["builder"], r["layers"], r["dropout"], "off")
        )
        change = r["step_peak_mib"] - base["step_peak_mib"]
        ratio = r.get("vs_off")
        rows.append(
            [
                r["builder"],
                r["layers"],
                r["dropout"],
                r["config"],
                r["recomputed_nodes"],
                f"{r['step_peak_mib']:.1f}",
                "" if r is base else f"{change:+.1f} ({100 * change / base['step_peak_mib']:+.0f}%)",
                f"{r['step_ms']['median']:.0f}" if "step_ms" in r else "",
                f"{ratio['median']:.2f}x ({ratio['q1']:.2f}-{ratio['q3']:.2f})" if ratio else "",
                "nothing to recompute (warns)" if r["notes"] else "",
            ]
        )
    header = [
        "builder",
        "layers",
        "dropout",
        "option",
        "recomputed nodes",
        "step peak (MiB)",
        "vs off (MiB)",
        "ms/step",
        "time vs off (IQR)",
        "note",
    ]
    return markdown_table(header, rows)


if __name__ == "__main__":
    main()
