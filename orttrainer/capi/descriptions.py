"""The older API's model description: `IODescription`, `ModelDescription`, `generate_sample` (docs/legacy_api.md §14.1).

Rules:
- `IODescription(name, shape, dtype=None, num_classes=None)` keeps the legacy attribute names `name_`, `shape_`,
  `dtype_`, `num_classes_`. A `str` dimension is symbolic (dynamic); an `int` is fixed.
- `ModelDescription(inputs, outputs)`: the **first output is the loss** (a scalar, shape `[]`); there is no
  `is_loss` flag. `to_model_desc` turns it into the new API's dict, marking output 0 as the loss.
- `generate_sample(desc, device)`: every `str` dim becomes 1; with `num_classes_` the sample is
  `torch.randint(0, num_classes_)`, otherwise `torch.randn`, in `dtype_`.
- `bind_real_inputs`: the original bound the tensors it was given, whatever their descriptions said (ONNX Runtime's
  getting-started sample declares its int64 tokens as float32 and a flat label as [bptt, batch, ntokens]). So does
  this API, with a warning naming each input whose description disagrees, before the model is built.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import torch

from ..dtypes import ELEMENT_TYPES


class IODescription:
    """One input or output: a name, a shape (ints and symbolic `str` dims), an optional dtype and class count."""

    def __init__(
        self, name: str, shape: Sequence, dtype: torch.dtype | None = None, num_classes: int | None = None
    ) -> None:
        self.name_ = name
        self.shape_ = shape
        self.dtype_ = dtype
        self.num_classes_ = num_classes

    def __repr__(self) -> str:
        return (
            f"IODescription({self.name_!r}, {list(self.shape_)!r}, dtype={self.dtype_}, "
            f"num_classes={self.num_classes_})"
        )


class ModelDescription:
    """`inputs_` and `outputs_`: lists of `IODescription`; `outputs_[0]` is the loss."""

    def __init__(self, inputs: Sequence[IODescription], outputs: Sequence[IODescription]) -> None:
        self.inputs_ = inputs
        self.outputs_ = outputs

    def __repr__(self) -> str:
        return f"ModelDescription(inputs={list(self.inputs_)!r}, outputs={list(self.outputs_)!r})"


def to_model_desc(model_desc: ModelDescription) -> dict:
    """The new API's `{'inputs': [(name, shape)], 'outputs': [(name, shape, is_loss)]}`; output 0 is the loss."""
    _check_model_description(model_desc)
    inputs = [(d.name_, list(d.shape_)) for d in model_desc.inputs_]
    outputs = [(d.name_, list(d.shape_), i == 0) for i, d in enumerate(model_desc.outputs_)]
    return {"inputs": inputs, "outputs": outputs}


def _check_model_description(model_desc) -> None:
    if not (hasattr(model_desc, "inputs_") and hasattr(model_desc, "outputs_")):
        raise TypeError(
            f"model_desc must be a ModelDescription (inputs_, outputs_), got {type(model_desc).__name__}; "
            "the older ORTTrainer takes ModelDescription/IODescription objects, the new one a dict"
        )
    for kind, descs in (("inputs_", model_desc.inputs_), ("outputs_", model_desc.outputs_)):
        for d in descs:
            if not isinstance(d, IODescription):
                raise TypeError(f"model_desc.{kind} must hold IODescription objects, got {type(d).__name__}")
    if not model_desc.outputs_:
        raise ValueError("model_desc.outputs_ is empty: the first output must be the loss")


def generate_sample(desc: IODescription, device: torch.device | str | None = None) -> torch.Tensor:
    """A random tensor matching `desc`; every symbolic dimension becomes 1."""
    size = [1 if isinstance(s, str) else s for s in desc.shape_]
    if desc.num_classes_:
        sample = torch.randint(0, desc.num_classes_, size, dtype=desc.dtype_)
    else:
        sample = torch.randn(size, dtype=desc.dtype_)
    return sample.to(device) if device is not None else sample


def resolve_symbolic_dimensions(
    inputs: Sequence[torch.Tensor], input_descs: Sequence[IODescription], output_descs: Sequence[IODescription]
) -> list[IODescription]:
    """Copies of `output_descs` with every symbolic dim replaced by the size the inputs bind it to.

    Unlike the original (later inputs silently overwrote earlier sizes; an unbound output dim raised KeyError), a
    name bound to two sizes or never bound raises `ValueError` naming it.
    """
    sizes: dict[str, int] = {}
    for value, desc in zip(inputs, input_descs, strict=False):
        for dim, size in zip(desc.shape_, value.shape, strict=False):
            if isinstance(dim, str):
                if sizes.setdefault(dim, size) != size:
                    raise ValueError(f"dimension {dim!r} is {sizes[dim]} in one input and {size} in {desc.name_!r}")
    resolved = copy.deepcopy(list(output_descs))
    for desc in resolved:
        unbound = [d for d in desc.shape_ if isinstance(d, str) and d not in sizes]
        if unbound:
            raise ValueError(f"output {desc.name_!r}: dimensions {unbound} are bound by no input")
        desc.shape_ = [sizes[d] if isinstance(d, str) else d for d in desc.shape_]
    return resolved


# The older API's subset of the element-type table (orttrainer.dtypes), with its one departure: bool maps to Python's
# `bool`, not `np.bool_`.
_LEGACY_TORCH_DTYPES = (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16)
_TORCH_TO_NUMPY: dict[torch.dtype, type] = {
    t.torch: t.numpy for t in ELEMENT_TYPES if t.torch in _LEGACY_TORCH_DTYPES and t.numpy is not None
} | {torch.bool: bool}


def dtype_torch_to_numpy(torch_dtype: torch.dtype) -> type:
    """The legacy subset: float64/32/16, int64/32/16 and bool; anything else raises."""
    if torch_dtype not in _TORCH_TO_NUMPY:
        raise Exception(f"Torch type to numpy type mapping unavailable for: {torch_dtype}")  # noqa: TRY002 (legacy)
    return _TORCH_TO_NUMPY[torch_dtype]


def bind_real_inputs(
    descs: Sequence[IODescription], inputs: Sequence[torch.Tensor], declared: list, stacklevel: int = 4
) -> None:
    """Before the first step: make the new trainer's model_desc inputs (`declared`, a list of `InputDescription`
    modified in place) agree with the first batch where an `IODescription` disagrees with its tensor, warning once
    per such input. Rule: a description of the tensor's rank keeps its `str` (dynamic) dims and takes the tensor's
    size for each `int` dim that differs; another rank takes the tensor's shape. A declared dtype other than the
    tensor's is only warned about (the tensor is bound as it is, as the original did)."""
    for k, (desc, tensor) in enumerate(zip(descs, inputs, strict=False)):
        if not isinstance(tensor, torch.Tensor):
            continue
        actual, shape = list(tensor.shape), list(desc.shape_)
        if len(shape) == len(actual):
            bound = [d if isinstance(d, str) else a for d, a in zip(shape, actual, strict=True)]
        else:
            bound = list(actual)
        problems = []
        if bound != shape:
            problems.append(f"shape {shape}, but the input has shape {actual}")
        if desc.dtype_ is not None and desc.dtype_ != tensor.dtype:
            problems.append(f"dtype {desc.dtype_}, but the input is {tensor.dtype}")
        if not problems:
            continue
        warnings.warn(
            f"IODescription {desc.name_!r} declares {' and '.join(problems)}: the input is bound as it is (as the "
            f"original did), with the shape {bound}; correct the description to silence this warning",
            stacklevel=stacklevel,
        )
        declared[k] = declared[k]._replace(shape=bound)
