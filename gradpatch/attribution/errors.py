"""Exception types raised by gradient attribution (the engine's non-finite gradients raise
:class:`gradpatch.errors.NonFiniteError`)."""

from __future__ import annotations

from ..errors import GradpatchError


class AttributionError(GradpatchError, ValueError):
    """Bad input to an attribution run: prompts of different token lengths, an answer or foil that is not one token,
    a metric that is not a scalar, an unknown node kind or NodePath (the message names the fix). Raised before any
    forward pass."""
