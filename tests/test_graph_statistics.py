"""In-graph activation statistics (graph/statistics.py) on hand-built graphs: markers to Identity, gradient names,
the appended reductions against `orttrainer.debug.compute_statistics`, and LogSoftmax+NLL fusion through markers."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers import needs_training_build, onnx_model, value_info
from onnx import TensorProto, helper

from orttrainer.debug import compute_statistics, format_statistics
from orttrainer.trainer.graph.postprocess import fuse_log_softmax_nll
from orttrainer.trainer.graph.statistics import (
    MARK_DOMAIN,
    StatisticsTarget,
    append_statistics,
    decode_statistics,
    gradient_tensor,
    marks_to_identity,
)
from orttrainer.trainer.runtime import ort_private


def _session(model: onnx.ModelProto, **options) -> ort.InferenceSession:
    session_options = ort.SessionOptions()
    for key, value in options.items():
        setattr(session_options, key, value)
    return ort.InferenceSession(model.SerializeToString(), session_options, providers=["CPUExecutionProvider"])


def _mark(x: str, y: str, activation: str) -> onnx.NodeProto:
    return helper.make_node("ActivationMark", [x], [y], domain=MARK_DOMAIN, name=f"/{y}", activation=activation)


# ------------------------------------------------------------------------------------------------ marks_to_identity
def test_marks_become_identities_and_report_their_tensors_in_node_order():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        _mark("r", "m1", "Linear_1_0th_output"),
        _mark("m1", "m2", "inspected"),
        helper.make_node("Neg", ["m2"], ["y"]),
    ]
    model = onnx_model(nodes, [value_info("x", [3])], [value_info("y", [3])], domains=[(MARK_DOMAIN, 1)])
    plain, marks = marks_to_identity(model)
    assert marks == [("Linear_1_0th_output", "m1"), ("inspected", "m2")]
    assert [(n.op_type, n.domain, n.name) for n in plain.graph.node[1:3]] == [
        ("Identity", "", "orttrainer/activation/Linear_1_0th_output"),
        ("Identity", "", "orttrainer/activation/inspected"),
    ]
    assert [o.domain for o in plain.opset_import] == [""]
    assert model.graph.node[1].op_type == "ActivationMark"  # the argument is untouched
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    np.testing.assert_array_equal(_session(plain).run(None, {"x": x})[0], -np.maximum(x, 0))
    assert marks_to_identity(plain)[1] == []


def test_a_malformed_marker_is_refused():
    bad = helper.make_node("ActivationMark", ["x"], ["y"], domain=MARK_DOMAIN, name="bad")  # no activation name
    with pytest.raises(ValueError, match="'bad' must have one input, one output and a string 'activation'"):
        marks_to_identity(onnx_model([bad], [value_info("x", [1])], [value_info("y", [1])]))


def test_gradient_tensor_is_the_produced_grad_name():
    nodes = [helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["t_grad"])]
    model = onnx_model(nodes, [value_info("x", [1])], [value_info("t_grad", [1])])
    assert gradient_tensor(model, "t") == "t_grad"
    assert gradient_tensor(model, "x") is None


# ------------------------------------------------------------------------------------------------ append_statistics
CASES = {
    "float32": torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3 + 0.5,
    "many": torch.randn(40, 30, generator=torch.Generator().manual_seed(1)),  # more than 128 samples
    "signs": torch.tensor([[-1.0, 0.0, 2.0], [0.0, 0.0, -3.5]]),
    "nan_inf": torch.tensor([1.0, float("nan"), float("inf"), -2.0]),
    "scalar": torch.tensor(4.25),
    "one": torch.tensor([7.0]),
    "empty": torch.zeros(0, 3),
    "float16": torch.tensor([0.1, 0.2, 65504.0, -3.0], dtype=torch.float16),
    "bfloat16": torch.tensor([0.5, -1.25, 3.0], dtype=torch.bfloat16),
    "float64": torch.arange(10, dtype=torch.float64) / 3,
    "int64": torch.tensor([[1, -2, 3], [4, 0, 9]]),
    "int32": torch.tensor([5, 5, -5], dtype=torch.int32),
    "bool": torch.tensor([True, False, True, True]),
}
_TYPES = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.float64: TensorProto.DOUBLE,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.bool: TensorProto.BOOL,
}


def _summarise(tensor: torch.Tensor):
    elem = _TYPES[tensor.dtype]
    model = onnx_model(
        [helper.make_node("Identity", ["x"], ["y"])], [value_info("x", None, elem)], [value_info("y", None, elem)]
    )
    with_stats, outputs = append_statistics(model, {"t": StatisticsTarget("y", elem)})
    assert list(with_stats.graph.output)[:1] == list(model.graph.output)
    # bfloat16 through DLPack (the wrapper speaks each runtime's from_dlpack): numpy has no bfloat16.
    value = (
        ort_private.ortvalue_from_torch(tensor)
        if tensor.dtype == torch.bfloat16
        else ort.OrtValue.ortvalue_from_numpy(tensor.numpy())._get_c_value()
    )
    fetched = _session(with_stats)._sess.run_with_ort_values({"x": value}, outputs["t"].names, None)
    return decode_statistics(*(v.numpy() for v in fetched), dtype=tensor.dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_in_graph_statistics_match_the_pytorch_computation(case):
    tensor = CASES[case]
    expected, actual = compute_statistics(tensor), _summarise(tensor)
    a, b = expected.as_dict(), actual.as_dict()
    for key in ("shape", "dtype", "size", "nan", "inf", "neg", "pos", "zero", "samples"):
        assert json.dumps(a[key]) == json.dumps(b[key]), key  # json: NaN == NaN
    for key in ("min", "max", "mean", "std"):
        if isinstance(a[key], float) and math.isnan(a[key]):
            assert math.isnan(b[key]), key
        else:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    if case in ("scalar", "one", "empty", "int64", "bool", "float64"):
        assert format_statistics("t", "forward", actual) == format_statistics("t", "forward", expected)


def test_a_target_of_unknown_type_gets_an_untyped_samples_output():
    model = onnx_model(
        [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16)],
        [value_info("x", [3])],
        [value_info("h", [3], TensorProto.FLOAT16)],
    )
    with_stats, outputs = append_statistics(model, {"t": StatisticsTarget("h", None)})
    session = _session(with_stats)
    types = {o.name: o.type for o in session.get_outputs()}
    assert types[outputs["t"].samples] == "tensor(float16)"  # inferred by ONNX Runtime
    fetched = session.run(outputs["t"].names, {"x": np.array([1.5, -2.0, 0.0], np.float32)})
    stats = decode_statistics(*fetched, dtype=torch.float16)
    assert (stats.min, stats.max, stats.neg, stats.zero, stats.samples.dtype) == (-2.0, 1.5, 1, 1, torch.float16)


def test_statistics_need_existing_tensors_and_keep_the_graph():
    model = onnx_model([helper.make_node("Relu", ["x"], ["y"])], [value_info("x", [2])], [value_info("y", [2])])
    with pytest.raises(ValueError, match=r"tensors the graph does not have: \['nope'\]"):
        append_statistics(model, {"t": StatisticsTarget("nope", TensorProto.FLOAT)})
    both, outputs = append_statistics(
        model, {"a": StatisticsTarget("x", TensorProto.FLOAT), "b": StatisticsTarget("y", TensorProto.FLOAT)}
    )
    assert both.graph.node[0] == model.graph.node[0]
    names = [o.name for o in both.graph.output]
    assert names[0] == "y" and set(outputs["a"].names + outputs["b"].names) == set(names[1:])
    x = np.array([-1.0, 3.0], np.float32)
    values_a, values_b = _session(both).run([outputs["a"].values, outputs["b"].values], {"x": x})
    np.testing.assert_array_equal(values_a, [-1.0, 3.0, 2.0, 8.0])  # min, max, sum, squared deviations
    np.testing.assert_array_equal(values_b, [0.0, 3.0, 3.0, 4.5])


@needs_training_build
def test_unfetched_statistics_do_not_run(tmp_path):
    model = onnx_model([helper.make_node("Relu", ["x"], ["y"])], [value_info("x", [64])], [value_info("y", [64])])
    with_stats, outputs = append_statistics(model, {"t": StatisticsTarget("y", TensorProto.FLOAT)})
    session = _session(with_stats, enable_profiling=True, profile_file_prefix=str(tmp_path / "p"))
    partial = ort.RunOptions()
    partial.only_execute_path_to_fetches = True
    x = np.ones(64, np.float32)
    session.run(["y"], {"x": x}, partial)
    ran_plain = _nodes_run(session.end_profiling())
    session = _session(with_stats, enable_profiling=True, profile_file_prefix=str(tmp_path / "q"))
    session.run(["y", *outputs["t"].names], {"x": x}, partial)
    ran_all = _nodes_run(session.end_profiling())
    assert not any("orttrainer/statistics" in n for n in ran_plain)
    assert any("orttrainer/statistics" in n for n in ran_all)


def _nodes_run(profile: str) -> set[str]:
    with open(profile) as f:
        return {e["name"] for e in json.load(f) if e.get("cat") == "Node"}


# ------------------------------------------------------------------------------------ markers and the NLL fusion
def test_log_softmax_nll_fuses_through_a_marker_chain():
    nodes = [
        helper.make_node("LogSoftmax", ["x"], ["lp"], axis=1),
        helper.make_node("Identity", ["lp"], ["m1"], name="orttrainer/activation/a"),
        helper.make_node("Identity", ["m1"], ["m2"], name="orttrainer/activation/b"),
        helper.make_node("NegativeLogLikelihoodLoss", ["m2", "t"], ["loss"], reduction="mean"),
    ]
    model = onnx_model(
        nodes,
        [value_info("x", [4, 3]), value_info("t", [4], TensorProto.INT64)],
        [value_info("loss", []), value_info("m2", [4, 3])],
    )
    fused = fuse_log_softmax_nll(model)
    assert [(n.op_type, list(n.input), list(n.output)) for n in fused.graph.node] == [
        ("SoftmaxCrossEntropyLoss", ["x", "t"], ["loss", "lp"]),
        ("Identity", ["lp"], ["m1"]),
        ("Identity", ["m1"], ["m2"]),
    ]
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    t = np.array([0, 2, 1, 2], np.int64)
    feeds = {"x": x, "t": t}
    for got, want in zip(_session(fused).run(None, feeds), _session(model).run(None, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    branched = onnx_model(
        [*nodes, helper.make_node("Neg", ["m1"], ["n"])],
        [value_info("x", [4, 3]), value_info("t", [4], TensorProto.INT64)],
        [value_info("loss", []), value_info("n", [4, 3])],
    )
    assert fuse_log_softmax_nll(branched).graph.node[0].op_type == "LogSoftmax"  # m1 has two consumers: no fusion
