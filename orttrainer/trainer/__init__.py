"""Everything that builds and runs graphs: export, graph passes (`graph/`), compile pipeline, session, ORTTrainer."""

from __future__ import annotations

from .orttrainer import ORTTrainer

__all__ = ["ORTTrainer"]
