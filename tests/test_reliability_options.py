"""Refused at construction, naming the option or key: values the legacy schema let through to fail later inside
ONNX Runtime (or crash in the options wrapper). Also: under orttrainer.compat the cast-propagation strategy enum
compares equal to what the options hold."""

from __future__ import annotations

import importlib

import pytest
from models import MLP

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.schema.model_desc import _ORTTrainerModelDesc
from orttrainer.trainer.runtime import has_training_build

# --- model_desc ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "inputs, outputs, message",
    [
        (
            [("x", ["batch", 32]), ("x", ["batch"])],
            [("loss", [], True)],
            "name 'x' is used by both model_desc inputs[0] and inputs[1]",
        ),
        (
            [("x", ["batch", 32])],
            [("loss", [], True), ("loss", ["batch"])],
            "name 'loss' is used by both model_desc outputs[0] and outputs[1]",
        ),
        (
            [("x", ["batch", 32]), ("target", ["batch"])],
            [("loss", [], True), ("target", ["batch"])],
            "name 'target' is used by both model_desc inputs[1] and outputs[1]",
        ),
    ],
    ids=["inputs", "outputs", "input_and_output"],
)
def test_duplicate_names_in_model_desc_are_refused(inputs, outputs, message):
    desc = {"inputs": inputs, "outputs": outputs}
    with pytest.raises(ValueError, match="^Invalid model_desc: ") as error:
        _ORTTrainerModelDesc(desc)
    assert message in str(error.value) and "needs its own name" in str(error.value)
    with pytest.raises(ValueError, match="is used by both"):  # at the trainer's construction, before any export
        ORTTrainer(MLP(), desc, optim.SGDConfig(), options=ORTTrainerOptions({"device": {"id": "cpu"}}))


def test_empty_dimension_name_is_refused():
    with pytest.raises(ValueError) as error:
        _ORTTrainerModelDesc({"inputs": [("x", ["batch", ""])], "outputs": [("loss", [], True)]})
    assert str(error.value) == (
        "Invalid model_desc: {'inputs': [{0: [\"dimension 1 of 'x' is '': a symbolic dimension needs a non-empty "
        'name"]}]}'
    )


def test_empty_name_is_refused():
    with pytest.raises(ValueError, match=r"'outputs': \[\{0: \['the first element of the tuple \(aka name\) must not"):
        _ORTTrainerModelDesc({"inputs": [("x", [2])], "outputs": [("", [], True)]})


# --- options ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "provider_options, message",
    [
        ({1: {}}, "provider name 1 (int) is not a str: keys are names like 'CUDAExecutionProvider'"),
        (
            {"CUDAExecutionProvider": 3},
            "provider_options.CUDAExecutionProvider must be a dict of option names to values",
        ),
        (
            {"CUDAExecutionProvider": {2: "x"}},
            "option names must be str and values str, int, float or bool; these are not: [2]",
        ),
        ({"CUDAExecutionProvider": {"a": [1]}}, "these are not: ['a'] (values: [[1]])"),
        ({"CUDAExecutionProvider": {"a": None}}, "these are not: ['a'] (values: [None])"),
    ],
)
def test_provider_options_of_the_wrong_shape_are_refused(provider_options, message):
    with pytest.raises(ValueError) as error:
        ORTTrainerOptions({"provider_options": provider_options})
    assert str(error.value).startswith("Invalid options: {'provider_options': [")
    assert message in str(error.value)


def test_provider_options_of_the_right_shape_are_accepted():
    options = {"CUDAExecutionProvider": {"a": "x", "b": 2, "c": 1.5, "d": True}, "OtherProvider": {}}
    assert ORTTrainerOptions({"provider_options": options})._validated_opts["provider_options"] == options


@pytest.mark.parametrize(
    "options, message",
    [
        ({"device": {"mem_limit": 2**64}}, "{'device': [{'mem_limit': ['max value is 18446744073709551615']}]}"),
        (
            {"graph_transformer": {"propagate_cast_ops_config": {"level": 2**63}}},
            "{'graph_transformer': [{'propagate_cast_ops_config': [{'level': ['max value is 9223372036854775807']}]}]}",
        ),
        (
            {"utils": {"frozen_weights": [["a.weight"]]}},
            "{'utils': [{'frozen_weights': [{0: ['must be of string type']}]}]}",
        ),
    ],
    ids=["mem_limit", "cast_level", "frozen_weights"],
)
def test_values_onnxruntime_cannot_take_are_refused_in_the_legacy_format(options, message):
    with pytest.raises(ValueError) as error:
        ORTTrainerOptions(options)
    assert str(error.value) == f"Invalid options: {message}"


def test_largest_values_onnxruntime_takes_are_accepted():
    options = ORTTrainerOptions(
        {
            "device": {"mem_limit": 2**64 - 1},
            "graph_transformer": {"propagate_cast_ops_config": {"level": 2**63 - 1}},
            "utils": {"frozen_weights": ["fc1.weight"]},
        }
    )
    assert options.device.mem_limit == 2**64 - 1
    assert options.graph_transformer.propagate_cast_ops_config.level == 2**63 - 1


# --- compat -------------------------------------------------------------------------------------------------------


def test_compat_strategy_enum_compares_equal_to_the_options_default():
    from orttrainer import compat

    was_installed = compat.is_installed()
    compat.install()
    try:
        import onnxruntime.training

        strategy = ORTTrainerOptions({}).graph_transformer.propagate_cast_ops_config.strategy
        assert strategy == onnxruntime.training.PropagateCastOpsStrategy.FLOOD_FILL
        assert strategy is onnxruntime.training.PropagateCastOpsStrategy.FLOOD_FILL
        chosen = onnxruntime.training.PropagateCastOpsStrategy.INSERT_AND_REDUCE  # a legacy script's choice
        options = ORTTrainerOptions({"graph_transformer": {"propagate_cast_ops_config": {"strategy": chosen}}})
        assert options.graph_transformer.propagate_cast_ops_config.strategy == chosen
    finally:
        if not was_installed:
            compat.uninstall()
    if not has_training_build():  # the maintained onnxruntime: uninstalling leaves no onnxruntime.training behind
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("onnxruntime.training")
        return
    real = importlib.import_module("onnxruntime.training").PropagateCastOpsStrategy  # the real module again
    assert type(real.FLOOD_FILL).__module__.startswith("onnxruntime")
