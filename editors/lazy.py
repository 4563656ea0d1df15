"""Lazy public names for a package (PEP 562): ``from editors import ROME`` imports :mod:`editors.rome` on first use.

A package whose ``__init__`` imports nothing heavy can be imported without torch, so a command's ``--help`` that
reads defaults from a configuration module (e.g. :class:`editors.causal_trace.TraceConfig`) stays fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], *, install_hint: str = "",
                 optional: tuple[str, ...] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose public names live in its submodules.

    Args:
        package: the package's ``__name__``, e.g. ``"editors"``.
        exports: public name -> the submodule (relative to ``package``) that defines it, e.g. ``{"ROME": "rome"}``;
            each leading dot goes one package up (``".errors"`` in ``editors.causal_trace`` is ``editors.errors``).
        install_hint: what to install when one of the ``optional`` modules is missing, e.g.
            ``"pip install 'gradpatch[recipes]'"``.
        optional: top-level modules some submodules need that may be absent (``"lightning"``, ``"tensorboard"``).

    Returns:
        ``(__getattr__, __dir__)`` to assign in the package's ``__init__``. ``__getattr__`` imports the submodule
        that defines a public name, or a submodule named like the attribute (``editors.statistics.second_moment``).

    Raises:
        AttributeError: (from ``__getattr__``) the name is neither a public name nor a submodule.
        ImportError: (from ``__getattr__``) an ``optional`` module is missing; the message names ``install_hint``.
    """

    def getattr_(name: str) -> Any:
        if name in exports:
            try:
                return getattr(importlib.import_module(f".{exports[name]}", package), name)
            except ModuleNotFoundError as error:
                if error.name in optional:
                    raise ImportError(f"{package}.{name} needs {error.name}: {install_hint}") from error
                raise
        try:
            return importlib.import_module(f".{name}", package)
        except ModuleNotFoundError as error:
            if error.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def dir_() -> list[str]:
        return sorted(exports)

    return getattr_, dir_
