"""Test configuration: make the shared test modules (models, reference optimizers) importable."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
