"""Exception types raised by the editors package.

Every error message names the fix.
"""

from __future__ import annotations

from gradpatch.errors import FingerprintMismatchError, GradpatchError, LayoutError

__all__ = [
    "CacheRecomputedWarning",
    "ConflictingRequestsError",
    "EditError",
    "EditFingerprintError",
    "EditLoadError",
    "EditNotConvergedError",
    "LayerKindError",
    "StatisticsError",
    "SubjectNotFoundError",
    "TokenizationError",
    "TraceError",
    "TraceLayoutError",
]


class EditError(GradpatchError, RuntimeError):
    """Base class of the editors package's errors (a :class:`gradpatch.GradpatchError`)."""


class SubjectNotFoundError(EditError, ValueError):
    """The subject string does not occur in the prompt, or covers no token."""


class TokenizationError(EditError, ValueError):
    """A tokenizer cannot give what an editor needs (offsets, a target token, a prompt/target boundary)."""


class LayerKindError(EditError, TypeError):
    """The chosen NodePath is not a linear layer ROME can edit (``nn.Linear`` or a GPT-2 style ``Conv1D``)."""


class ConflictingRequestsError(EditError, ValueError):
    """A batch of facts asks for two different targets for one subject (the message names both requests)."""


class StatisticsError(EditError, ValueError):
    """The second-moment statistics are unusable (singular, wrong shape, empty corpus)."""


class EditLoadError(EditError, ValueError):
    """A saved edit is missing, unreadable or inconsistent (the message names the file), or does not match the graph
    or model it is applied to."""


class EditFingerprintError(EditLoadError, FingerprintMismatchError):
    """An edit is applied to a model other than the one it was computed on (the message gives both fingerprints)."""


class EditNotConvergedError(EditError):
    """The value search of an edit did not converge (its last loss is not below its first, or is not finite), so
    the edit is not applied unless asked for (``allow_unconverged=True``)."""


class CacheRecomputedWarning(UserWarning):
    """A cache file (second-moment statistics, context templates) was unreadable or inconsistent and is recomputed
    (the message names the file and what was wrong with it)."""


class TraceError(EditError, ValueError):
    """Causal tracing cannot run as asked (unknown kind or option, bad window, NodePaths that do not fit the model)."""


class TraceLayoutError(TraceError, LayoutError):
    """Causal tracing's NodePaths do not fit the model (a model of another family, a wrong ``ModelPaths``); the
    message names the NodePaths looked for and says to pass ``paths=ModelPaths(...)``."""
