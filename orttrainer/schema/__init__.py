"""Pure-Python schema layer: ``ORTTrainerOptions`` and the model-description validator.

Nothing here imports onnxruntime, so options and model descriptions can be built and checked without it.
"""

from __future__ import annotations

from .model_desc import (
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
from .options import (
    _ORTTRAINER_OPTIONS_SCHEMA,
    ORTTrainerOptions,
    ORTTrainerOptionsValidator,
    PropagateCastOpsStrategy,
    _ORTTrainerOptionsInternal,
)

__all__ = [
    "ALL_FINITE_IO_DESCRIPTION_NAME",
    "GRADIENT_ACCUMULATION_IO_DESCRIPTION_NAME",
    "LEARNING_RATE_IO_DESCRIPTION_NAME",
    "LOSS_SCALE_INPUT_IO_DESCRIPTION_NAME",
    "MODEL_DESC_SCHEMA",
    "InputDescription",
    "InputDescriptionTyped",
    "ORTTrainerOptions",
    "ORTTrainerOptionsValidator",
    "OutputDescription",
    "OutputDescriptionTyped",
    "PropagateCastOpsStrategy",
    # Private names of the legacy modules, re-exported for the trainer and for legacy-path aliases.
    "_ORTTRAINER_OPTIONS_SCHEMA",
    "_ORTTrainerModelDesc",
    "_ORTTrainerModelDescInternal",
    "_ORTTrainerOptionsInternal",
]
