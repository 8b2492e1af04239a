"""Former name of :mod:`orttrainer.capi.descriptions`: importing this module yields that module object itself."""

from __future__ import annotations

from . import alias_submodule

alias_submodule(__name__)
