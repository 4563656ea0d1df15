"""Exception types raised by the patch engine."""

from __future__ import annotations


class GradpatchError(Exception):
    """Base class of gradpatch's own errors."""


class ExtractionError(GradpatchError):
    """A module's graph could not be extracted (data-dependent control flow, grad-mode changes, ...).

    Raised to the caller only with ``ExtractionOptions(error_on_compilation_failure=True)``; otherwise the
    module falls back to an :class:`~gradpatch.extraction.graph_modules.OpaqueGraphModule`.
    """


class CompilationWarning(UserWarning):
    """A module falls back to an opaque wrapper, or a submodule was never called (with
    ``ExtractionOptions(warn_on_compilation_failure=True)``)."""


class DataDependentControlFlow(ExtractionError):
    """Python control flow depends on tensor values (``if x.sum() > 0:``, ``x.item()``), so no single graph exists."""


class PatchShapeError(GradpatchError, ValueError):
    """A patch value cannot be combined with the activation it patches (the message gives both shapes)."""


class InputSignatureError(GradpatchError, TypeError):
    """A call passes arguments that differ in kind from the example inputs the graph was extracted with."""


class ShapeSpecializationError(GradpatchError, RuntimeError):
    """A call's shapes change a Python decision that the model's code made on the example's shapes."""


class NonFiniteError(GradpatchError, FloatingPointError):
    """A loss term, gradient or value that must be finite holds NaN or ±inf (the message names which, where, at
    which optimisation step, and the fix)."""


class FingerprintMismatchError(GradpatchError, ValueError):
    """Saved patches or edits belong to a model other than the one they are applied to (the message gives both
    fingerprints)."""


class InterventionLoadError(GradpatchError, ValueError):
    """Saved intervention files are missing, unreadable or inconsistent (the message names the file and the fix)."""


class NodePathError(GradpatchError, KeyError, ValueError):
    """A NodePath that names no node, or a node that cannot take a patch (a submodule's graph, a container without
    a ``|sub_i`` dig, a constant baked into the graph). A ``KeyError`` (as graphpatch raises) and a ``ValueError``.
    """

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""


class SubspaceConfigError(GradpatchError, ValueError):
    """A trainable subspace patch or an interchange run that cannot work (a subspace wider than its node, a node
    whose activation is not ``[batch, seq, d]``, base and source of different lengths without positions, a subject
    missing from its prompt); raised before any forward pass, the message names the fix."""


class LayoutError(GradpatchError, ValueError):
    """A graph has no NodePath where a model layout (:class:`~gradpatch.layouts.ModelLayout`) says a part is, or no
    known layout fits it; the message names the NodePaths looked for and how to name this model's own."""
