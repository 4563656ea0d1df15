"""Exceptions of the recipes package."""

from __future__ import annotations

from gradpatch.errors import GradpatchError

__all__ = ["OutputExistsError", "PartialSumsWarning", "RecipeConfigError", "RecipeError", "StatisticsJobError"]


class RecipeError(GradpatchError):
    """Base class of the recipes' errors (a :class:`gradpatch.GradpatchError`)."""


class RecipeConfigError(RecipeError, ValueError):
    """A recipe configuration that cannot work (the message names the fix)."""


class OutputExistsError(RecipeError, FileExistsError):
    """A command's ``--out`` holds an earlier run and ``--overwrite`` was not given (the message names both)."""


class StatisticsJobError(RecipeError, ValueError):
    """A distributed statistics job cannot run or resume as asked: ranks that disagree on the corpus, nodes or model,
    or a resume file from another configuration (the message names the difference and the fix)."""


class PartialSumsWarning(UserWarning):
    """A partial-sum checkpoint of a statistics job was unreadable or damaged; its rank starts its shard again (the
    message names the file and the problem)."""
