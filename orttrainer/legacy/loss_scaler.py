"""Former name of :mod:`orttrainer.capi.loss_scaler`: importing this module yields that module object itself."""

from __future__ import annotations

from . import alias_submodule

alias_submodule(__name__)
