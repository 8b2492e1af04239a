"""Model description validation and representation against legacy 1.13.1 (docs/legacy_api.md §4)."""

from __future__ import annotations

import pickle

import pytest
import torch

from orttrainer import model_desc_validation as md_val
from orttrainer.schema import model_desc as md_module
from orttrainer.schema.model_desc import (
    ALL_FINITE_IO_DESCRIPTION_NAME,
    GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME,
    LEARNING_RATE_IO_DESCRIPTION_NAME,
    LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME,
    _ORTTrainerModelDesc,
)

SIMPLE = {
    "inputs": [("x", ["batch", 4]), ("label", ["batch"])],
    "outputs": [("loss", [], True), ("logits", ["batch", 2])],
}

# Every row of docs/legacy_api.md §4.2, verbatim; rows written with "..." or "or" are spelled out.
ERROR_TABLE = [
    (
        {"inputs": [(True, [])], "outputs": [(True, [])]},
        "Invalid model_desc: {'inputs': [{0: ['the first element of the tuple (aka name) must be a string']}], "
        "'outputs': [{0: ['the first element of the tuple (aka name) must be a string']}]}",
    ),
    (
        {"inputs": [("in1", None)], "outputs": [("out1", None)]},
        "Invalid model_desc: {'inputs': [{0: ['the second element of the tuple (aka shape) must be a list']}], "
        "'outputs': [{0: ['the second element of the tuple (aka shape) must be a list']}]}",
    ),
    (
        {"inputs": [("in1", [])], "outputs": [("out1", [], None)]},
        "Invalid model_desc: {'outputs': [{0: ['the third element of the tuple (aka is_loss) must be a boolean']}]}",
    ),
    (
        {"inputs": [("in1", [True])], "outputs": [("out1", [True])]},
        "Invalid model_desc: {'inputs': [{0: ['each shape must be either a string or integer']}], "
        "'outputs': [{0: ['each shape must be either a string or integer']}]}",
    ),
    (
        {"inputs": [("in1", [])], "outputs": [("out1", [], True), ("out2", [], True)]},
        "Invalid model_desc: {'outputs': [{1: ['only one is_loss can bet set to True']}]}",
    ),
    (
        {"inputz": [("in1", [])], "outputs": [("out1", [], True)]},
        "Invalid model_desc: {'inputs': ['required field'], 'inputz': ['unknown field']}",
    ),
    (
        {"inputs": [("in1", [])], "outputz": [("out1", [], True)]},
        "Invalid model_desc: {'outputs': ['required field'], 'outputz': ['unknown field']}",
    ),
    ({"inputs": [], "outputs": [("out1", [], True)]}, "Invalid model_desc: {'inputs': ['min length is 1']}"),
    (
        {"inputs": [("in1", [], 1)], "outputs": [("out1", [], True)]},
        "Invalid model_desc: {'inputs': [{0: ['must be a tuple with size 2']}]}",
    ),
    (
        {"inputs": [["in1", []]], "outputs": [("out1", [], True)]},
        "Invalid model_desc: {'inputs': [{0: ['must be a tuple with size 2']}]}",
    ),
    (
        {"inputs": [("in1", [])], "outputs": [("out1", [], True, 1)]},
        "Invalid model_desc: {'outputs': [{0: ['must be a tuple with size 2 or 3']}]}",
    ),
    (
        {"inputs": [("in1", [])], "outputs": [["out1", [], True]]},
        "Invalid model_desc: {'outputs': [{0: ['must be a tuple with size 2 or 3']}]}",
    ),
]

# Legacy crashed on these (IndexError / TypeError, §4.2 quirks and §15 item 7); they are now clean ValueErrors.
FIXED_CRASHES = [
    (
        {"inputs": [("in1", [])], "outputs": [("out1",)]},
        "Invalid model_desc: {'outputs': [{0: ['must be a tuple with size 2 or 3']}]}",
    ),
    (
        {"inputs": [("in1",)], "outputs": [("out1", [], True)]},
        "Invalid model_desc: {'inputs': [{0: ['must be a tuple with size 2']}]}",
    ),
    (
        {"inputs": [()], "outputs": [()]},
        "Invalid model_desc: {'inputs': [{0: ['must be a tuple with size 2']}], "
        "'outputs': [{0: ['must be a tuple with size 2 or 3']}]}",
    ),
    (
        {"inputs": [(True,)], "outputs": [("out1", [], True)]},
        # cerberus sorts the messages of one field
        "Invalid model_desc: {'inputs': [{0: ['the first element of the tuple (aka name) must be a string', "
        "'must be a tuple with size 2']}]}",
    ),
    (
        {"inputs": [None], "outputs": [("out1", [], True)]},
        "Invalid model_desc: {'inputs': [{0: ['must be a tuple with size 2', 'null value not allowed']}]}",
    ),
    (
        {"inputs": ("in1", []), "outputs": [("out1", [], True)]},
        "Invalid model_desc: {'inputs': ['must be of list type']}",
    ),
    (
        {"inputs": (("in1", []),), "outputs": [("out1", [], True)]},
        "Invalid model_desc: {'inputs': ['must be of list type']}",
    ),
    (
        {"inputs": [("in1", [])], "outputs": ("out1", [], True)},
        "Invalid model_desc: {'outputs': ['must be of list type']}",
    ),
]


