"""Deprecated name of :mod:`gradpatch.value_info`, kept for one release: importing it warns once."""

from __future__ import annotations

from .deprecation import warn_deprecated
from .value_info import *  # noqa: F403  (the old module's names, unchanged)
from .value_info import __all__  # noqa: F401

warn_deprecated("gradpatch.values", "gradpatch.value_info", stacklevel=2)
