"""bitsandbytes, when installed: its quantized linear layers (8-bit ``Linear8bitLt``, 4-bit ``Linear4bit``).

``AVAILABLE`` says whether ``bitsandbytes`` imported (its import prints and warns on machines without a GPU;
both are silenced here). Without it, the classes are empty stand-ins, so ``isinstance`` checks are false.
"""

from __future__ import annotations

import contextlib
import warnings

try:
    with contextlib.redirect_stdout(None), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from bitsandbytes.nn import Linear4bit, Linear8bitLt
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the environment
    AVAILABLE = False

    class Linear8bitLt:  # type: ignore[no-redef]
        """Stand-in: bitsandbytes is not installed."""

    class Linear4bit:  # type: ignore[no-redef]
        """Stand-in: bitsandbytes is not installed."""


__all__ = ["AVAILABLE", "Linear4bit", "Linear8bitLt"]
