"""Every example runs in a short mode and does what it says."""

from __future__ import annotations

import importlib.util
import os

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_classifier_learns_in_a_few_epochs(capsys):
    accuracy = _load("digits").main(["--epochs", "4"])
    assert accuracy > 0.8
    assert "test accuracy" in capsys.readouterr().out