@pytest.mark.parametrize("model_desc, message", ERROR_TABLE + FIXED_CRASHES)
def test_invalid_model_desc_raises_value_error_with_cerberus_errors(model_desc, message):
    with pytest.raises(ValueError) as excinfo:
        _ORTTrainerModelDesc(model_desc)
    assert str(excinfo.value) == message


@pytest.mark.parametrize(
    "model_desc",
    [
        # legacy let an empty-string dim pass; it is refused now (tests/test_reliability_options.py)
        {"inputs": [("in1", ["d"])], "outputs": [("out1", [])]},
        {"inputs": [("in1", [])], "outputs": [("out1", [], False), ("out2", [], False)]},
        {"inputs": [("in1", ["batch", 3, "seq"])], "outputs": [("out1", [], True), ("out2", [2], False)]},
    ],
)
def test_valid_model_desc_is_accepted(model_desc):
    desc = _ORTTrainerModelDesc(model_desc)
    assert [tuple(i) for i in desc.inputs] == model_desc["inputs"]
    assert [tuple(o)[: len(m)] for o, m in zip(desc.outputs, model_desc["outputs"], strict=True)] == model_desc[
        "outputs"
    ]


def test_loss_counter_is_reset_for_every_description():
    first = _ORTTrainerModelDesc({"inputs": [("a", [])], "outputs": [("loss", [], True)]})
    second = _ORTTrainerModelDesc({"inputs": [("a", [])], "outputs": [("loss", [], True)]})
    assert first.outputs[0].is_loss and second.outputs[0].is_loss


def test_normalised_representation():
    desc = _ORTTrainerModelDesc(SIMPLE)
    assert desc.inputs == [("x", ["batch", 4]), ("label", ["batch"])]
    assert all(type(i) is md_val.InputDescription for i in desc.inputs)
    assert desc.inputs[0].name == "x" and desc.inputs[0].shape == ["batch", 4]
    assert desc.outputs == [("loss", [], True), ("logits", ["batch", 2], False)]  # 2-tuples get is_loss=False
    assert all(type(o) is md_val.OutputDescription for o in desc.outputs)
    assert desc.learning_rate == md_val.InputDescriptionTyped(LEARNING_RATE_IO_DESCRIPTION_NAME, [1], torch.float32)
    assert desc._InputDescription is md_val.InputDescription
    assert desc._OutputDescriptionTyped._fields == ("name", "shape", "is_loss", "dtype", "dtype_amp")
    assert desc._original == SIMPLE
    assert SIMPLE["inputs"][0].__class__ is tuple  # the user's lists are not rewritten in place


def test_constants():
    assert (
        LEARNING_RATE_IO_DESCRIPTION_NAME,
        ALL_FINITE_IO_DESCRIPTION_NAME,
        LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME,
        GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME,
    ) == ("__learning_rate", "__all_finite", "__loss_scale_input_name", "__gradient_accumulation_name")


def test_special_descriptions_are_none_until_set_then_stored_under_the_constant():
    desc = _ORTTrainerModelDesc(SIMPLE)
    assert (desc.all_finite, desc.loss_scale_input, desc.gradient_accumulation) == (None, None, None)
    desc.all_finite = "all_is_finite"
    desc.loss_scale_input = "loss_scale"
    desc.gradient_accumulation = "accumulate"
    assert desc.all_finite == md_val.OutputDescriptionTyped("all_is_finite", [1], False, torch.bool, None)
    assert desc.loss_scale_input == md_val.InputDescriptionTyped("loss_scale", [], torch.float32)
    assert desc.gradient_accumulation == md_val.OutputDescriptionTyped("accumulate", [1], False, torch.bool, None)
    assert getattr(desc, ALL_FINITE_IO_DESCRIPTION_NAME) is desc.all_finite
    assert getattr(desc, LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME) is desc.loss_scale_input
    assert getattr(desc, GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME) is desc.gradient_accumulation
    desc.all_finite = "renamed"  # setters ignore duplicates and overwrite
    assert desc.all_finite.name == "renamed"
    assert len(desc.inputs) == 2 and len(desc.outputs) == 2  # special descriptions are not added to the lists


