"""Deprecated name of :mod:`gradpatch.patch_table`, kept for one release: importing it warns once."""

from __future__ import annotations

from .deprecation import warn_deprecated
from .patch_table import *  # noqa: F403  (the old module's names, unchanged)
from .patch_table import __all__  # noqa: F401

warn_deprecated("gradpatch.patching", "gradpatch.patch_table", stacklevel=2)
