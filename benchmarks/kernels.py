"""ONNX Runtime's CPU kernels against PyTorch's, one kernel at a time, on the benchmark transformer's shapes.

    python benchmarks/kernels.py [--threads 1] [--repeats 25]

Each case is what the torch builder's training graph of the transformer workload (benchmarks/common.py: 16 x 128
tokens, d_model 256, 4 heads, feed-forward 1024, vocabulary 1000) runs, written as the traced graph writes it and
left to ONNX Runtime's optimiser as the trainer's session is (a `Transpose` feeding a `MatMul` becomes a
`FusedMatMul` or a transposed `Gemm`), against the op eager PyTorch runs for the same step:

- each linear layer's forward `x·Wᵀ + b` (eager: `addmm`), input gradient `dy·W` (`mm`) and weight gradient
  `dyᵀ·x` (`mm` of a transposed view);
- the attention's two batched products (eager runs them inside its fused attention kernel; here `matmul`);
- GELU's backward as the chain of 11 elementwise ops the trace writes (eager: `gelu_backward`).

One session per case, `--threads` intra-op threads, interleaved with the torch op, the median of `--repeats` runs
after warm-up. Prints a table (ms and ratio) and writes benchmarks/results/kernels.json: where the graph runs the
same products as eager PyTorch, this is the per-kernel view of what remains (README § Benchmarks).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(__file__))
from common import markdown_table, save_json  # noqa: E402

TOKENS, BATCH, SEQ, HEADS, HEAD_DIM = 2048, 16, 128, 4, 64
LINEAR_LAYERS = {  # name: (in features, out features)
    "attention in-projection": (256, 768),
    "attention out-projection": (256, 256),
    "feed-forward 1": (256, 1024),
    "feed-forward 2": (1024, 256),
    "head": (256, 1000),
}
Case = tuple[str, onnx.ModelProto, dict[str, np.ndarray], Callable[[], object]]


def _model(nodes, inputs: dict[str, np.ndarray], output: str, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "kernel",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape)) for n, a in inputs.items()],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _random(*shape: int) -> np.ndarray:
    return np.random.default_rng(len(shape) + sum(shape)).standard_normal(shape).astype(np.float32)


def linear_cases(name: str, features_in: int, features_out: int) -> list[Case]:
    x, w, b, dy = (
        _random(TOKENS, features_in),
        _random(features_out, features_in),
        _random(features_out),
        _random(TOKENS, features_out),
    )
    tx, tw, tb, tdy = (torch.from_numpy(a) for a in (x, w, b, dy))
    transpose_w = helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0])
    forward = _model([transpose_w, helper.make_node("Gemm", ["x", "wt", "b"], ["y"])], {"x": x, "w": w, "b": b}, "y")
    input_grad = _model([helper.make_node("MatMul", ["dy", "w"], ["dx"])], {"dy": dy, "w": w}, "dx")
    weight_grad = _model(
        [
            helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0]),
            helper.make_node("MatMul", ["dyt", "x"], ["dw"]),
        ],
        {"dy": dy, "x": x},
        "dw",
    )
    shape = f"[{TOKENS}, {features_in}] -> {features_out}"
    return [
        (f"{name} {shape}: forward", forward, {"x": x, "w": w, "b": b}, lambda: torch.addmm(tb, tx, tw.t())),
        (f"{name} {shape}: input gradient", input_grad, {"dy": dy, "w": w}, lambda: torch.mm(tdy, tw)),
        (f"{name} {shape}: weight gradient", weight_grad, {"dy": dy, "x": x}, lambda: torch.mm(tdy.t(), tx)),
    ]


def attention_cases() -> list[Case]:
    q, k, p, v = (
        _random(BATCH, HEADS, SEQ, HEAD_DIM),
        _random(BATCH, HEADS, HEAD_DIM, SEQ),
        _random(BATCH, HEADS, SEQ, SEQ),
        _random(BATCH, HEADS, SEQ, HEAD_DIM),
    )
    tq, tk, tp, tv = (torch.from_numpy(a) for a in (q, k, p, v))
    scores = _model([helper.make_node("MatMul", ["q", "k"], ["s"])], {"q": q, "k": k}, "s")
    values = _model([helper.make_node("MatMul", ["p", "v"], ["o"])], {"p": p, "v": v}, "o")
    return [
        ("attention scores q·kᵀ [64 x 128 x 64 x 128]", scores, {"q": q, "k": k}, lambda: torch.matmul(tq, tk)),
        ("attention output p·v [64 x 128 x 128 x 64]", values, {"p": p, "v": v}, lambda: torch.matmul(tp, tv)),
    ]


def gelu_backward_case() -> Case:
    """GELU's backward as the torch builder's trace writes it: dy·(Φ(x) + x·φ(x)), 11 elementwise ops."""
    x, dy = _random(BATCH, SEQ, 1024), _random(BATCH, SEQ, 1024) + 0.5
    constants = {"half_sqrt2": 0.70710677, "one": 1.0, "half": 0.5, "minus_half": -0.5, "inv_sqrt_2pi": 0.3989423}
    initializers = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in constants.items()]
    nodes = [
        helper.make_node("Mul", ["x", "half_sqrt2"], ["u"]),
        helper.make_node("Erf", ["u"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["e1", "half"], ["cdf"]),
        helper.make_node("Mul", ["x", "x"], ["x2"]),
        helper.make_node("Mul", ["x2", "minus_half"], ["h"]),
        helper.make_node("Exp", ["h"], ["g"]),
        helper.make_node("Mul", ["g", "inv_sqrt_2pi"], ["pdf"]),
        helper.make_node("Mul", ["x", "pdf"], ["xpdf"]),
        helper.make_node("Add", ["cdf", "xpdf"], ["slope"]),
        helper.make_node("Mul", ["dy", "slope"], ["dx"]),
    ]
    model = _model(nodes, {"x": x, "dy": dy}, "dx", initializers)
    tx, tdy = torch.from_numpy(x), torch.from_numpy(dy)
    return "GELU backward [16, 128, 1024]", model, {"x": x, "dy": dy}, lambda: torch.ops.aten.gelu_backward(tdy, tx)


def measure(case: Case, threads: int, repeats: int) -> dict:
    name, model, feeds, torch_op = case
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    expected = torch_op()
    got = session.run(None, feeds)[0]
    error = float(np.abs(got - np.asarray(expected)).max() / max(1.0, float(np.abs(np.asarray(expected)).max())))
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(3):
        session.run(None, feeds)
        torch_op()
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feeds)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch_op()
        theirs.append(time.perf_counter() - start)
    ort_ms, torch_ms = 1000 * statistics.median(ours), 1000 * statistics.median(theirs)
    ratio = ort_ms / torch_ms
    return {"kernel": name, "onnxruntime_ms": ort_ms, "pytorch_ms": torch_ms, "ratio": ratio, "error": error}


def _cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or what `platform` knows where there is none."""
    fallback = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), fallback)
    except OSError:  # not Linux
        return fallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = [c for name, (i, o) in LINEAR_LAYERS.items() for c in linear_cases(name, i, o)]
    cases += [*attention_cases(), gelu_backward_case()]
    results = [measure(case, args.threads, args.repeats) for case in cases]
    cpu = _cpu_name()
    print(f"{cpu}; torch {torch.__version__}, onnxruntime {ort.__version__}; {args.threads} thread(s)\n")
    rows = [
        [r["kernel"], f"{r['onnxruntime_ms']:.2f}", f"{r['pytorch_ms']:.2f}", f"{r['ratio']:.2f}x"] for r in results
    ]
    print(markdown_table(["kernel", "ONNX Runtime (ms)", "PyTorch (ms)", "ratio"], rows))
    worst = max(r["error"] for r in results)
    print(f"\nlargest difference between the two results, relative to the largest value: {worst:.1e}")
    payload = {"cpu": cpu, "torch": torch.__version__, "onnxruntime": ort.__version__, "threads": args.threads}
    print("JSON:", save_json("kernels.json", {**payload, "results": results}))


if __name__ == "__main__":
    main()
