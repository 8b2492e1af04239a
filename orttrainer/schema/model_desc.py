"""Model description (``model_desc``): validation and the normalised, namedtuple-based representation.

Behaviour follows ``onnxruntime.training.model_desc_validation`` of release 1.13.1 (docs/legacy_api.md §4):
same cerberus schema, same error strings (``"only one is_loss can bet set to True"`` keeps its typo), same
attributes. Two legacy crashes are turned into ``ValueError("Invalid model_desc: ...")``: a tuple that is too short
(``IndexError`` before) and ``inputs``/``outputs`` given as a tuple instead of a list (``IndexError``/``TypeError``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import cerberus
import torch

LEARNING_RATE_IO_DESCRIPTION_NAME = "__learning_rate"
ALL_FINITE_IO_DESCRIPTION_NAME = "__all_finite"
LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME = "__loss_scale_input_name"
GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME = "__gradient_accumulation_name"


# Module-level (legacy built them per instance): one class per kind, so isinstance works across descriptions and
# descriptions pickle. Instances still expose them as `desc._InputDescription` etc. A shape is a list of int (static)
# and str (symbolic) dimensions.
class InputDescription(NamedTuple):
    """A model input: ``name`` and ``shape``."""

    name: str
    shape: list[int | str]


class InputDescriptionTyped(NamedTuple):
    """A model input with its element type."""

    name: str
    shape: list[int | str]
    dtype: torch.dtype


class OutputDescription(NamedTuple):
    """A model output; ``is_loss`` marks the (single) loss output."""

    name: str
    shape: list[int | str]
    is_loss: bool


class OutputDescriptionTyped(NamedTuple):
    """A model output with its element type, and its type under mixed precision (``dtype_amp``, None if unknown)."""

    name: str
    shape: list[int | str]
    is_loss: bool
    dtype: torch.dtype
    dtype_amp: torch.dtype | None


_ErrorFn = Callable[[str, str], None]
_SHAPE_MESSAGE = "'shape' must be a list of int or str with length at least 1"


def _element(value: Any, index: int) -> tuple[bool, Any]:
    """``(present, value[index])``; a missing element is reported by the size check, not by an IndexError."""
    if isinstance(value, Sequence) and len(value) > index:
        return True, value[index]
    return False, None


def _check_name_and_shape(field: str, value: Any, error: _ErrorFn) -> None:
    has_name, name = _element(value, 0)
    if has_name and not isinstance(name, str):
        error(field, "the first element of the tuple (aka name) must be a string")
    elif has_name and not name:  # not in legacy: the graph input or output would have no name
        error(field, "the first element of the tuple (aka name) must not be empty")
    has_shape, shape = _element(value, 1)
    if not has_shape:
        return
    if not isinstance(shape, list):
        error(field, "the second element of the tuple (aka shape) must be a list")
        return
    for index, dim in enumerate(shape):
        if not isinstance(dim, (str, int)) or isinstance(dim, bool):
            error(field, "each shape must be either a string or integer")
        elif dim == "":  # not in legacy: an empty symbolic name names nothing, so no two dims could share it
            error(field, f"dimension {index} of {name!r} is '': a symbolic dimension needs a non-empty name")


def _check_unique_names(inputs: list, outputs: list) -> None:
    """Every input and output name once: inputs are fed and outputs fetched by name, so a second description of a
    name would be silently merged with the first or fail inside ONNX Runtime (legacy accepted duplicates)."""
    seen: dict[str, str] = {}
    described = [(f"inputs[{i}]", desc[0]) for i, desc in enumerate(inputs)]
    described += [(f"outputs[{i}]", desc[0]) for i, desc in enumerate(outputs)]
    for where, name in described:
        if name in seen:
            raise ValueError(
                f"Invalid model_desc: name {name!r} is used by both model_desc {seen[name]} and {where}; every "
                "input and output needs its own name"
            )
        seen[name] = where


def _model_desc_inputs_validation(field: str, value: Any, error: _ErrorFn) -> None:
    """cerberus ``check_with`` for one element of ``model_desc['inputs']``: a ``(name, shape)`` tuple.

    ``name`` is a str; ``shape`` a list of int (static) or str (symbolic) dims, ``[]`` for a scalar. Example:
    ``[('input1', ['batch', 1024]), ('input2', [])]``.
    """
    if not isinstance(value, tuple) or len(value) != 2:
        error(field, "must be a tuple with size 2")
    _check_name_and_shape(field, value, error)


class _OutputsValidation:
    """cerberus ``check_with`` for one element of ``model_desc['outputs']``: ``(name, shape[, is_loss])``.

    Across the whole list at most one ``is_loss`` may be True. The validator sees one element at a time, so the
    count lives on this callable (``loss_counter``, as legacy kept it on its function) and ``_ORTTrainerModelDesc``
    resets it before validating.
    """

    def __init__(self) -> None:
        self.loss_counter = 0

    def __call__(self, field: str, value: Any, error: _ErrorFn) -> None:
        if not isinstance(value, tuple) or not 2 <= len(value) <= 3:
            error(field, "must be a tuple with size 2 or 3")
        has_flag, is_loss = _element(value, 2)
        if has_flag and len(value) == 3:
            if not isinstance(is_loss, bool):
                error(field, "the third element of the tuple (aka is_loss) must be a boolean")
            else:
                self.loss_counter += int(is_loss)
                if self.loss_counter > 1:
                    error(field, "only one is_loss can bet set to True")
        _check_name_and_shape(field, value, error)


_model_desc_outputs_validation = _OutputsValidation()

MODEL_DESC_SCHEMA: dict = {
    "inputs": {
        "type": "list",
        "required": True,
        "minlength": 1,
        "schema": {"check_with": _model_desc_inputs_validation},
    },
    "outputs": {
        "type": "list",
        "required": True,
        "minlength": 1,
        "schema": {"check_with": _model_desc_outputs_validation},
    },
}


class _ModelDescValidator(cerberus.Validator):
    # cerberus's "list" type accepts any non-string Sequence. A tuple of inputs either crashed the legacy element
    # checks (IndexError) or passed and crashed later on item assignment (TypeError); we reject it up front with
    # cerberus's own "must be of list type".
    types_mapping = cerberus.Validator.types_mapping.copy()
    types_mapping["list"] = cerberus.TypeDefinition("list", (list,), ())


def _describe_input(desc: Any) -> str:
    if isinstance(desc, InputDescriptionTyped):
        return f"(name={desc.name}, shape={desc.shape}, dtype={desc.dtype})"
    if isinstance(desc, InputDescription):
        return f"(name={desc.name}, shape={desc.shape})"
    raise ValueError(f"Unexpected type {type(desc)} for input description")


def _describe_output(desc: Any) -> str:
    if isinstance(desc, OutputDescriptionTyped):
        return f"(name={desc.name}, shape={desc.shape}, dtype={desc.dtype}, dtype_amp={desc.dtype_amp})"
    if isinstance(desc, OutputDescription):
        return f"(name={desc.name}, shape={desc.shape})"
    raise ValueError(f"Unexpected type {type(desc)} for output description")


def _describe_special(desc: Any) -> str:
    return f"(name={desc.name}, shape={desc.shape}, dtype={desc.dtype})"


def _check_shape(shape: Any) -> None:
    dims_ok = isinstance(shape, list) and all(
        isinstance(dim, int) or (isinstance(dim, str) and len(dim) > 0) for dim in shape
    )
    assert dims_ok, _SHAPE_MESSAGE


class _ORTTrainerModelDesc:
    """Validated model description.

    ``model_desc`` is ``{'inputs': [(name, shape), ...], 'outputs': [(name, shape[, is_loss]), ...]}``.
    After construction ``inputs`` is a list of ``InputDescription``, ``outputs`` a list of ``OutputDescription``
    (``is_loss`` False when omitted), and ``learning_rate`` the fixed ``InputDescriptionTyped('__learning_rate',
    [1], torch.float32)``. ``all_finite``, ``loss_scale_input`` and ``gradient_accumulation`` are None until the
    trainer sets them by name.

    Raises:
        ValueError: ``"Invalid model_desc: {errors}"`` with cerberus's error dict.
    """

    _InputDescription = InputDescription
    _InputDescriptionTyped = InputDescriptionTyped
    _OutputDescription = OutputDescription
    _OutputDescriptionTyped = OutputDescriptionTyped

    # Set from the validated dict in __init__ (one attribute per schema key).
    inputs: list[InputDescription | InputDescriptionTyped]
    outputs: list[OutputDescription | OutputDescriptionTyped]

    def __init__(self, model_desc: Mapping[str, Any]) -> None:
        self._original = dict(model_desc)
        self._main_class_name = self.__class__.__name__

        _model_desc_outputs_validation.loss_counter = 0
        validator = _ModelDescValidator(MODEL_DESC_SCHEMA)
        self._validated = validator.validated(dict(self._original))
        if self._validated is None:
            raise ValueError(f"Invalid model_desc: {validator.errors}")

        inputs, outputs = self._validated["inputs"], self._validated["outputs"]
        _check_unique_names(inputs, outputs)
        for idx, desc in enumerate(inputs):
            inputs[idx] = InputDescription(*desc)
        for idx, desc in enumerate(outputs):
            outputs[idx] = OutputDescription(*desc) if len(desc) == 3 else OutputDescription(desc[0], desc[1], False)

        self.learning_rate = InputDescriptionTyped(LEARNING_RATE_IO_DESCRIPTION_NAME, [1], torch.float32)
        for key, value in self._validated.items():
            setattr(self, key, self._wrap(value))

    def __repr__(self) -> str:
        lines = ["Model description:", "", "Inputs:"]
        lines += [f"\t{i}: {_describe_input(d)}" for i, d in enumerate(self.inputs)]
        lines.append("Outputs:")
        lines += [f"\t{i}: {_describe_output(d)}" for i, d in enumerate(self.outputs)]
        if self.learning_rate:
            lines.append(f"Learning rate: {_describe_special(self.learning_rate)}")
        if self.all_finite or self.loss_scale_input:
            lines.append("Mixed Precision:")
            if self.all_finite:
                lines.append(f"\tis gradients finite: {_describe_special(self.all_finite)}")
            if self.loss_scale_input:
                lines.append(f"\tloss scale input name: {_describe_special(self.loss_scale_input)}")
        if self.gradient_accumulation:
            lines.append(f"Gradient Accumulation: {_describe_special(self.gradient_accumulation)}")
        return "\n".join(lines)

    def add_type_to_input_description(self, index: int, dtype: torch.dtype) -> None:
        """Replace ``inputs[index]`` by its typed variant with ``dtype`` (an existing dtype is replaced)."""
        assert isinstance(index, int) and index >= 0, "input 'index' must be a positive int"
        assert isinstance(dtype, torch.dtype), "input 'dtype' must be a torch.dtype type"
        desc = self.inputs[index]
        self.inputs[index] = InputDescriptionTyped(desc.name, desc.shape, dtype)

    def add_type_to_output_description(
        self, index: int, dtype: torch.dtype, dtype_amp: torch.dtype | None = None
    ) -> None:
        """Replace ``outputs[index]`` by its typed variant with ``dtype`` and ``dtype_amp`` (both replaced if typed).

        ``dtype_amp`` is the output's type when evaluated under mixed precision.
        """
        assert isinstance(index, int) and index >= 0, "output 'index' must be a positive int"
        assert isinstance(dtype, torch.dtype), "output 'dtype' must be a torch.dtype type"
        assert dtype_amp is None or isinstance(dtype_amp, torch.dtype), (
            "output 'dtype_amp' must be either None or torch.dtype type"
        )
        desc = self.outputs[index]
        self.outputs[index] = OutputDescriptionTyped(desc.name, desc.shape, desc.is_loss, dtype, dtype_amp)

    @property
    def gradient_accumulation(self) -> OutputDescriptionTyped | None:
        """The graph output telling whether gradients were accumulated (bool ``[1]``); set by output name."""
        return getattr(self, GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME, None)

    @gradient_accumulation.setter
    def gradient_accumulation(self, name: str) -> None:
        self._add_output_description(
            self, name, [1], False, torch.bool, None, GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME, ignore_duplicate=True
        )

    @property
    def all_finite(self) -> OutputDescriptionTyped | None:
        """The mixed-precision graph output telling whether all gradients are finite (bool ``[1]``); set by name."""
        return getattr(self, ALL_FINITE_IO_DESCRIPTION_NAME, None)

    @all_finite.setter
    def all_finite(self, name: str) -> None:
        self._add_output_description(
            self, name, [1], False, torch.bool, None, ALL_FINITE_IO_DESCRIPTION_NAME, ignore_duplicate=True
        )

    @property
    def loss_scale_input(self) -> InputDescriptionTyped | None:
        """The mixed-precision graph input fed with the loss scale (float32 scalar); set by input name."""
        return getattr(self, LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME, None)

    @loss_scale_input.setter
    def loss_scale_input(self, name: str) -> None:
        self._add_input_description(
            self, name, [], torch.float32, LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME, ignore_duplicate=True
        )

    def _add_input_description(
        self,
        node: Any,
        name: str,
        shape: list,
        dtype: torch.dtype | None = None,
        attr_name: str | None = None,
        ignore_duplicate: bool = False,
    ) -> None:
        """Add an input description: appended when ``node is self.inputs``, else set as ``node.<attr_name>``.

        Typed (``InputDescriptionTyped``) when ``dtype`` is given. ``ignore_duplicate`` skips the duplicate check,
        so an existing description is overwritten.
        """
        assert isinstance(name, str) and len(name) > 0, "'name' is an invalid input name"
        if not ignore_duplicate:
            if node is self.inputs:
                # Exact comparison: legacy used `name in desc.name`, a substring test that refused 'in' next to 'in1'.
                assert all(name != d.name for d in node), f"'name' {name} already exists in the inputs description"
            else:
                assert attr_name not in dir(self), f"'attr_name' {attr_name} already exists in the 'node'"
        _check_shape(shape)
        assert dtype is None or isinstance(dtype, torch.dtype), "'dtype' must be either None or a torch.dtype type"
        desc = InputDescriptionTyped(name, shape, dtype) if dtype else InputDescription(name, shape)
        self._attach(node, self.inputs, desc, attr_name)

    def _add_output_description(
        self,
        node: Any,
        name: str,
        shape: list,
        is_loss: bool,
        dtype: torch.dtype | None = None,
        dtype_amp: torch.dtype | None = None,
        attr_name: str | None = None,
        ignore_duplicate: bool = False,
    ) -> None:
        """Add an output description: appended when ``node is self.outputs``, else set as ``node.<attr_name>``.

        Typed (``OutputDescriptionTyped``) when ``dtype`` is given. ``ignore_duplicate`` skips the duplicate and
        single-loss checks, so an existing description is overwritten.
        """
        assert isinstance(name, str) and len(name) > 0, "'name' is an invalid output name"
        _check_shape(shape)
        assert isinstance(is_loss, bool), "'is_loss' must be a bool"
        if not ignore_duplicate:
            if node is self.outputs:
                assert all(name != d.name for d in node), f"'name' {name} already exists in the outputs description"
                assert not is_loss or not any(d.is_loss for d in node), (
                    "Only one 'is_loss' is supported at outputs description"
                )
            else:
                assert attr_name not in dir(self), f"'attr_name' {attr_name} already exists in the 'node'"
        assert dtype is None or isinstance(dtype, torch.dtype), "'dtype' must be either None or a torch.dtype type"
        desc: OutputDescription | OutputDescriptionTyped
        if dtype:
            # Legacy dropped `dtype_amp` here (always None); we keep what the caller passed.
            desc = OutputDescriptionTyped(name, shape, is_loss, dtype, dtype_amp)
        else:
            desc = OutputDescription(name, shape, is_loss)
        self._attach(node, self.outputs, desc, attr_name)

    @staticmethod
    def _attach(node: Any, descriptions: list, desc: tuple, attr_name: str | None) -> None:
        if node is descriptions:
            descriptions.append(desc)
            return
        assert isinstance(attr_name, str) and len(attr_name) > 0, "Invalid 'attr_name'"
        setattr(node, attr_name, desc)

    def _wrap(self, value: Any) -> Any:
        """Make ``value`` an attribute value: lists/tuples rebuilt, dicts wrapped, descriptions kept as they are."""
        if isinstance(value, (InputDescription, InputDescriptionTyped, OutputDescription, OutputDescriptionTyped)):
            return value
        if isinstance(value, (list, tuple)):
            return type(value)([self._wrap(item) for item in value])
        if isinstance(value, dict):
            return _ORTTrainerModelDescInternal(self._main_class_name, value)
        if isinstance(value, (int, float, bool, str)):
            return value
        raise ValueError(
            f"Unsupported type for model_desc ({value}).Only int, float, bool, str, list, tuple and dict are supported"
        )


class _ORTTrainerModelDescInternal(_ORTTrainerModelDesc):
    r"""Attribute-access view of a nested dict inside a model description. Users must not create it."""

    def __init__(self, main_class_name: str, model_desc: Mapping[str, Any]) -> None:
        self._main_class_name = main_class_name
        for key, value in dict(model_desc).items():
            setattr(self, key, self._wrap(value))
