"""orttrainer against its peers, in one run on the same models, batches, optimizer and thread count.

    python benchmarks/run_all.py [--threads 1] [--steps 20] [--repeats 3] [--workloads mlp transformer] [--runners ...]

Runners (each measured in its own fresh process, see common.py):
- `pytorch`: eager PyTorch, `torch.optim.Adam` (foreach).
- `torch.compile`: the same with the model compiled by `torch.compile` (Inductor); the optimizer step stays eager.
  Its first step includes the compilation.
- `orttrainer[ort]`: ORTTrainer with ONNX Runtime's gradient builder (`AdamConfig`, no clipping).
- `orttrainer[torch]`: the same with the `torch` gradient builder (`_internal_use.gradient_builder='torch'`), when
  this build has that option; otherwise the row says it was skipped.
- `ort-training-api`: ONNX Runtime's own on-device training API: the model + loss exported with the TorchScript
  exporter, artifacts from `onnxruntime.training.artifacts.generate_artifacts` (with `onnxblock.optim.AdamW`,
  eps 1e-8, no weight decay, and its AdamWOptimizer node switched to `adam_mode=0`, PyTorch's formula: the default,
  1, is Hugging Face's), then `onnxruntime.training.api.Module` + `Optimizer`.

Every runner does Adam with lr 1e-3, betas (0.9, 0.999), eps 1e-8, bias correction, no weight decay, no clipping,
from the same initial weights. Reported: median ms per step after warm-up; the time to the first step (everything
from building the runner — export, compile, artifact generation, session creation — to the end of step 1); and peak
memory as the process's peak resident set size (`resource.getrusage(RUSAGE_SELF).ru_maxrss`), also as growth over
the same process after importing torch and onnxruntime and making the batches, so the libraries themselves cancel
out. Prints a markdown table and writes benchmarks/results/run_all.json.

Threads: one per runner by default (`torch.set_num_threads`, ONNX Runtime `intra_op_num_threads`). With two threads on
a 2-core machine that something else is also using, PyTorch's OpenMP threads spin-wait on each other and eager
PyTorch measured 15x slower (328 ms instead of 21 ms per MLP step), which says nothing about PyTorch; one thread per
runner keeps the comparison meaningful on a shared machine. Use `--threads 2` on an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import WORKLOADS, markdown_table, run_worker, save_json  # noqa: E402

RUNNERS = ("pytorch", "torch.compile", "orttrainer[ort]", "orttrainer[torch]", "ort-training-api")
LR = 1e-3


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _scalar(value) -> float:
    return float(value.detach()) if hasattr(value, "detach") else float(value)


def _session_options(threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


def _pytorch(workload, threads: int, compiled: bool):
    import torch

    model = workload.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    forward = torch.compile(model) if compiled else model

    def step(x, target):
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss_fn(forward(x), target)
        loss.backward()
        optimizer.step()
        return loss

    return step, "first step includes Inductor compilation" if compiled else ""


def _orttrainer(workload, threads: int, builder: str):
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    options = {
        "device": {"id": "cpu"},
        "utils": {"grad_norm_clip": False},
        "session_options": _session_options(threads),
    }
    if builder != "ort":
        options["_internal_use"] = {"gradient_builder": builder}
    trainer = ORTTrainer(
        workload.make_model(),
        workload.model_desc,
        optim.AdamConfig(lr=LR),
        loss_fn=workload.loss_fn,
        options=ORTTrainerOptions(options),
    )
    return trainer.train_step, "first step includes export and graph compilation"


def _training_api(workload, threads: int):
    import onnx
    import torch
    from onnxruntime.training import artifacts, onnxblock
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from orttrainer.trainer.export import _ModelWithLoss
    from orttrainer.trainer.graph.fixups import name_optional_outputs

    model = workload.make_model()
    names = [name for name, _ in workload.model_desc["inputs"]]
    wrapper = _ModelWithLoss(model, workload.loss_fn, names)
    sample = workload.make_batch()
    path = tempfile.mkdtemp(prefix="ort_training_api_")
    exported = os.path.join(path, "model.onnx")
    torch.onnx.export(
        wrapper,
        sample,
        exported,
        input_names=names,
        output_names=["loss"],
        dynamic_axes={n: {0: "batch"} for n in names},
        opset_version=14,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
        dynamo=False,
    )
    # onnxblock's gradient builder needs the optional outputs of LayerNormalization/SoftmaxCrossEntropyLoss named
    # (docs/engine.md §3.3); orttrainer's own fix-up pass does exactly that.
    forward = name_optional_outputs(onnx.load(exported))
    float_inits = [i.name for i in forward.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    trainable = [n for n in float_inits if n.startswith("model.")]  # the exporter prefixes the wrapped module
    artifacts.generate_artifacts(
        forward,
        requires_grad=trainable,
        frozen_params=[],
        loss=None,
        optimizer=onnxblock.optim.AdamW(eps=1e-8, weight_decay=0.0),
        artifact_directory=path,
    )
    optimizer_path = os.path.join(path, "optimizer_model.onnx")
    optimizer_model = onnx.load(optimizer_path)
    for node in optimizer_model.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attribute in node.attribute:
                if attribute.name == "adam_mode":
                    attribute.i = 0  # PyTorch's Adam(W) formula
    onnx.save(optimizer_model, optimizer_path)
    state = CheckpointState.load_checkpoint(os.path.join(path, "checkpoint"))
    module = Module(
        os.path.join(path, "training_model.onnx"),
        state,
        os.path.join(path, "eval_model.onnx"),
        device="cpu",
        session_options=_session_options(threads),
    )
    optimizer = Optimizer(optimizer_path, module)
    optimizer.set_learning_rate(LR)
    module.train()

    def step(x, target):
        outputs = module(x.numpy(), target.numpy())  # the training graph's outputs: (loss,)
        optimizer.step()
        module.lazy_reset_grad()
        return outputs[0]

    return step, "first step includes export and generate_artifacts; AdamW adam_mode patched to 0"


def worker(runner: str, workload_name: str, threads: int, steps: int, warmup: int) -> dict:
    import onnxruntime  # noqa: F401  imported by every runner, so the baseline below includes it
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    workload = WORKLOADS[workload_name]
    batches = [workload.make_batch() for _ in range(4)]
    baseline = _rss_mb()
    torch.manual_seed(1)  # the same initial weights for every runner
    start = time.perf_counter()
    if runner in ("pytorch", "torch.compile"):
        step, note = _pytorch(workload, threads, compiled=runner == "torch.compile")
    elif runner.startswith("orttrainer["):
        step, note = _orttrainer(workload, threads, runner[len("orttrainer[") : -1])
    elif runner == "ort-training-api":
        step, note = _training_api(workload, threads)
    else:
        raise ValueError(f"unknown runner {runner!r}")
    first_loss = _scalar(step(*batches[0]))
    first = time.perf_counter() - start
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = step(*batches[(i + 1) % len(batches)])
        times.append(time.perf_counter() - start)
    return {
        "runner": runner,
        "workload": workload_name,
        "threads": threads,
        "first_step_s": first,
        "median_ms": 1000 * statistics.median(times[warmup:]),
        "min_ms": 1000 * min(times[warmup:]),
        "steps": steps,
        "first_loss": first_loss,
        "last_loss": _scalar(loss),
        "peak_rss_mb": _rss_mb(),
        "baseline_rss_mb": baseline,
        "note": note,
    }


def torch_builder_available() -> bool:
    from orttrainer import ORTTrainerOptions

    try:
        ORTTrainerOptions({"_internal_use": {"gradient_builder": "torch"}})
    except ValueError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads per runner (1: stays comparable while other jobs share the machine)",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="processes per runner; the table keeps the best")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    parser.add_argument("--worker", nargs=2, metavar=("RUNNER", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    flags = ["--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.worker:
        print(json.dumps(worker(*args.worker, args.threads, args.steps, args.warmup)))
        return 0
    has_torch_builder = torch_builder_available()
    runs: dict[tuple[str, str], list[dict]] = {(w, r): [] for w in args.workloads for r in args.runners}
    # Repeats go round all runners in turn, so a burst of load from elsewhere on the machine hits one process of a
    # runner, not all of them; the best of the repeats is the one least disturbed.
    for repeat in range(args.repeats):
        for (name, runner), done in runs.items():
            if runner == "orttrainer[torch]" and not has_torch_builder:
                continue
            if done and "failed" in done[-1]:
                continue
            print(f"[{repeat + 1}/{args.repeats}] {name}: {runner} ...", file=sys.stderr, flush=True)
            try:
                # Inductor's on-disk caches off: every torch.compile process compiles from scratch, as on a fresh
                # machine, so its first step means the same in every repeat.
                done.append(
                    run_worker(
                        __file__, [runner, name, *flags], timeout=1200, env={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
                    )
                )
            except Exception as err:  # report the others; the failure is in the table and the exit status
                done.append({"runner": runner, "workload": name, "failed": str(err).strip().splitlines()[-1]})
    results = []
    for (name, runner), done in runs.items():
        if runner == "orttrainer[torch]" and not has_torch_builder:
            results.append(
                {
                    "runner": runner,
                    "workload": name,
                    "skipped": "this build has no "
                    "_internal_use.gradient_builder option (the torch builder is not integrated)",
                }
            )
        elif any("failed" in r for r in done):
            results.append(next(r for r in done if "failed" in r))
        else:
            results.append(best_of(done))
    print(report(results, args.threads, args.repeats))
    payload = {
        "threads": args.threads,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "environment": environment(),
        "results": results,
        "all_runs": [r for done in runs.values() for r in done],
    }
    print(f"\nJSON: {save_json('run_all.json', payload)}")
    return 1 if any("failed" in r for r in results) else 0


def best_of(runs: list[dict]) -> dict:
    """The repeat with the lowest median step time; the first step and memory as their best and worst over all."""
    best = dict(min(runs, key=lambda r: r["median_ms"]))
    best["first_step_s"] = min(r["first_step_s"] for r in runs)
    best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    best["baseline_rss_mb"] = min(r["baseline_rss_mb"] for r in runs)
    best["median_ms_all"] = [r["median_ms"] for r in runs]
    return best


def environment() -> dict:
    import onnxruntime
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }


def report(results: list[dict], threads: int, repeats: int) -> str:
    rows = []
    for name in dict.fromkeys(r["workload"] for r in results):
        group = [r for r in results if r["workload"] == name]
        base = next((r for r in group if r["runner"] == "pytorch" and "median_ms" in r), None)
        for r in group:
            if "median_ms" not in r:
                rows.append(
                    [
                        WORKLOADS[name].name,
                        r["runner"],
                        "–",
                        "–",
                        "–",
                        "–",
                        "–",
                        "–",
                        r.get("skipped") or f"failed: {r['failed']}",
                    ]
                )
                continue
            ratio = f"{r['median_ms'] / base['median_ms']:.2f}x" if base else "–"
            rows.append(
                [
                    WORKLOADS[name].name,
                    r["runner"],
                    f"{r['median_ms']:.1f}",
                    ratio,
                    f"{r['first_step_s']:.2f}",
                    f"{r['peak_rss_mb']:.0f}",
                    f"{r['peak_rss_mb'] - r['baseline_rss_mb']:.0f}",
                    f"{r['last_loss']:.5g}",
                    r["note"],
                ]
            )
    header = [
        "workload",
        "runner",
        "ms/step (median)",
        "vs PyTorch eager",
        "first step (s)",
        "peak RSS (MB)",
        "RSS growth (MB)",
        "loss at the last step",
        "note",
    ]
    return (
        f"CPU threads: {threads}; Adam lr {LR}; the same initial weights and batches, so the last column should "
        f"agree. Best of {repeats} processes per runner (step time: lowest median; first step: lowest; "
        "memory: highest).\n\n" + markdown_table(header, rows)
    )


if __name__ == "__main__":
    sys.exit(main())
