"""Exception types raised by gradient attribution (the engine's non-finite gradients raise
:class:`gradpatch.errors.NonFiniteError`)."""

from __future__ import annotations

from ..errors import GradpatchError, LayoutError


class AttributionError(GradpatchError, ValueError):
    """Bad input to an attribution run: prompts of different token lengths, an answer or foil that is not one token,
    a metric that is not a scalar, an unknown node kind or NodePath (the message names the fix). Raised before any
    forward pass."""


class AttributionLayoutError(AttributionError, LayoutError):
    """Node kinds or edges asked of a graph whose layout does not have them (a model of another family, a GPT-2
    graph for edges); the message names the NodePaths looked for."""
