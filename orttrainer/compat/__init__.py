"""The legacy import paths, in one wing.

- orttrainer's own former names (`orttrainer._checkpoint_storage`, `orttrainer.orttrainer_options`,
  `orttrainer.model_desc_validation`, `orttrainer._utils`, `orttrainer.run`, `orttrainer.legacy.*`) are served by
  `former_names.py` from the modules of this package and `orttrainer.capi`, always (no file at the old place);
- after `install()`, `onnxruntime.training` and `onnxruntime.capi.ort_trainer` serve orttrainer (below);
- `run.py` is `python -m orttrainer.run script.py`: a legacy script run unchanged with `install()` applied.

The one line a legacy script adds, before its `onnxruntime` imports::

    import orttrainer.compat; orttrainer.compat.install()

(or run it unchanged with `python -m orttrainer.run script.py`). Rules:

- Legacy modules the installed onnxruntime-training (1.19.2) does not have are plain aliases in `sys.modules`
  (`ALIASES`): `onnxruntime.training.orttrainer`, `.orttrainer_options`, `.model_desc_validation`, `.checkpoint`,
  `._checkpoint_storage`, `.postprocess`, `.optim.config`, `.optim.lr_scheduler`, `.amp.loss_scaler`,
  `onnxruntime.capi.ort_trainer` and `onnxruntime.capi.checkpointing_utils`.
- `onnxruntime.training` serves orttrainer's `ORTTrainer`, `ORTTrainerOptions`, `TrainStepInfo` and
  `PropagateCastOpsStrategy` (the enum the options hold, so that they compare equal).
- Packages both sides have (`OVERLAYS`: `onnxruntime.training`, `.optim`, `.amp`, `._utils`) become overlay
  modules: a name is looked up in orttrainer first, then in the real onnxruntime module, and the overlay keeps the
  real `__path__`, so `onnxruntime.training.onnxblock`, `.api`, `.artifacts`, `.ortmodule`, `optim.FusedAdam`, ...
  import and work as before. A submodule imported later is set on the real package too.
- Code holding the real module objects is unaffected; `uninstall()` restores every entry it replaced.
- `install()` is idempotent; it imports onnxruntime (and so torch). Without onnxruntime-training (a plain
  `onnxruntime`), the overlays have only orttrainer's names.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

ALIASES = {
    "onnxruntime.training.orttrainer": "orttrainer.trainer.orttrainer",
    "onnxruntime.training.orttrainer_options": "orttrainer.compat.orttrainer_options",
    "onnxruntime.training.model_desc_validation": "orttrainer.compat.model_desc_validation",
    "onnxruntime.training.checkpoint": "orttrainer.checkpoint",
    "onnxruntime.training._checkpoint_storage": "orttrainer.compat.checkpoint_storage",
    "onnxruntime.training.postprocess": "orttrainer.trainer.graph.postprocess",
    "onnxruntime.training.optim.config": "orttrainer.optim.config",
    "onnxruntime.training.optim.lr_scheduler": "orttrainer.optim.lr_scheduler",
    "onnxruntime.training.amp.loss_scaler": "orttrainer.amp.loss_scaler",
    "onnxruntime.capi.ort_trainer": "orttrainer.capi",
    "onnxruntime.capi.checkpointing_utils": "orttrainer.capi.checkpointing",
}
OVERLAYS = {
    "onnxruntime.training.optim": "orttrainer.optim",
    "onnxruntime.training.amp": "orttrainer.amp",
    "onnxruntime.training._utils": "orttrainer.compat.utils",
    "onnxruntime.training": None,  # orttrainer's public names and the legacy submodules (built in `_training_names`)
}
_MISSING = object()
_saved: dict[str, tuple[Any, Any]] | None = None  # module name -> (sys.modules entry, attribute on its parent)


class _Overlay(types.ModuleType):
    """A module whose attributes come from `layers` in order (orttrainer first, then the real module)."""

    def __init__(self, name: str, layers: list, real: types.ModuleType | None) -> None:
        super().__init__(name, f"orttrainer overlay of {name} (see orttrainer.compat)")
        state = self.__dict__
        state["_overlay_layers"] = layers
        state["_overlay_real"] = real
        if real is not None:
            for key in ("__path__", "__file__", "__spec__", "__loader__"):
                if hasattr(real, key):
                    state[key] = getattr(real, key)
        state["__package__"] = name
        state["__all__"] = _public_names(layers)

    def __getattr__(self, name: str) -> Any:
        for layer in self.__dict__["_overlay_layers"]:
            if isinstance(layer, dict):
                if name in layer:
                    return layer[name]
            elif hasattr(layer, name):
                return getattr(layer, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # importlib sets a newly imported submodule on its parent (this overlay); keep the real package in step.
        super().__setattr__(name, value)
        real = self.__dict__["_overlay_real"]
        if real is not None and not name.startswith("__"):
            setattr(real, name, value)

    def __dir__(self) -> list[str]:
        names = set(self.__dict__)
        for layer in self.__dict__["_overlay_layers"]:
            names.update(layer if isinstance(layer, dict) else dir(layer))
        return sorted(names)


def install() -> None:
    """Make the legacy module names resolve to orttrainer (see the module docstring). Idempotent."""
    global _saved
    if _saved is not None:
        return
    import onnxruntime  # noqa: F401 - the real package first: it imports the real onnxruntime.training
    import onnxruntime.capi  # noqa: F401

    modules = {name: importlib.import_module(target) for name, target in ALIASES.items()}
    for name, target in OVERLAYS.items():  # training last: it serves the other overlays
        real = _import_real(name)
        ours = _training_names(modules) if target is None else importlib.import_module(target)
        modules[name] = _Overlay(name, [ours, real] if real is not None else [ours], real)
    saved = {}
    for name in sorted(modules, key=lambda n: n.count(".")):  # parents before children
        parent_name, _, child = name.rpartition(".")
        parent = sys.modules[parent_name]
        # an overlay parent is ours and goes away; a real parent gets back what it had
        had = _MISSING if isinstance(parent, _Overlay) else parent.__dict__.get(child, _MISSING)
        saved[name] = (sys.modules.get(name, _MISSING), had)
        sys.modules[name] = modules[name]
        parent.__dict__[child] = modules[name]  # not setattr: an overlay would forward it to the real package
    _saved = saved


def uninstall() -> None:
    """Undo `install()`: every `sys.modules` entry and real-module attribute it replaced is restored."""
    global _saved
    if _saved is None:
        return
    for name, (entry, _) in _saved.items():
        if entry is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = entry
    for name, (_, attribute) in _saved.items():
        parent = sys.modules.get(name.rpartition(".")[0])
        if parent is None or isinstance(parent, _Overlay):
            continue
        if attribute is _MISSING:
            parent.__dict__.pop(name.rpartition(".")[2], None)
        else:
            parent.__dict__[name.rpartition(".")[2]] = attribute
    _saved = None


def is_installed() -> bool:
    """Whether `install()` is in effect."""
    return _saved is not None


def _training_names(modules: dict[str, types.ModuleType]) -> dict[str, Any]:
    """What `onnxruntime.training` serves from orttrainer: the legacy public names and submodules."""
    import orttrainer

    names = {
        "ORTTrainer": orttrainer.ORTTrainer,
        "ORTTrainerOptions": orttrainer.ORTTrainerOptions,
        "TrainStepInfo": orttrainer.TrainStepInfo,
        # The enum the options hold: a legacy script comparing the options' strategy with
        # `onnxruntime.training.PropagateCastOpsStrategy.X` must see equal values (onnxruntime's pybind enum never
        # equals ours). What the options are given, of either enum, is normalised to ours by the schema.
        "PropagateCastOpsStrategy": orttrainer.PropagateCastOpsStrategy,
    }
    prefix = "onnxruntime.training."
    names.update({n[len(prefix) :]: m for n, m in modules.items() if n.startswith(prefix) and n.count(".") == 2})
    return names


def _public_names(layers: list) -> list[str]:
    names: dict[str, None] = {}
    for layer in layers:
        listed = layer if isinstance(layer, dict) else getattr(layer, "__all__", None)
        if listed is None:
            listed = [n for n in vars(layer) if not n.startswith("_")]
        names.update(dict.fromkeys(listed))
    return list(names)


def _import_real(name: str) -> types.ModuleType | None:
    """The installed onnxruntime's module `name`, or None where this onnxruntime build has none."""
    current = sys.modules.get(name)
    if isinstance(current, _Overlay):
        return current.__dict__["_overlay_real"]
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
