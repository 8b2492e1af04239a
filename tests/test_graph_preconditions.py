"""The precondition of every graph pass on hand-built graphs: a model the pass is not defined for raises
`PassPreconditionError` naming the pass, from the function and from its `FunctionPass` object alike; and the pass
objects' results pass `run_passes` verification (topological order, onnx.checker, input left untouched)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import initializer, onnx_model, value_info
from onnx import TensorProto, helper

from orttrainer.trainer.graph import fixups, mixed_precision, postprocess, recompute, scatter_grad, statistics
from orttrainer.trainer.graph.editor import GraphEditor
from orttrainer.trainer.graph.passes import FunctionPass, PassPreconditionError, run_passes
from orttrainer.trainer.update.in_graph import StepScalars, append_adam, append_lamb

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def _rejects(graph_pass: FunctionPass, model: onnx.ModelProto, message: str) -> None:
    """The pass object refuses `model` with `message`, and leaves it as it was."""
    before = model.SerializeToString()
    with pytest.raises(PassPreconditionError, match=f"graph pass '{graph_pass.name}': .*{message}"):
        run_passes(model, [graph_pass])
    assert model.SerializeToString() == before


# ------------------------------------------------------------------------------------------------------- fixups.py
def _dropout(outputs, inputs=("x", "ratio", "training"), opset: int = 14, extra=(), graph_outputs=("y",)):
    nodes = [helper.make_node("Dropout", list(inputs), outputs, name="drop"), *extra]
    inits = [initializer("ratio", 0.5), initializer("training", True, np.bool_)]
    return onnx_model(nodes, [value_info("x", [4])], [value_info(n) for n in graph_outputs], inits, opset)


def test_name_optional_outputs_needs_a_named_first_output():
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["", "lp"], name="sce")
    model = onnx_model([node], [value_info("x", [2, 3]), value_info("t", [2], INT64)], [value_info("lp")])
    with pytest.raises(PassPreconditionError, match="SoftmaxCrossEntropyLoss node 'sce' has no named first output"):
        fixups.name_optional_outputs(model)
    _rejects(fixups.NAME_OPTIONAL_OUTPUTS, model, "SoftmaxCrossEntropyLoss node 'sce'")


def test_dropout_to_identity_needs_dropout_indices_and_unread_masks():
    model = _dropout(["y", "mask"], graph_outputs=("y", "mask"))
    with pytest.raises(PassPreconditionError, match="'dropout_to_identity': node indices \\[1, 5\\] are not Dropout"):
        fixups.dropout_to_identity(model, only={0, 1, 5})
    _rejects(fixups.DROPOUT_TO_IDENTITY, model, "Dropout node 'drop': its mask output 'mask' is used")
    assert fixups.dropout_to_identity(model, only=set()) == model  # nothing selected: the mask may stay read


def test_inference_dropout_to_identity_needs_unread_masks():
    reader = helper.make_node("Cast", ["mask"], ["m"], to=FLOAT)
    model = _dropout(["y", "mask"], inputs=("x", "ratio"), extra=[reader])
    _rejects(fixups.INFERENCE_DROPOUT_TO_IDENTITY, model, "its mask output 'mask' is used")
    training = _dropout(["y", "mask"], extra=[reader])  # a training-mode dropout is not rewritten: no problem
    assert fixups.inference_dropout_to_identity(training) is training


def test_restore_dropout_training_mode_needs_opset_12():
    model = _dropout(["y"], inputs=("x", "ratio"), opset=11)
    with pytest.raises(PassPreconditionError, match="needs default-domain opset >= 12 .*imports 11"):
        fixups.restore_dropout_training_mode(model)
    _rejects(fixups.RESTORE_DROPOUT_TRAINING_MODE, model, "needs default-domain opset >= 12")
    assert fixups.restore_dropout_training_mode(_dropout(["y"], opset=11)).graph.node[0].op_type == "Dropout"


def _batchnorm(outputs, training: int | None, inputs=("x", "s", "b", "m", "v"), extra=()):
    attrs = {} if training is None else {"training_mode": training}
    node = helper.make_node("BatchNormalization", list(inputs), outputs, name="bn", **attrs)
    inits = [initializer(n, [1.0, 2.0]) for n in ("s", "b", "m", "v")]
    return onnx_model([node, *extra], [value_info("x", [3, 2])], [value_info("y")], inits)


def test_batchnorm_to_inference_needs_unread_running_statistics():
    reader = helper.make_node("Neg", ["running_mean"], ["r"])
    model = _batchnorm(["y", "running_mean", "running_var"], 1, extra=[reader])
    _rejects(fixups.BATCHNORM_TO_INFERENCE, model, "BatchNormalization node 'bn': its output 'running_mean' is read")


def test_inference_batchnorm_to_affine_needs_all_inputs_and_unread_extra_outputs():
    short = _batchnorm(["y"], None, inputs=("x", "s", "b", "m", ""))
    with pytest.raises(PassPreconditionError, match="'bn' lacks some of its inputs X, scale, B, mean, var"):
        fixups.inference_batchnorm_to_affine(short)
    reader = helper.make_node("Neg", ["saved_mean"], ["r"])
    read = _batchnorm(["y", "", "", "saved_mean"], None, extra=[reader])  # opset < 14 style: no training_mode
    _rejects(fixups.INFERENCE_BATCHNORM_TO_AFFINE, read, "its output 'saved_mean' is read")


def test_fixup_passes_results_pass_verification():
    model = _dropout(["y", "mask"], inputs=("x", "ratio"))
    sce = helper.make_node("SoftmaxCrossEntropyLoss", ["z", "t"], ["loss"], name="sce")
    model.graph.node.extend([helper.make_node("Reshape", ["y", "shape"], ["z"]), sce])
    model.graph.initializer.append(initializer("shape", [2, 2], np.int64))
    model.graph.input.append(value_info("t", [2], INT64))
    passes = [fixups.NAME_OPTIONAL_OUTPUTS, fixups.RESTORE_DROPOUT_TRAINING_MODE, fixups.DROPOUT_TO_IDENTITY]
    result = run_passes(model, passes, verify=True)
    assert [n.op_type for n in result.graph.node] == ["Identity", "Reshape", "SoftmaxCrossEntropyLoss"]
    assert list(result.graph.node[2].output) == ["loss", "loss__extra1"]


# ---------------------------------------------------------------------------------------------- mixed_precision.py
def _loss_model(loss_type: int = FLOAT) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0)]
    return onnx_model(
        nodes, [value_info("x", [2, 3])], [value_info("loss", [], loss_type)], [initializer("W", np.ones((3, 2)))]
    )


def test_to_float16_needs_float32_tensors_to_be_graph_inputs():
    model = _loss_model()
    with pytest.raises(PassPreconditionError, match=r"'to_float16': float32 tensors \['W'\] are initializers"):
        mixed_precision.to_float16(model, keep_float32=["x", "W", "loss"])
    _rejects(mixed_precision.to_float16_pass(["W"]), model, "float32 tensors")


def test_append_loss_scale_needs_a_float32_loss_output():
    model = _loss_model()
    _rejects(mixed_precision.append_loss_scale_pass("h"), model, "the loss 'h' is not a graph output")
    _rejects(mixed_precision.append_loss_scale_pass("loss"), _loss_model(TensorProto.FLOAT16), "not a float32")
    result = run_passes(model, [mixed_precision.append_loss_scale_pass("loss")], verify=True)
    scaled, scale = mixed_precision.loss_scale_names(result)
    assert (scaled, scale) == (result.graph.node[-1].output[0], "loss_scale")
    assert list(result.graph.node[-1].input) == ["loss", "loss_scale"]


def test_cast_fp32_only_kernels_needs_an_opset_it_can_raise_to_15():
    node = helper.make_node("SliceGrad", ["g", "shape", "s", "e", "a"], ["dx"], domain="com.microsoft", name="sg")
    model = onnx_model(
        [node],
        [value_info(n, [1], INT64) for n in ("shape", "s", "e", "a")] + [value_info("g", [3])],
        [value_info("dx")],
    )
    model.opset_import[0].version = 13
    with pytest.raises(PassPreconditionError, match="'cast_fp32_only_kernels': cannot raise this graph's opset 13"):
        mixed_precision.cast_fp32_only_kernels(model)
    model.opset_import[0].version = 14
    model.graph.node[0].input[0] = ""
    _rejects(mixed_precision.CAST_FP32_ONLY_KERNELS, model, r"nodes \['sg'\] lack a named data input or output")


# ------------------------------------------------------------------------------------------------- scatter_grad.py
def test_gather_grad_to_scatter_add_needs_three_inputs():
    node = helper.make_node("GatherGrad", ["shape", "idx"], ["dw"], domain="com.microsoft", name="gg")
    model = onnx_model(
        [node], [value_info("shape", [2], INT64), value_info("idx", [3], INT64)], [value_info("dw")], ms=True
    )
    with pytest.raises(PassPreconditionError, match="GatherGrad node 'gg' needs three named inputs"):
        scatter_grad.gather_grad_to_scatter_add(model)
    _rejects(scatter_grad.GATHER_GRAD_TO_SCATTER_ADD, model, "GatherGrad node 'gg'")


# -------------------------------------------------------------------------------------------------- postprocess.py
def test_name_nodes_needs_distinct_node_names():
    nodes = [helper.make_node("Neg", ["x"], ["a"], name="n"), helper.make_node("Neg", ["a"], ["y"], name="n")]
    model = onnx_model(nodes, [value_info("x", [2])], [value_info("y", [2])])
    with pytest.raises(PassPreconditionError, match="two nodes are named 'n'"):
        postprocess.run_postprocess(model)
    _rejects(postprocess.NAME_NODES, model, "two nodes are named 'n'")


def test_fuse_log_softmax_nll_needs_single_assignment():
    nodes = [helper.make_node("Neg", ["x"], ["a"], name="one"), helper.make_node("Relu", ["x"], ["a"], name="two")]
    model = onnx_model(nodes, [value_info("x", [2])], [value_info("a", [2])])
    _rejects(postprocess.FUSE_LOG_SOFTMAX_NLL, model, "tensor 'a' is assigned twice")


# ---------------------------------------------------------------------------------------------------- recompute.py
def test_recompute_needs_a_sorted_graph_known_outputs_and_forward_nodes():
    nodes = [helper.make_node("Neg", ["x"], ["a"], name="neg"), helper.make_node("Relu", ["a"], ["loss"], name="r")]
    model = onnx_model(nodes, [value_info("x", [2])], [value_info("loss", [2])])
    plan = recompute.RecomputePlan(gelu=True)
    _rejects(recompute.recompute_pass(["nope"], plan), model, r"forward outputs \['nope'\] are missing")
    with pytest.raises(PassPreconditionError, match="'recompute': nodes \\['r'\\] are not forward nodes"):
        recompute.recompute(model, ["a"], [1])
    unsorted = onnx_model(nodes[::-1], [value_info("x", [2])], [value_info("loss", [2])])
    _rejects(recompute.recompute_pass(["loss"], plan), unsorted, "needs a topologically sorted graph: node 'r' reads")


def test_recompute_pass_warns_the_plan_s_notes():
    nodes = [helper.make_node("Neg", ["x"], ["loss"], name="neg")]
    model = onnx_model(nodes, [value_info("x", [2])], [value_info("loss", [2])])
    with pytest.warns(UserWarning, match="options graph_transformer.gelu_recompute: the graph has no Gelu"):
        result = run_passes(model, [recompute.recompute_pass(["loss"], recompute.RecomputePlan(gelu=True))])
    assert result == model


# --------------------------------------------------------------------------------------------------- statistics.py
def test_statistics_passes_name_themselves_in_their_precondition_errors():
    bad = helper.make_node("ActivationMark", ["x", "x"], ["m"], domain=statistics.MARK_DOMAIN, name="bad")
    model = onnx_model([bad], [value_info("x", [2])], [value_info("m", [2])])
    model.opset_import.append(helper.make_opsetid(statistics.MARK_DOMAIN, 1))
    _rejects(statistics.MARKS_TO_IDENTITY, model, "activation marker 'bad' must have one input")
    plain = onnx_model([helper.make_node("Neg", ["x"], ["y"])], [value_info("x", [2])], [value_info("y", [2])])
    targets = {"nope": statistics.StatisticsTarget("nope", FLOAT)}
    _rejects(statistics.append_statistics_pass(targets), plain, r"tensors the graph does not have: \['nope'\]")


def test_append_statistics_pass_outputs_are_read_back_in_target_order():
    model = onnx_model([helper.make_node("Neg", ["x"], ["y"])], [value_info("x", [3])], [value_info("y", [3])])
    targets = {"in": statistics.StatisticsTarget("x", FLOAT), "out": statistics.StatisticsTarget("y", FLOAT)}
    expected_model, expected = statistics.append_statistics(model, targets)
    result = run_passes(model, [statistics.append_statistics_pass(targets)], verify=True)
    assert result == expected_model
    assert statistics.statistics_outputs(result, targets) == expected
    assert statistics.statistics_outputs(model, {}) == {}


# --------------------------------------------------------------------------------------------- update/in_graph.py
@pytest.mark.parametrize(("append", "name"), [(append_adam, "AdamOptimizer"), (append_lamb, "LambOptimizer")])
def test_optimizers_need_their_hyper_parameters(append, name):
    model = onnx_model([], [value_info("w", [2]), value_info("g", [2])], [])
    ed = GraphEditor(model.graph, "t")
    hyper = {"alpha": 0.9, "beta": 0.999, "lambda": 0.0, "epsilon": 1e-8}
    with pytest.raises(PassPreconditionError, match=f"'{name}': hyper-parameters \\['do_bias_correction'"):
        append(ed, ["w"], ["g"], 1.0, StepScalars("lr", "t"), hyper)
    assert len(model.graph.node) == 0
