"""Exception types raised by the editors package.

Every error message names the fix.
"""

from __future__ import annotations

__all__ = [
    "EditError",
    "EditLoadError",
    "LayerKindError",
    "StatisticsError",
    "SubjectNotFoundError",
    "TokenizationError",
]


class EditError(RuntimeError):
    """Base class of the editors package's errors."""


class SubjectNotFoundError(EditError, ValueError):
    """The subject string does not occur in the prompt, or covers no token."""


class TokenizationError(EditError, ValueError):
    """A tokenizer cannot give what an editor needs (offsets, a target token, a prompt/target boundary)."""


class LayerKindError(EditError, TypeError):
    """The chosen NodePath is not a linear layer ROME can edit (``nn.Linear`` or a GPT-2 style ``Conv1D``)."""


class StatisticsError(EditError, ValueError):
    """The second-moment statistics are unusable (singular, wrong shape, empty corpus)."""


class EditLoadError(EditError, ValueError):
    """A saved edit does not match the graph or model it is applied to."""
