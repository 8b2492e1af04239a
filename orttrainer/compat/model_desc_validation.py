"""Legacy import path: ``onnxruntime.training.model_desc_validation`` as ``orttrainer.model_desc_validation``.

The implementation is :mod:`orttrainer.schema.model_desc`; this module re-exports it so that legacy code such as
``from onnxruntime.training import model_desc_validation as md_val`` keeps working after a rename of the package.
"""

from __future__ import annotations

from ..schema.model_desc import (
    ALL_FINITE_IO_DESCRIPTION_NAME,
    GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME,
    LEARNING_RATE_IO_DESCRIPTION_NAME,
    LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME,
    MODEL_DESC_SCHEMA,
    InputDescription,
    InputDescriptionTyped,
    OutputDescription,
    OutputDescriptionTyped,
    _ORTTrainerModelDesc,
    _ORTTrainerModelDescInternal,
)

__all__ = [
    "ALL_FINITE_IO_DESCRIPTION_NAME",
    "GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME",
    "LEARNING_RATE_IO_DESCRIPTION_NAME",
    "LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME",
    "MODEL_DESC_SCHEMA",
    "InputDescription",
    "InputDescriptionTyped",
    "OutputDescription",
    "OutputDescriptionTyped",
    "_ORTTrainerModelDesc",
    "_ORTTrainerModelDescInternal",
]
