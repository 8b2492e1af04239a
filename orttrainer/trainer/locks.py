"""The process-wide lock around exporting and tracing PyTorch modules.

Why: torch's exporters and AOTAutograd keep process-global state while they run (`GLOBALS.in_onnx_export`, the
tracing mode), so two threads exporting at once fail ("GLOBALS.in_onnx_export must be True"). Building holds this
lock; training steps do not, so trainers in different threads train concurrently once built.
"""

from __future__ import annotations

import threading

TRACING = threading.RLock()
