"""Old names kept for one release: each warns with a :class:`DeprecationWarning` the first time it is used in a
process, naming what replaces it (a renamed module, attribute or function)."""

from __future__ import annotations

import warnings

__all__ = ["warn_deprecated"]

#: Old names already warned about in this process.
_WARNED: set[str] = set()


def warn_deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn once per process that ``old`` is deprecated (it goes in the next release) and ``new`` replaces it.

    Args:
        old: the old name as a user writes it, e.g. ``"gradpatch.models"`` or ``"SecondMoment.node"``.
        new: what to use instead, e.g. ``"gradpatch.loaders"``.
        stacklevel: the frame the warning points at (3: the caller of the function that calls this one).
    """
    if old in _WARNED:
        return
    _WARNED.add(old)
    warnings.warn(f"{old} is deprecated (it goes in the next release): use {new}", DeprecationWarning,
                  stacklevel=stacklevel)
