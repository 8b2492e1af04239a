"""orttrainer's own former module names, served without a file at their old place: `FORMER_NAMES`.

Rule: importing a former name yields the module it was renamed to, itself (the same object, registered under both
names in `sys.modules`), imported only when first asked for. `orttrainer/__init__.py` installs the finder, so the
package's top level shows only its real packages. `python -m orttrainer.run` runs `orttrainer.compat.run`.

Why the same object: code that patches a former name (`orttrainer._checkpoint_storage.load`, as the legacy tests
patched `onnxruntime.training._checkpoint_storage.load`) must change what the implementation reads.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

FORMER_NAMES = {
    # the legacy `onnxruntime.training` module names, under orttrainer
    "orttrainer._checkpoint_storage": "orttrainer.compat.checkpoint_storage",
    "orttrainer.orttrainer_options": "orttrainer.compat.orttrainer_options",
    "orttrainer.model_desc_validation": "orttrainer.compat.model_desc_validation",
    "orttrainer._utils": "orttrainer.compat.utils",
    "orttrainer.run": "orttrainer.compat.run",
    # `orttrainer.capi` (the older `onnxruntime.capi.ort_trainer` API) was first called `orttrainer.legacy`
    "orttrainer.legacy": "orttrainer.compat.legacy",
    "orttrainer.legacy.trainer": "orttrainer.capi.ort_trainer",
    "orttrainer.legacy.arguments": "orttrainer.capi.argument_mapping",
    "orttrainer.legacy.positional": "orttrainer.capi.input_matching",
    "orttrainer.legacy.checkpointing": "orttrainer.capi.checkpointing",
    "orttrainer.legacy.descriptions": "orttrainer.capi.descriptions",
    "orttrainer.legacy.loss_scaler": "orttrainer.capi.loss_scaler",
}


class FormerNameFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the former names (module docstring) and loads each as its renamed module."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        renamed = FORMER_NAMES.get(name)
        if renamed is None:
            return None
        real = importlib.util.find_spec(renamed)
        origin = real.origin if real is not None else None
        return importlib.util.spec_from_loader(name, self, origin=origin)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(FORMER_NAMES[spec.name])
        spec.loader_state = module.__spec__  # the import system replaces it with `spec` next: kept for exec_module
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The module ran under its own name. The import system has just given it the former name's spec: give it
        # back its own, so that it stays what it was (reloading, pickling by module name).
        assert module.__spec__ is not None
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, name: str) -> types.CodeType | None:
        """The renamed module's code: what `python -m <former name>` (runpy) runs."""
        real = importlib.util.find_spec(FORMER_NAMES[name])
        loader = real.loader if real is not None else None
        return loader.get_code(FORMER_NAMES[name]) if isinstance(loader, importlib.abc.InspectLoader) else None


def install_finder() -> None:
    """Serve the former names (idempotent)."""
    if not any(isinstance(finder, FormerNameFinder) for finder in sys.meta_path):
        sys.meta_path.append(FormerNameFinder())
