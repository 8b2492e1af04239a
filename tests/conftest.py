"""Test configuration: make the shared test modules (models, reference optimizers) importable, and verify the result
of every graph pass run by `run_passes` (topological order, onnx.checker; `orttrainer/trainer/graph/passes.py`)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("ORTTRAINER_VERIFY_PASSES", "1")
