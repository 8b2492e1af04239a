"""The graph-pass contract and runner (graph/passes.py) on hand-built graphs: preconditions, stage saving,
verification (topological order, onnx.checker, copying passes), and what onnx 1.17's checker accepts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import needs_training_build, onnx_model, value_info
from onnx import TensorProto, helper, numpy_helper

from orttrainer.trainer.graph.editor import copy_model, raise_opset_pass
from orttrainer.trainer.graph.fixups import NAME_OPTIONAL_OUTPUTS
from orttrainer.trainer.graph.passes import (
    VERIFY_ENVIRONMENT_VARIABLE,
    FunctionPass,
    PassPreconditionError,
    PassVerificationError,
    record_stage,
    run_passes,
    verification_enabled,
    verify_model,
)
from orttrainer.trainer.graph.postprocess import FUSE_LOG_SOFTMAX_NLL, NAME_NODES
from orttrainer.trainer.graph.statistics import MARKS_TO_IDENTITY

FLOAT = TensorProto.FLOAT


def _chain(opsets=(("", 14),)) -> onnx.ModelProto:
    """y = Relu(Neg(x) + b): three unnamed nodes in order."""
    nodes = [
        helper.make_node("Neg", ["x"], ["n"]),
        helper.make_node("Add", ["n", "b"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    b = numpy_helper.from_array(np.array([1.0, -1.0], np.float32), "b")
    graph = helper.make_graph(nodes, "g", [value_info("x", [2])], [value_info("y", [2])], [b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    return model


def _reversed_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    result = copy_model(model)
    nodes = list(result.graph.node)[::-1]
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    return result


def _append(model: onnx.ModelProto, node: onnx.NodeProto) -> onnx.ModelProto:
    result = copy_model(model)
    result.graph.node.append(node)
    return result


def _rename_in_place(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.node[0].name = "touched"
    return model


# ------------------------------------------------------------------------------------------------------ the contract
def test_a_failed_precondition_names_the_pass_and_the_problem_and_is_a_value_error():
    applied = []
    graph_pass = FunctionPass("needs_relu", lambda m: applied.append(m) or m, lambda m: "the graph has no Softmax")
    with pytest.raises(PassPreconditionError, match="graph pass 'needs_relu': the graph has no Softmax") as info:
        run_passes(_chain(), [graph_pass])
    assert isinstance(info.value, ValueError) and info.value.pass_name == "needs_relu"
    assert applied == []  # the rule never ran
    with pytest.raises(PassPreconditionError):
        graph_pass(_chain())  # calling the pass checks too


def test_a_pass_carries_its_rule_as_the_docstring_of_its_function():
    assert NAME_OPTIONAL_OUTPUTS.doc.startswith("Give SoftmaxCrossEntropyLoss 2")
    assert raise_opset_pass(15).doc.startswith("Rule: a copy of `model` whose default")  # a functools.partial
    assert "Rule: every `orttrainer.debug::ActivationMark" in MARKS_TO_IDENTITY.doc  # passes.first_result
    assert not NAME_NODES.mutates_input


# -------------------------------------------------------------------------------------------------------- the runner
def test_run_passes_applies_in_order_and_saves_the_named_stages(tmp_path):
    first, second = tmp_path / "named.onnx", tmp_path / "raised.onnx"
    model = _chain()
    before = model.SerializeToString()
    result = run_passes(model, [NAME_NODES, raise_opset_pass(16)], save={"name_nodes": str(first), "other": "x"})
    assert [n.name for n in result.graph.node] == ["Neg_0", "Add_1", "Relu_2"]
    assert result.opset_import[0].version == 16
    saved = onnx.load(str(first))
    assert [n.name for n in saved.graph.node] == ["Neg_0", "Add_1", "Relu_2"] and saved.opset_import[0].version == 14
    assert not second.exists()
    assert model.SerializeToString() == before


def test_run_passes_with_no_pass_returns_the_model_itself():
    model = _chain()
    assert run_passes(model, []) is model


def test_verify_catches_a_result_that_is_not_topologically_sorted():
    bad = FunctionPass("reverse", _reversed_nodes)
    with pytest.raises(PassVerificationError, match="graph pass 'reverse': its result is not in topological order"):
        run_passes(_chain(), [bad], verify=True)
    assert run_passes(_chain(), [bad], verify=False).graph.node[0].op_type == "Relu"  # unchecked without verify


def test_verify_catches_a_result_the_onnx_checker_rejects():
    unknown = FunctionPass("unknown_op", lambda m: _append(m, helper.make_node("FooBar", ["y"], ["z"])))
    with pytest.raises(PassVerificationError, match="'unknown_op': onnx.checker rejects its result.*FooBar"):
        run_passes(_chain(), [unknown], verify=True)
    bad_attribute = FunctionPass(
        "bad_attribute", lambda m: _append(m, helper.make_node("Relu", ["y"], ["z"], alpha=0.5))
    )
    with pytest.raises(PassVerificationError, match="Unrecognized attribute: alpha for operator Relu"):
        run_passes(_chain(), [bad_attribute], verify=True)


def test_verify_catches_a_copying_pass_that_modified_its_input():
    sneaky = FunctionPass("sneaky", _rename_in_place, mutates_input=False)
    with pytest.raises(PassVerificationError, match="'sneaky': is declared as copying its input, but it modified"):
        run_passes(_chain(), [NAME_NODES, sneaky], verify=True)


def test_a_mutating_pass_never_modifies_the_callers_model():
    declared = FunctionPass("rename", _rename_in_place, mutates_input=True)
    model = _chain()
    before = model.SerializeToString()
    result = run_passes(model, [declared], verify=True)
    assert result.graph.node[0].name == "touched" and model.SerializeToString() == before
    # after a copying pass, the mutating pass works on the copy it made: no second copy, the caller's model intact
    result = run_passes(model, [NAME_NODES, declared], verify=True)
    assert result.graph.node[0].name == "touched" and model.SerializeToString() == before


def test_a_pass_must_return_a_model():
    with pytest.raises(PassVerificationError, match="'names': returned tuple, not an onnx.ModelProto"):
        run_passes(_chain(), [FunctionPass("names", lambda m: (m, ["y"]))], verify=False)


def test_verification_follows_the_environment_by_default(monkeypatch):
    bad = FunctionPass("reverse", _reversed_nodes)
    monkeypatch.setenv(VERIFY_ENVIRONMENT_VARIABLE, "0")
    assert not verification_enabled()
    run_passes(_chain(), [bad])
    record_stage("reverse", _reversed_nodes(_chain()))
    monkeypatch.setenv(VERIFY_ENVIRONMENT_VARIABLE, "1")  # as tests/conftest.py sets it
    with pytest.raises(PassVerificationError):
        run_passes(_chain(), [bad])
    with pytest.raises(PassVerificationError, match="'training_graph'"):
        record_stage("training_graph", _reversed_nodes(_chain()))


def test_record_stage_saves_a_model_built_without_a_pass(tmp_path):
    path = tmp_path / "training.onnx"
    record_stage("build_training_graph", _chain(), save={"build_training_graph": str(path)}, verify=True)
    assert onnx.load(str(path)).graph.node[0].op_type == "Neg"
    record_stage("build_training_graph", _chain(), save={}, verify=True)  # nothing to save


def test_postprocess_passes_pass_verification():
    nodes = [
        helper.make_node("LogSoftmax", ["x"], ["lp"], axis=1),
        helper.make_node("NegativeLogLikelihoodLoss", ["lp", "t"], ["loss"]),
    ]
    model = onnx_model(
        nodes, [value_info("x", [3, 4]), value_info("t", [3], TensorProto.INT64)], [value_info("loss", [])]
    )
    result = run_passes(model, [NAME_NODES, FUSE_LOG_SOFTMAX_NLL], verify=True)
    assert [n.op_type for n in result.graph.node] == ["SoftmaxCrossEntropyLoss"]


# ---------------------------------------------------------------------------------------- what onnx.checker accepts
def _with_node(node: onnx.NodeProto, opsets) -> onnx.ModelProto:
    return _append(_chain(opsets), node)


def test_the_checker_accepts_onnx_runtime_ops_of_imported_domains_without_checking_them():
    ms = (("", 14), ("com.microsoft", 1))
    for node in [
        helper.make_node("YieldOp", ["y"], ["y_grad"], domain="com.microsoft", full_shape_outputs=[0]),
        helper.make_node("PassThrough", ["y", "x"], ["y_gated", "x_gated"], domain="com.microsoft"),
        helper.make_node("SoftmaxCrossEntropyLossGrad", ["y", "x", "b"], ["dx"], domain="com.microsoft"),
        helper.make_node("GatherGrad", ["y"], ["dw"], domain="com.microsoft", made_up=3),  # wrong arity: unchecked
    ]:
        verify_model(_with_node(node, ms), "ort_op")
    contrib = helper.make_node("StringRegexReplace", ["y"], ["z"], domain="ai.onnx.contrib")
    verify_model(_with_node(contrib, (("", 14), ("ai.onnx.contrib", 1))), "contrib_op")
    with pytest.raises(PassVerificationError, match="No opset import for domain 'ai.onnx.contrib'"):
        verify_model(_with_node(contrib, (("", 14),)), "contrib_op")


@needs_training_build
def test_the_checker_accepts_onnx_runtime_s_gradient_graph_and_the_passes_after_it():
    from orttrainer.trainer.gradient.ort_builder import build_ort_gradient_graph
    from orttrainer.trainer.graph.fixups import name_optional_outputs
    from orttrainer.trainer.graph.pipeline import gradient_model_passes

    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((10, 4)).astype(np.float32), "E")
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["emb"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["emb", "y"], ["loss"]),
    ]
    inputs = [value_info("ids", [5], TensorProto.INT64), value_info("y", [5], TensorProto.INT64)]
    forward = onnx_model(nodes, inputs, [value_info("loss", [])], [table])
    gradient = build_ort_gradient_graph(name_optional_outputs(forward), "loss", ["E"], ["E"])
    ops = {n.op_type for n in gradient.graph.node}
    assert {"GatherGrad", "SoftmaxCrossEntropyLossGrad"} <= ops
    verify_model(gradient, "gradient_builder")
    result = run_passes(gradient, gradient_model_passes(mixed_precision=False, cpu=True, scaled_loss="loss"))
    assert "ScatterND" in {n.op_type for n in result.graph.node}


def test_inputs_and_outputs_declared_without_shape_or_type_are_not_held_against_a_pass():
    def untyped_output(model: onnx.ModelProto) -> onnx.ModelProto:
        result = _append(model, helper.make_node("Shape", ["y"], ["shape"]))
        result.graph.output.append(value_info("shape", None, TensorProto.INT64))  # no shape: an unknown rank
        result.graph.output.append(onnx.ValueInfoProto(name="y"))  # no type: ONNX Runtime infers it
        return result

    model = _chain()
    model.graph.input[0].type.tensor_type.ClearField("shape")
    result = run_passes(model, [FunctionPass("untyped", untyped_output)], verify=True)
    assert not result.graph.output[-1].HasField("type")  # the result itself is left as the pass made it
    with pytest.raises(onnx.checker.ValidationError, match="Field '(shape|type)' of '(type|value_info)' is required"):
        onnx.checker.check_model(result)


def test_verification_accepts_the_onnx_domain_ops_onnx_runtime_registers_before_onnx_does():
    """ONNX Runtime's fusions write LayerNormalization in the ONNX domain at opset 14 (ONNX has it from 17): the
    checker would reject what ONNX Runtime runs, so verification checks it as a custom-domain op."""
    from onnx import TensorProto, helper, numpy_helper

    from orttrainer.trainer.graph.passes import verify_model

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    scale = numpy_helper.from_array(np.ones(4, np.float32), "scale")
    node = helper.make_node("LayerNormalization", ["x", "scale"], ["y"], name="ln")
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y], [scale]), opset_imports=[helper.make_opsetid("", 14)]
    )
    model.ir_version = 8
    verify_model(model, "test")  # does not raise
    assert model.graph.node[0].domain == ""  # the model itself is not changed
    bad = helper.make_model(
        helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"])], "g", [x], [y]),
        opset_imports=[helper.make_opsetid("", 14)],
    )
    with pytest.raises(PassVerificationError, match="No Op registered for NoSuchOp"):
        verify_model(bad, "test")
