"""Exceptions of the recipes package."""

from __future__ import annotations

from gradpatch.errors import GradpatchError

__all__ = ["RecipeConfigError", "RecipeError"]


class RecipeError(GradpatchError):
    """Base class of the recipes' errors (a :class:`gradpatch.GradpatchError`)."""


class RecipeConfigError(RecipeError, ValueError):
    """A recipe configuration that cannot work (the message names the fix)."""