def test_add_type_to_input_and_output_description():
    desc = _ORTTrainerModelDesc(SIMPLE)
    desc.add_type_to_input_description(0, torch.float32)
    assert desc.inputs[0] == md_val.InputDescriptionTyped("x", ["batch", 4], torch.float32)
    desc.add_type_to_input_description(0, torch.int64)  # already typed: the dtype is replaced
    assert desc.inputs[0] == md_val.InputDescriptionTyped("x", ["batch", 4], torch.int64)
    desc.add_type_to_output_description(1, torch.float32, torch.float16)
    assert desc.outputs[1] == md_val.OutputDescriptionTyped("logits", ["batch", 2], False, torch.float32, torch.float16)
    desc.add_type_to_output_description(1, torch.float64)  # both dtypes replaced
    assert desc.outputs[1] == md_val.OutputDescriptionTyped("logits", ["batch", 2], False, torch.float64, None)
    assert type(desc.inputs[1]) is md_val.InputDescription


@pytest.mark.parametrize(
    "method, args, message",
    [
        ("add_type_to_input_description", (-1, torch.float32), "input 'index' must be a positive int"),
        ("add_type_to_input_description", ("0", torch.float32), "input 'index' must be a positive int"),
        ("add_type_to_input_description", (0, "float32"), "input 'dtype' must be a torch.dtype type"),
        ("add_type_to_output_description", (-1, torch.float32), "output 'index' must be a positive int"),
        ("add_type_to_output_description", (0, None), "output 'dtype' must be a torch.dtype type"),
        (
            "add_type_to_output_description",
            (0, torch.float32, "half"),
            "output 'dtype_amp' must be either None or torch.dtype type",
        ),
    ],
)
def test_add_type_assertions(method, args, message):
    desc = _ORTTrainerModelDesc(SIMPLE)
    with pytest.raises(AssertionError) as excinfo:
        getattr(desc, method)(*args)
    assert str(excinfo.value) == message


def test_repr_layout_untyped():
    desc = _ORTTrainerModelDesc(SIMPLE)
    assert repr(desc) == (
        "Model description:\n"
        "\n"
        "Inputs:\n"
        "\t0: (name=x, shape=['batch', 4])\n"
        "\t1: (name=label, shape=['batch'])\n"
        "Outputs:\n"
        "\t0: (name=loss, shape=[])\n"
        "\t1: (name=logits, shape=['batch', 2])\n"
        "Learning rate: (name=__learning_rate, shape=[1], dtype=torch.float32)"
    )


def test_repr_layout_typed_with_every_special_description():
    desc = _ORTTrainerModelDesc(SIMPLE)
    desc.add_type_to_input_description(0, torch.float32)
    desc.add_type_to_output_description(0, torch.float32, torch.float16)
    desc.all_finite = "all_finite"
    desc.loss_scale_input = "loss_scale"
    desc.gradient_accumulation = "accumulate"
    assert repr(desc) == (
        "Model description:\n"
        "\n"
        "Inputs:\n"
        "\t0: (name=x, shape=['batch', 4], dtype=torch.float32)\n"
        "\t1: (name=label, shape=['batch'])\n"
        "Outputs:\n"
        "\t0: (name=loss, shape=[], dtype=torch.float32, dtype_amp=torch.float16)\n"
        "\t1: (name=logits, shape=['batch', 2])\n"
        "Learning rate: (name=__learning_rate, shape=[1], dtype=torch.float32)\n"
        "Mixed Precision:\n"
        "\tis gradients finite: (name=all_finite, shape=[1], dtype=torch.bool)\n"
        "\tloss scale input name: (name=loss_scale, shape=[], dtype=torch.float32)\n"
        "Gradient Accumulation: (name=accumulate, shape=[1], dtype=torch.bool)"
    )


def test_repr_mixed_precision_block_with_only_loss_scale():
    desc = _ORTTrainerModelDesc(SIMPLE)
    desc.loss_scale_input = "loss_scale"
    assert repr(desc).endswith(
        "Learning rate: (name=__learning_rate, shape=[1], dtype=torch.float32)\n"
        "Mixed Precision:\n"
        "\tloss scale input name: (name=loss_scale, shape=[], dtype=torch.float32)"
    )


