"""Exceptions of the recipes package."""

from __future__ import annotations

__all__ = ["RecipeConfigError", "RecipeError"]


class RecipeError(Exception):
    """Base class of the recipes' errors."""


class RecipeConfigError(RecipeError, ValueError):
    """A recipe configuration that cannot work (the message names the fix)."""
