"""The recipes' front doors load their names on first use (:func:`editors.lazy.lazy_exports`), naming the
``recipes`` extra when Lightning, TensorBoard or jsonargparse is missing."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from editors import lazy_exports

__all__ = ["recipe_exports"]

#: What to install when a room's module needs a missing optional library.
INSTALL_HINT = "pip install 'gradpatch[recipes]'"
#: The optional libraries the rooms' modules import.
OPTIONAL = ("lightning", "tensorboard", "jsonargparse")


def recipe_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` of a recipes front door whose public names live in its submodules (``exports``:
    name -> submodule), with the recipes' install hint.

    Raises:
        AttributeError, ImportError: (from ``__getattr__``) as :func:`editors.lazy.lazy_exports`.
    """
    return lazy_exports(package, exports, install_hint=INSTALL_HINT, optional=OPTIONAL)
