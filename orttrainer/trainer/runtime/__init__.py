"""Stage 3: running the compiled graphs on ONNX Runtime.

- `session.py`: the session that holds the training state and runs the graphs; which graph runs a batch; Dropout
  nodes seeded from the trainer's stream;
- `data_parallel.py`: one rank of data-parallel training (ranks, ZeRO, collectives);
- `static_graphs.py`: the 'ort' builder's graph specialised to input shapes on the CPU;
- `ort.py`: which ONNX Runtime is installed, the device, session options and providers;
- `ort_private.py`: every private ONNX Runtime API, behind small functions.
"""

from __future__ import annotations

from .ort import has_training_build

__all__ = ["has_training_build"]
