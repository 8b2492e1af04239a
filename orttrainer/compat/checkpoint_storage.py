"""Legacy import path: ``onnxruntime.training._checkpoint_storage`` lives on as ``orttrainer._checkpoint_storage``.

The implementation is :mod:`orttrainer.checkpoint.storage`. Checkpoint aggregation reads files through this module's
``load`` (looked up at call time), so tests that patch ``orttrainer._checkpoint_storage.load`` — as the legacy tests
patched ``onnxruntime.training._checkpoint_storage.load`` — see every read.
"""

from __future__ import annotations

from ..checkpoint.storage import from_serialized_hex, load, save, to_serialized_hex

__all__ = ["from_serialized_hex", "load", "save", "to_serialized_hex"]