def test_add_input_and_output_descriptions_to_the_lists():
    desc = _ORTTrainerModelDesc(SIMPLE)
    desc._add_input_description(desc.inputs, "mask", ["batch"])
    desc._add_input_description(desc.inputs, "lr2", [1], torch.float32)
    desc._add_output_description(desc.outputs, "probs", ["batch", 2], False, torch.float32, torch.float16)
    desc._add_output_description(desc.outputs, "extra", [], False)
    assert desc.inputs[2:] == [("mask", ["batch"]), ("lr2", [1], torch.float32)]
    assert type(desc.inputs[3]) is md_val.InputDescriptionTyped
    # dtype_amp is kept (legacy silently stored None).
    assert desc.outputs[2] == md_val.OutputDescriptionTyped("probs", ["batch", 2], False, torch.float32, torch.float16)
    assert desc.outputs[3] == md_val.OutputDescription("extra", [], False)


def test_add_description_to_a_named_attribute():
    desc = _ORTTrainerModelDesc(SIMPLE)
    desc._add_input_description(desc, "scale", [], torch.float32, attr_name="my_scale")
    assert desc.my_scale == md_val.InputDescriptionTyped("scale", [], torch.float32)
    with pytest.raises(AssertionError, match=r"^'attr_name' my_scale already exists in the 'node'$"):
        desc._add_input_description(desc, "scale", [], torch.float32, attr_name="my_scale")
    with pytest.raises(AssertionError, match=r"^Invalid 'attr_name'$"):
        desc._add_output_description(desc, "o", [], False, attr_name="")


def test_duplicate_names_are_compared_exactly():
    desc = _ORTTrainerModelDesc({"inputs": [("in1", [])], "outputs": [("out1", [])]})
    desc._add_input_description(desc.inputs, "in", [])  # legacy's substring test refused this one
    desc._add_output_description(desc.outputs, "out", [], False)
    assert [i.name for i in desc.inputs] == ["in1", "in"]
    assert [o.name for o in desc.outputs] == ["out1", "out"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda d: d._add_input_description(d.inputs, "", []), "'name' is an invalid input name"),
        (lambda d: d._add_input_description(d.inputs, "x", []), "'name' x already exists in the inputs description"),
        (
            lambda d: d._add_input_description(d.inputs, "y", [""]),
            "'shape' must be a list of int or str with length at least 1",
        ),
        (
            lambda d: d._add_input_description(d.inputs, "y", (1,)),
            "'shape' must be a list of int or str with length at least 1",
        ),
        (
            lambda d: d._add_input_description(d.inputs, "y", [], "f"),
            "'dtype' must be either None or a torch.dtype type",
        ),
        (lambda d: d._add_output_description(d.outputs, 3, [], False), "'name' is an invalid output name"),
        (
            lambda d: d._add_output_description(d.outputs, "o", [1.5], False),
            "'shape' must be a list of int or str with length at least 1",
        ),
        (lambda d: d._add_output_description(d.outputs, "o", [], 1), "'is_loss' must be a bool"),
        (
            lambda d: d._add_output_description(d.outputs, "loss", [], False),
            "'name' loss already exists in the outputs description",
        ),
        (
            lambda d: d._add_output_description(d.outputs, "l2", [], True),
            "Only one 'is_loss' is supported at outputs description",
        ),
    ],
)
def test_add_description_assertions(call, message):
    desc = _ORTTrainerModelDesc(SIMPLE)
    with pytest.raises(AssertionError) as excinfo:
        call(desc)
    assert str(excinfo.value) == message


def test_wrap_rejects_unsupported_types():
    desc = _ORTTrainerModelDesc(SIMPLE)
    with pytest.raises(ValueError) as excinfo:
        desc._wrap(None)
    assert str(excinfo.value) == (
        "Unsupported type for model_desc (None).Only int, float, bool, str, list, tuple and dict are supported"
    )
    wrapped = desc._wrap({"a": [1, ("b", 2.0)]})
    assert isinstance(wrapped, md_val._ORTTrainerModelDescInternal) and wrapped.a == [1, ("b", 2.0)]


def test_descriptions_pickle_and_share_types_across_instances():
    first, second = _ORTTrainerModelDesc(SIMPLE), _ORTTrainerModelDesc(SIMPLE)
    assert isinstance(first.inputs[0], second._InputDescription)
    restored = pickle.loads(pickle.dumps(first))
    assert restored.inputs == first.inputs and restored.learning_rate == first.learning_rate


def test_legacy_module_path_reexports_the_same_objects():
    assert md_val._ORTTrainerModelDesc is _ORTTrainerModelDesc
    assert md_val.MODEL_DESC_SCHEMA is md_module.MODEL_DESC_SCHEMA
    assert md_val.LEARNING_RATE_IO_DESCRIPTION_NAME == "__learning_rate"
    assert set(md_val.MODEL_DESC_SCHEMA) == {"inputs", "outputs"}
