"""Deprecated name of :mod:`gradpatch.loaders` (the model loaders), kept for one release: importing it warns once.

Use ``from gradpatch.loaders import load_model`` (and the other names of :data:`gradpatch.loaders.__all__`).
"""

from __future__ import annotations

from .deprecation import warn_deprecated
from .loaders import *  # noqa: F403  (the old module's public names, unchanged)
from .loaders import __all__  # noqa: F401

warn_deprecated("gradpatch.models", "gradpatch.loaders", stacklevel=2)
