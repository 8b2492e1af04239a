"""Which ONNX Runtime is installed, and what it can do.

Three distributions provide the `onnxruntime` module: `onnxruntime` (the maintained CPU build), `onnxruntime-gpu`
(the maintained CUDA build) and `onnxruntime-training` (1.19.2, the last training build: ONNX Runtime's gradient
builder and training kernels, Python <= 3.11). They write the same files, so two of them in one environment leave a
module made of both: `check_runtime` refuses that mix, and the absence of any, with the commands that fix it.
"""

from __future__ import annotations

import importlib.metadata

from . import ort_private

DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training")
EXTRAS = {"onnxruntime": "cpu", "onnxruntime-gpu": "gpu", "onnxruntime-training": "ort-training"}
TRAINING_EXTRA_HINT = "pip install 'orttrainer[ort-training]' (Python 3.11; it replaces the maintained onnxruntime)"


def installed_runtimes() -> list[str]:
    """The ONNX Runtime distributions installed, as 'name==version'."""
    found = []
    for name in DISTRIBUTIONS:
        try:
            found.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def check_runtime() -> None:
    """Raise ImportError when no ONNX Runtime, or more than one of its distributions, is installed."""
    found = installed_runtimes()
    if not found:
        raise ImportError(
            "no ONNX Runtime is installed: pip install 'orttrainer[cpu]' (the maintained onnxruntime), "
            "'orttrainer[gpu]' (onnxruntime-gpu, CUDA 12) or 'orttrainer[ort-training]' (onnxruntime-training "
            "1.19.2, Python 3.11)"
        )
    if len(found) > 1:
        names = [f.partition("==")[0] for f in found]
        raise ImportError(
            f"{found} are installed together, but they own the same Python module 'onnxruntime', so it is now a "
            f"mix of both. Keep exactly one: pip uninstall -y {' '.join(names)}, then pip install one of them "
            f"(orttrainer's extras: {', '.join(f'[{EXTRAS[n]}]' for n in names)})"
        )


def has_training_build() -> bool:
    """Whether ONNX Runtime's gradient builder and training kernels are available."""
    return ort_private.has_training_build()
