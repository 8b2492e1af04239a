"""Op by op: where a step of orttrainer spends its time against eager PyTorch, from a `run_all.py --profile` run.

    python benchmarks/run_all.py --profile --workloads transformer --runners pytorch-fused orttrainer[ort]
    python benchmarks/profile_compare.py [--json benchmarks/results/run_all.json] [--eager pytorch-fused]

Kernel times per op type (ONNX Runtime's profiler; torch's profiler, self CPU time per aten op) are grouped into
the same categories on both sides — GEMMs, GELU, LayerNorm, cross-entropy, attention softmax, embedding, bias
gradients and sums, data movement, other elementwise, optimizer — and printed side by side in ms per step. The
profilers slow the steps they record, each by its own amount: compare categories, not totals with the timed run.
orttrainer's optimizer update (torch's fused Adam, outside the graph) does not appear in ONNX Runtime's profile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from common import RESULTS_DIR, WORKLOADS, markdown_table  # noqa: E402

CATEGORIES = {
    "GEMM (MatMul, Gemm; eager: mm, addmm, bmm)": (
        {"FusedMatMul", "Gemm", "MatMul"},
        {"aten::mm", "aten::addmm", "aten::bmm"},
    ),
    "attention softmax (eager: fused SDPA, its matmuls included)": (
        {"Softmax", "SoftmaxGrad_13", "SoftmaxGrad"},
        {
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        },
    ),
    "GELU forward + backward": (
        {"BiasGelu", "BiasGeluGrad_dX", "Gelu", "GeluGrad", "Erf"},
        {"aten::gelu", "aten::gelu_backward"},
    ),
    "LayerNorm forward + backward": (
        {"LayerNormalization", "LayerNormalizationGrad", "InvertibleLayerNormalizationGrad"},
        {"aten::native_layer_norm", "aten::native_layer_norm_backward"},
    ),
    "cross-entropy forward + backward": (
        {
            "SoftmaxCrossEntropyLoss",
            "SoftmaxCrossEntropyLossGrad",
            "LogSoftmax",
            "NegativeLogLikelihoodLoss",
            "Exp",
            "ScatterElements",
        },
        {"aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss_forward", "aten::nll_loss_backward"},
    ),
    "embedding forward + backward": (
        {"Gather", "GatherGrad", "ScatterND"},
        {"aten::index_select", "aten::embedding_dense_backward"},
    ),
    "bias gradients, gradient sums (ReduceSum, Sum)": ({"ReduceSum", "Sum"}, {"aten::sum"}),
    "data movement (Transpose, Concat, copies, fills)": (
        {
            "Transpose",
            "Concat",
            "ConcatTraining",
            "Split",
            "Slice",
            "SliceGrad",
            "Reshape",
            "Identity",
            "Cast",
            "Squeeze",
            "Unsqueeze",
            "Expand",
            "ConstantOfShape",
            "Shape",
        },
        {"aten::copy_", "aten::fill_", "aten::clone", "aten::zero_", "aten::cat", "aten::_to_copy"},
    ),
    "other elementwise (Add, Mul, residuals, scaling)": (
        {"Add", "Mul", "Sub", "Div", "Where", "Sqrt", "Pow", "Equal", "Not"},
        {"aten::add", "aten::add_", "aten::mul", "aten::mul_", "aten::div", "aten::sub"},
    ),
    "optimizer (eager: fused Adam, or foreach Adam's ops)": (
        set(),
        {
            "aten::_fused_adam_",
            "aten::lerp_",
            "aten::addcdiv_",
            "aten::addcmul_",
            "aten::sqrt",
            "aten::_foreach_add_",
            "aten::_foreach_mul_",
            "aten::_foreach_sqrt",
            "aten::_foreach_lerp_",
            "aten::_foreach_addcmul_",
            "aten::_foreach_addcdiv_",
            "aten::_foreach_div_",
            "aten::_foreach_add",
        },
    ),
}


def categorise(profile: dict[str, float], side: int) -> dict[str, float]:
    """ms per category; what no category takes goes to 'rest'."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    totals["rest"] = 0.0
    for op, ms in profile.items():
        category = next((name for name, sets in CATEGORIES.items() if op in sets[side]), "rest")
        totals[category] += ms
    return totals


def compare(results: list[dict], workload: str, eager: str, ours: str) -> str:
    by_runner = {r["runner"]: r for r in results if r["workload"] == workload and r.get("profile")}
    if eager not in by_runner or ours not in by_runner:
        return f"{workload}: no profiles of both {eager} and {ours} in this run"
    left, right = categorise(by_runner[eager]["profile"], 1), categorise(by_runner[ours]["profile"], 0)
    rows = [[name, f"{left[name]:.1f}", f"{right[name]:.1f}", f"{right[name] - left[name]:+.1f}"] for name in left]
    rows.append(
        [
            "total (profiled)",
            f"{sum(left.values()):.1f}",
            f"{sum(right.values()):.1f}",
            f"{sum(right.values()) - sum(left.values()):+.1f}",
        ]
    )
    header = ["category", f"{eager} (ms/step)", f"{ours} (ms/step)", "difference"]
    return f"{WORKLOADS[workload].name}:\n\n" + markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=os.path.join(RESULTS_DIR, "run_all.json"))
    parser.add_argument("--eager", default="pytorch-fused")
    parser.add_argument("--ours", default="orttrainer[ort]")
    args = parser.parse_args()
    with open(args.json) as f:
        results = json.load(f)["results"]
    for workload in dict.fromkeys(r["workload"] for r in results):
        print(compare(results, workload, args.eager, args.ours) + "\n")


if __name__ == "__main__":
    main()
