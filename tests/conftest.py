"""Test configuration: make the shared test modules (models, reference optimizers) importable, verify the result
of every graph pass run by `run_passes` (topological order, onnx.checker; `orttrainer/trainer/graph/passes.py`),
and keep the compile cache (orttrainer/trainer/compile/cache.py) out of the user's home."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("ORTTRAINER_VERIFY_PASSES", "1")


@pytest.fixture(autouse=True)
def _compile_cache(tmp_path_factory, monkeypatch):
    """Each test gets an empty compile cache of its own (on, as it is by default, so that every build also stores
    its graphs and a test that builds the same model twice gets the second from the cache), never the user's
    directory. `ORTTRAINER_COMPILE_CACHE=off` in the environment runs the suite with the cache off."""
    if os.environ.get("ORTTRAINER_COMPILE_CACHE", "").strip().lower() in ("off", "0", "false", "no"):
        return
    monkeypatch.setenv("ORTTRAINER_COMPILE_CACHE", str(tmp_path_factory.mktemp("compile-cache")))
